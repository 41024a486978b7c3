"""`dart-hf demo`: the default target and the shipped head, side by side on one prompt.

Streams the DART answer as it is accepted, then times plain `generate` and DART alternately (`--repeats` runs each,
the order flipped every round, so a slow spell or a warming cache hits both alike) on the same prompt and the same
torch threads (the demo changes no thread count or other process-wide setting), and prints each one's median
tokens/s, the median of the per-round speed-ups with their range, the mean accepted length and whether every output
equals plain `generate`'s. A speed-up is a claim about an idle machine: when other processes used the CPU during
the timed runs (`calibrate.CpuUse`) the demo says that the ratio is not trustworthy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import TextStreamer

from .assets import announce_installs, chat_input_ids, load_target, shipped_head
from .calibrate import CpuUse
from ..core.modeling import DartHead
from ..core.target import check_head_matches_target, prepare_head

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short explanation."


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def load_target_and_head(target_name: str, head_path, dtype: torch.dtype, **target_kwargs):
    """(target, tokenizer, head placed for it), or a ValueError / OSError that says which input is wrong.
    `head_path` None: the shipped head. Used by `dart-hf demo` and `dart-hf bench`."""
    head = DartHead.from_pretrained(head_path if head_path is not None else shipped_head()).eval()  # fails fastest
    target, tokenizer = load_target(target_name, dtype=dtype, **target_kwargs)
    check_head_matches_target(head, target)
    return target, tokenizer, prepare_head(head, target)


def interleaved_runs(plain, dart, repeats: int) -> dict:
    """Run `plain()` and `dart()` (each returns its output ids) `repeats` times each, alternating and flipping the
    order every round (plain first in even rounds), under `CpuUse`. Returns {"plain": [seconds], "dart": [seconds],
    "outputs": [(plain ids, dart ids)] per round, "cpu": the CpuUse}."""
    out = {"plain": [], "dart": [], "outputs": []}
    with CpuUse() as use:
        for r in range(repeats):
            got = {}
            for name in (("plain", "dart") if r % 2 == 0 else ("dart", "plain")):
                got[name], seconds = _timed(plain if name == "plain" else dart)
                out[name].append(seconds)
            out["outputs"].append((got["plain"], got["dart"]))
    out["cpu"] = use
    return out


def summary(runs: dict, prompt_length: int) -> dict:
    """Median tokens/s of each method and the median (min, max) of the per-round speed-ups (a round's two runs ran
    next to each other, so their ratio is less exposed to load changes than a ratio of medians)."""
    tokens = [(p.shape[1] - prompt_length, d.shape[1] - prompt_length) for p, d in runs["outputs"]]
    plain_tps = [n / s for (n, _), s in zip(tokens, runs["plain"])]
    dart_tps = [n / s for (_, n), s in zip(tokens, runs["dart"])]
    ratios = [d / p for p, d in zip(plain_tps, dart_tps)]
    return {"plain_tps": statistics.median(plain_tps), "dart_tps": statistics.median(dart_tps),
            "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "tokens": tokens[0][0], "identical": all(torch.equal(p, d) for p, d in runs["outputs"])}


def run(args: argparse.Namespace) -> int:
    repeats = getattr(args, "repeats", 3)
    if args.max_new_tokens < 1:
        print(f"dart-hf demo: error: --max-new-tokens must be at least 1, got {args.max_new_tokens}", file=sys.stderr)
        return 2
    if repeats < 1:
        print(f"dart-hf demo: error: --repeats must be at least 1, got {repeats}", file=sys.stderr)
        return 2
    announce_installs("dart-hf demo", args.target)
    try:
        target, tokenizer, head = load_target_and_head(args.target, args.head, getattr(torch, args.dtype))
    except (OSError, ValueError) as err:  # unknown target, missing or broken head folder, head for another model
        print(f"dart-hf demo: error: {err}", file=sys.stderr)
        return 2
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    ids = chat_input_ids(tokenizer, prompt).to(target.device)
    gen = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=8)  # warm-up (first-call costs)
    target.generate(ids, do_sample=False, max_new_tokens=8)
    print(f"\n>>> {prompt}\n")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    streamed = target.generate(ids, assistant_model=head, streamer=streamer, **gen)  # the answer; not timed
    stats = dict(head.stats)
    print(f"\ntiming plain generate and DART alternately, {repeats} run(s) each, on {torch.get_num_threads()} torch "
          f"thread(s)...", flush=True)
    runs = interleaved_runs(lambda: target.generate(ids, **gen),
                            lambda: target.generate(ids, assistant_model=head, **gen), repeats)
    result = summary(runs, ids.shape[1])
    identical = result["identical"] and torch.equal(streamed, runs["outputs"][0][0])
    runs_text = f"median of {repeats} runs" if repeats > 1 else "1 run"
    print(f"plain generate : {result['plain_tps']:6.1f} tokens/s ({runs_text}, {result['tokens']} tokens each)")
    print(f"DART           : {result['dart_tps']:6.1f} tokens/s ({runs_text})")
    if repeats > 1:
        print(f"speed-up       : {result['speedup']:6.2f}x (median over the {repeats} back-to-back pairs; "
              f"{result['speedup_min']:.2f}-{result['speedup_max']:.2f}x)")
    else:
        print(f"speed-up       : {result['speedup']:6.2f}x")
    print(f"mean accepted length: {stats['mean_accepted_length']:.2f} tokens per target forward "
          f"({stats['steps']} forwards); identical to plain generate: {identical}")
    busy = runs["cpu"].busy()
    if busy:
        print(f"dart-hf demo: the machine was busy ({busy}): the speed-up above measures contention for the CPU as "
              f"much as drafting and is not trustworthy. Run the demo again with nothing else running, or "
              f"`dart-hf bench --runs 3` for a longer measurement.", file=sys.stderr)
    return 0
