"""`dart-hf demo`: the default target and the shipped head, side by side on one prompt.

Streams the DART answer as it is accepted, then runs plain `generate` on the same prompt and prints
tokens/s of both, the speedup, the mean accepted length and whether the two outputs are identical.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import TextStreamer

from .assets import chat_input_ids, load_target, shipped_head
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


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        print(f"dart-hf demo: error: --max-new-tokens must be at least 1, got {args.max_new_tokens}", file=sys.stderr)
        return 2
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
    dart_out, dart_s = _timed(lambda: target.generate(ids, assistant_model=head, streamer=streamer, **gen))
    stats = dict(head.stats)
    plain_out, plain_s = _timed(lambda: target.generate(ids, **gen))
    n_dart, n_plain = dart_out.shape[1] - ids.shape[1], plain_out.shape[1] - ids.shape[1]
    print(f"\nplain generate : {n_plain / plain_s:6.1f} tokens/s ({n_plain} tokens in {plain_s:.1f} s)")
    print(f"DART           : {n_dart / dart_s:6.1f} tokens/s ({n_dart} tokens in {dart_s:.1f} s)"
          f"  -> {plain_s / n_plain * n_dart / dart_s:.2f}x")
    print(f"mean accepted length: {stats['mean_accepted_length']:.2f} tokens per target forward "
          f"({stats['steps']} forwards); identical to plain generate: {torch.equal(dart_out, plain_out)}")
    return 0


