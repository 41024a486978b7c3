"""End-to-end latency of chat requests through `dart-hf serve`: a server with a DART head against one without.

Sends the benchmark's prompts (the first N HumanEval problems and N held-out ShareGPT first turns, as `dart-hf bench`
takes them) one request at a time, greedy, non-streaming, alternating the servers prompt by prompt (so a busy spell of
the machine hits both alike), after one warm-up request each; checks that both servers give the same answer; prints
each server's median latency per data set and total seconds per run, and the ratio no head / DART with its spread
over the runs. Start both servers first (they idle while the other answers):

    dart-hf serve smollm2-135m-instruct --port 8000 &
    dart-hf serve smollm2-135m-instruct --no-head --port 8001 &
    python examples/serve_latency.py --dart http://127.0.0.1:8000/v1 --plain http://127.0.0.1:8001/v1 --runs 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import openai

from dart_hf.tools.datasets import HUMANEVAL_INSTRUCTION, USER_TEXT_MAX_CHARS, load_humaneval, load_sharegpt


def prompts(n: int) -> dict[str, list[str]]:
    """The user texts behind `dart_hf.tools.datasets.eval_prompts` (which returns them tokenized)."""
    return {
        "humaneval": [HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"]) for problem in load_humaneval()[:n]],
        "sharegpt": [turns[0]["content"][:USER_TEXT_MAX_CHARS] for turns in load_sharegpt("heldout", limit=n)],
    }


def ask(client: openai.OpenAI, model: str, text: str, max_tokens: int) -> tuple[float, str, int]:
    """(seconds from sending to the whole answer, the answer, its tokens)."""
    started = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                           max_tokens=max_tokens, temperature=0)
    return time.perf_counter() - started, reply.choices[0].message.content, reply.usage.completion_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dart", required=True, help="base URL of the server with the head (…/v1)")
    parser.add_argument("--plain", required=True, help="base URL of the server without a head (…/v1)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the served target, as requests name it")
    parser.add_argument("--n", type=int, default=5, help="prompts per data set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1, help="passes over the prompts")
    args = parser.parse_args()

    servers = {name: openai.OpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)
               for name, url in (("dart", args.dart), ("plain", args.plain))}
    sets = prompts(args.n)
    for client in servers.values():  # first-request costs (the head's placement, the budget's warning) untimed
        ask(client, args.model, "Hello!", 8)
    ratios, mismatches = [], 0
    for run in range(args.runs):
        seconds = {name: {dataset: [] for dataset in sets} for name in servers}
        tokens = dict.fromkeys(servers, 0)
        for dataset, texts in sets.items():
            for text in texts:
                answers = {}
                for name, client in servers.items():
                    elapsed, answers[name], count = ask(client, args.model, text, args.max_tokens)
                    seconds[name][dataset].append(elapsed)
                    tokens[name] += count
                mismatches += answers["dart"] != answers["plain"]
        totals = {name: sum(sum(per_set) for per_set in seconds[name].values()) for name in servers}
        ratios.append(totals["plain"] / totals["dart"])
        for name in servers:
            medians = ", ".join(f"{dataset} {statistics.median(s):.2f} s" for dataset, s in seconds[name].items())
            print(f"run {run + 1} {name:5}: median latency {medians}; total {totals[name]:.1f} s, "
                  f"{tokens[name]} tokens ({tokens[name] / totals[name]:.1f} tokens/s)")
        print(f"run {run + 1}: no head / DART total time {ratios[-1]:.2f}x")
    print(f"speed-up, median (min-max) of {len(ratios)} runs: {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f}); answers differing: {mismatches}")


if __name__ == "__main__":
    main()
