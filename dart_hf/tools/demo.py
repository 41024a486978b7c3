"""`dart-hf demo`: the default target and the shipped head, side by side on one prompt.

Streams the DART answer as it is accepted, then times plain `generate` and DART alternately (`--repeats` pairs, the
order flipped every pair, so a slow spell or a warming cache hits both alike) on the same prompt and torch threads,
printing each pair's speeds as it finishes, and then each method's median tokens/s, the speed-up as the quotient of
those two medians (with the pairs' range), the mean accepted length and whether every output equals plain
`generate`'s.

A busy CPU is handled before timing, not explained after it: the command owns its process, so when other processes
are using the CPU it runs torch on the cores they leave free (`machine.choose_threads`; torch's threads wait for
each other, and on a 2-core machine beside one busy process 2 threads decoded at ~1 token/s where 1 thread decoded
at 17) and says so; `--threads` overrides. Everything after loading the target runs within `--time-limit` seconds:
the streamed answer is cut at its share of it, and pairs stop when the next would not fit; the demo then reports what
it measured and says that it stopped early. Other processes' CPU use during the timed runs (`machine.CpuUse`) is
reported beside the speed-up. The thread count is restored when the command returns (`dart_hf_cli.main` may run
inside another program's process).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
from transformers import TextStreamer

from .assets import announce_installs, load_target, shipped_head
from .machine import CpuUse, ThreadChoice, choose_threads
from .datasets import chat_input_ids
from ..core.modeling import DartHead
from ..core.target import check_head_matches_target, prepare_head

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short explanation."
DEFAULT_TIME_LIMIT = 150.0  # seconds after loading: with loading, a demo a user can wait for (under 3 minutes)
PROGRESS_SECONDS = 5.0  # a timed run that lasts longer prints how far it is this often

Run = Callable[[float | None, "Progress"], torch.Tensor]
"""A timed method: (max_time in seconds or None, a progress streamer) -> the output ids."""


def load_target_and_head(target_name: str, head_path, dtype: torch.dtype, **target_kwargs):
    """(target, tokenizer, head placed for it), or a ValueError / OSError that says which input is wrong.
    `head_path` None: the shipped head. Used by `dart-hf demo` and `dart-hf bench`."""
    head = DartHead.from_pretrained(head_path if head_path is not None else shipped_head()).eval()  # fails fastest
    target, tokenizer = load_target(target_name, dtype=dtype, **target_kwargs)
    check_head_matches_target(head, target)
    return target, tokenizer, prepare_head(head, target)


class Progress:
    """A streamer for one timed run that prints its tokens and tokens/s so far, at most every `every` seconds: on a
    slow machine a run takes minutes and would otherwise print nothing; a fast run prints nothing."""

    def __init__(self, label: str, every: float = PROGRESS_SECONDS):
        self.label, self.every = label, every
        self.start = self.last = time.perf_counter()
        self.tokens: int | None = None  # None until the prompt (the first `put`) went by

    def put(self, value: torch.Tensor) -> None:
        if self.tokens is None:
            self.tokens = 0
            return
        self.tokens += value.numel()
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            print(f"    {self.label}: {self.tokens} tokens in {now - self.start:.0f} s, "
                  f"{self.tokens / (now - self.start):.1f} tokens/s so far", flush=True)

    def end(self) -> None:
        pass


def _tps(value: float) -> str:
    """tokens/s as printed: one decimal, two below 10 tokens/s (so that the quotient of two printed speeds is the
    printed speed-up, to its rounding, on a slow machine too)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def interleaved_runs(plain: Run, dart: Run, repeats: int, prompt_length: int, deadline: float | None = None,
                     show: bool = True) -> dict:
    """Run `plain` and `dart` in `repeats` back-to-back pairs, the order flipped every pair (plain first in even
    pairs), under `CpuUse`, printing each pair's tokens/s as it ends (`show`).

    `deadline` (a `time.perf_counter()` value; None: none) bounds the whole: the first pair always runs, a later one
    only while the previous pair's duration still fits before the deadline, and each run is given `max_time` = half
    the time left when its pair started (at least a second), so a run that would pass the deadline stops there (its
    tokens/s stays a measurement, of a shorter answer). Returns {"plain": [seconds], "dart": [seconds],
    "outputs": [(plain ids, dart ids)] per pair, "cpu": the CpuUse, "stopped": why fewer than `repeats` pairs ran
    or a run was cut (None: every pair ran whole)}."""
    out = {"plain": [], "dart": [], "outputs": [], "stopped": None}
    estimate = 0.0
    with CpuUse() as use:
        for r in range(repeats):
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and r > 0 and estimate > left:
                out["stopped"] = (f"stopped after {r} of {repeats} pairs: another (~{estimate:.0f} s) would pass "
                                  f"--time-limit")
                break
            max_time = None if left is None else max(left / 2, 1.0)
            started, got, seconds, cut = time.perf_counter(), {}, {}, False
            for name in (("plain", "dart") if r % 2 == 0 else ("dart", "plain")):
                label = f"pair {r + 1}/{repeats}, {'plain generate' if name == 'plain' else 'DART'}"
                run = plain if name == "plain" else dart
                t0 = time.perf_counter()
                got[name] = run(max_time, Progress(label))
                seconds[name] = time.perf_counter() - t0
                cut = cut or (max_time is not None and seconds[name] >= max_time)
            estimate = time.perf_counter() - started
            for name in ("plain", "dart"):
                out[name].append(seconds[name])
            out["outputs"].append((got["plain"], got["dart"]))
            if show:
                rate = {n: (got[n].shape[1] - prompt_length) / seconds[n] for n in got}  # in the order they ran
                ran = ", ".join(f"{'plain' if n == 'plain' else 'DART'} {_tps(v)}" for n, v in rate.items())
                print(f"  pair {r + 1}/{repeats}: {ran} tokens/s ({rate['dart'] / rate['plain']:.2f}x)", flush=True)
            if cut:
                out["stopped"] = f"stopped in pair {r + 1} of {repeats}: a run reached --time-limit and was cut short"
                break
    out["cpu"] = use
    return out


def summary(runs: dict, prompt_length: int, reference: torch.Tensor | None = None) -> dict:
    """Each method's median tokens/s, the speed-up as the quotient of those medians (so the printed ratio is the
    printed speeds' ratio) and the range of the per-pair ratios (a pair's two runs ran next to each other).
    `identical`: every output equals `reference` (default: the first pair's plain output) over its own length (a run
    cut at the time limit is a prefix)."""
    tokens = [(p.shape[1] - prompt_length, d.shape[1] - prompt_length) for p, d in runs["outputs"]]
    plain_tps = [n / s for (n, _), s in zip(tokens, runs["plain"])]
    dart_tps = [n / s for (_, n), s in zip(tokens, runs["dart"])]
    ratios = [d / p for p, d in zip(plain_tps, dart_tps)]
    reference = runs["outputs"][0][0] if reference is None else reference
    outputs = [ids for pair in runs["outputs"] for ids in pair]
    identical = all(ids.shape[1] <= reference.shape[1] and torch.equal(ids, reference[:, : ids.shape[1]])
                    for ids in outputs)
    plain, dart = statistics.median(plain_tps), statistics.median(dart_tps)
    counts = [n for pair in tokens for n in pair]
    return {"plain_tps": plain, "dart_tps": dart, "speedup": dart / plain, "speedup_min": min(ratios),
            "speedup_max": max(ratios), "pairs": len(ratios), "tokens": (min(counts), max(counts)),
            "identical": identical}


def print_summary(result: dict, stats: dict) -> None:
    pairs, (low, high) = result["pairs"], result["tokens"]
    runs_text = f"median of {pairs} runs" if pairs > 1 else "1 run"
    tokens_text = f"{low} token{'s' if low != 1 else ''} each" if low == high else f"{low}-{high} tokens"
    print(f"plain generate : {_tps(result['plain_tps']):>6} tokens/s ({runs_text}, {tokens_text})")
    print(f"DART           : {_tps(result['dart_tps']):>6} tokens/s ({runs_text})")
    quotient = f"{_tps(result['dart_tps'])} / {_tps(result['plain_tps'])}"
    if pairs > 1:
        print(f"speed-up       : {result['speedup']:6.2f}x (= {quotient}, the medians above; the {pairs} pairs "
              f"ranged {result['speedup_min']:.2f}-{result['speedup_max']:.2f}x)")
    else:
        print(f"speed-up       : {result['speedup']:6.2f}x (= {quotient})")
    print(f"mean accepted length: {stats['mean_accepted_length']:.2f} tokens per target forward "
          f"({stats['steps']} forwards); identical to plain generate: {result['identical']}")


def _check_args(args: argparse.Namespace) -> str | None:
    """The first invalid option, as an error message (None: all valid)."""
    for option, value, least in (("--max-new-tokens", args.max_new_tokens, 1),
                                 ("--repeats", getattr(args, "repeats", 3), 1),
                                 ("--threads", getattr(args, "threads", None), 1)):
        if value is not None and value < least:
            return f"{option} must be at least {least}, got {value}"
    limit = getattr(args, "time_limit", DEFAULT_TIME_LIMIT)
    if not limit > 0:
        return f"--time-limit must be positive, got {limit}"
    return None


def run(args: argparse.Namespace) -> int:
    error = _check_args(args)
    if error:
        print(f"dart-hf demo: error: {error}", file=sys.stderr)
        return 2
    announce_installs("dart-hf demo", args.target)
    try:
        target, tokenizer, head = load_target_and_head(args.target, args.head, getattr(torch, args.dtype))
    except (OSError, ValueError) as err:  # unknown target, missing or broken head folder, head for another model
        print(f"dart-hf demo: error: {err}", file=sys.stderr)
        return 2
    choice = choose_threads(getattr(args, "threads", None))  # before any timing: the remedy, not an excuse after
    try:
        torch.set_num_threads(choice.threads)  # the command owns its process (restored below)
        _run_demo(args, target, tokenizer, head, choice)
    finally:
        torch.set_num_threads(choice.default)
    return 0


def _run_demo(args: argparse.Namespace, target, tokenizer, head: DartHead, choice: ThreadChoice) -> None:
    repeats = getattr(args, "repeats", 3)
    limit = getattr(args, "time_limit", DEFAULT_TIME_LIMIT)
    deadline = time.perf_counter() + limit
    print(f"dart-hf demo: runs on {choice.reason}", flush=True)
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    ids = chat_input_ids(tokenizer, prompt).to(target.device)
    target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=8)  # warm-up (first-call costs)
    target.generate(ids, do_sample=False, max_new_tokens=8)
    print(f"\n>>> {prompt}\n")
    share = (deadline - time.perf_counter()) / (1 + 2 * repeats)  # the answer, then 2 * repeats timed runs like it
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    started = time.perf_counter()
    streamed = target.generate(ids, assistant_model=head, streamer=streamer, do_sample=False,
                               max_new_tokens=args.max_new_tokens, max_time=share)  # the answer; not timed
    answer_seconds = time.perf_counter() - started
    stats = dict(head.stats)
    new_tokens = streamed.shape[1] - ids.shape[1]
    if answer_seconds >= share and new_tokens < args.max_new_tokens:
        print(f"\n[the answer stopped at {new_tokens} token(s), its share of --time-limit {limit:g} s; the timed "
              f"runs are answers of that length]")
    print(f"\ntiming plain generate and DART alternately, {repeats} pair(s) of runs, on "
          f"{choice.threads} torch thread(s), within --time-limit ({max(0.0, deadline - time.perf_counter()):.0f} s "
          f"left)...",
          flush=True)
    gen = dict(do_sample=False, max_new_tokens=new_tokens)
    runs = interleaved_runs(
        lambda max_time, progress: target.generate(ids, max_time=max_time, streamer=progress, **gen),
        lambda max_time, progress: target.generate(ids, assistant_model=head, max_time=max_time, streamer=progress,
                                                   **gen),
        repeats, ids.shape[1], deadline=deadline)
    if runs["stopped"]:
        print(f"dart-hf demo: {runs['stopped']} ({limit:g} s); the numbers below are what was measured")
    print_summary(summary(runs, ids.shape[1], reference=streamed), stats)
    busy = runs["cpu"].busy()
    if busy:
        remedy = (f"--threads {max(1, choice.threads - 1)} or stopping them" if choice.threads > 1 else
                  "stopping them")
        print(f"dart-hf demo: during the timed runs {busy}: the speed-up above measures contention for the CPU as "
              f"much as drafting; {remedy} gives a cleaner one")
