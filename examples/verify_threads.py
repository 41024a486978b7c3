"""Verify-forward time on 1 thread vs torch's default, interleaved (run it with and without a competing load).

    python examples/verify_threads.py [--target smollm2-135m-instruct] [--repeats 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from dart_hf.core.runtime import verify_runtime
from dart_hf.core.target import cache_kwargs
from dart_hf.core.verify import verify_tree
from dart_hf.tools.assets import load_target
from dart_hf.tools.calibrate import synthetic_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--past-len", type=int, default=200)
    args = parser.parse_args()
    target, _ = load_target(args.target)
    cfg, default = target.config, torch.get_num_threads()
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        target(input_ids=torch.randint(cfg.vocab_size, (1, args.past_len)), use_cache=True, **cache_kwargs(target, cache))
    trees = {n: synthetic_tree(n, target.device, cfg.vocab_size) for n in (1, 4)}
    times: dict[tuple, list[float]] = {}
    with torch.no_grad(), verify_runtime(target):
        for _ in range(args.repeats):
            for threads in sorted({default, 1}, reverse=True):
                torch.set_num_threads(threads)
                for n, tree in trees.items():
                    start = time.perf_counter()
                    verify_tree(target, tree, cache, args.past_len)
                    times.setdefault((threads, f"{n}-token verify"), []).append(time.perf_counter() - start)
                    cache.crop(args.past_len - cache.get_seq_length())
    torch.set_num_threads(default)
    for (threads, what), ts in sorted(times.items()):
        print(f"{threads} thread(s), {what}: median {1e3 * statistics.median(ts):.0f} ms, min {1e3 * min(ts):.0f} ms")


if __name__ == "__main__":
    main()
