"""The verify forward's cost by tree size on this device, measured on demand (`dart-hf bench --synthetic`: the cost
model of a GPU run, step time per size x accepted tokens). Decoding never reads it: the size rule times its own steps
(`dart_hf.core.budget`)."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..core.step import decode_cache, verify_tree
from ..core.target import cache_kwargs
from ..core.tree import DraftTree, ancestor_mask
from .machine import CpuUse

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96)
DEFAULT_PAST_LEN = 256
DEFAULT_REPEATS = 3  # interleaved rounds per measurement: the median of 3 discards one slow spell per size


@dataclass
class VerifyCost:
    """Seconds of one verify forward by number of tree tokens N (root included), piecewise linear between the
    measured sizes and extrapolated along the last segment. `record`: how and when it was measured."""

    sizes: list[int]
    seconds: list[float]
    record: dict = field(default_factory=dict)

    def __call__(self, n) -> np.ndarray | float:
        xs, ys = np.asarray(self.sizes, dtype=float), np.asarray(self.seconds, dtype=float)
        n_arr = np.asarray(n, dtype=float)
        out = np.interp(n_arr, xs, ys)
        if len(xs) >= 2:
            slope_hi = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out = np.where(n_arr > xs[-1], ys[-1] + slope_hi * (n_arr - xs[-1]), out)
        return float(out) if out.ndim == 0 else out


def synthetic_tree(n: int, device: torch.device, vocab_size: int, max_depth: int = 8, seed: int = 0) -> DraftTree:
    """A valid draft tree of n nodes shaped like a beam-search tree (wide near the root, depth <= max_depth)."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, math.ceil((n - 1) / max_depth))
    level = torch.cat([torch.zeros(1, dtype=torch.long), (torch.arange(1, n) - 1) // width + 1])
    lo = torch.where(level <= 1, 0, (level - 2) * width + 1)  # a node's parent: a random node one level up
    count = torch.where(level <= 1, 1, width)
    parents = lo + (torch.rand(n, generator=g) * count).long()
    parents[0] = 0
    tokens = torch.randint(vocab_size, (n,), generator=g)
    return DraftTree(tokens, parents, level, ancestor_mask(parents, int(level.max())), -torch.arange(n).float()).to(
        device)


def spread(samples: Sequence[Sequence[float]]) -> list[float | None]:
    """Per size: (slowest - fastest) / median of its samples (None for a single sample)."""
    return [(max(s) - min(s)) / statistics.median(s) if len(s) > 1 else None for s in samples]


def coverage_order(n: int) -> list[int]:
    """0 .. n-1 ordered coarse to fine: the ends, then the middle of the widest gap, and so on, so that the sizes
    timed before a measurement is cut short span the whole range."""
    if n <= 2:
        return list(range(n))
    order, gaps = [0, n - 1], [(0, n - 1)]
    while gaps:
        lo, hi = max(gaps, key=lambda g: (g[1] - g[0], -g[0]))
        gaps.remove((lo, hi))
        if hi - lo > 1:
            mid = (lo + hi) // 2
            order.append(mid)
            gaps += [(lo, mid), (mid, hi)]
    return order


def _sync(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


@torch.no_grad()
def measure_verify_cost(target, sizes: Sequence[int] = DEFAULT_SIZES, past_len: int = DEFAULT_PAST_LEN,
                        repeats: int = DEFAULT_REPEATS, warmup: int = 1, seed: int = 0, probes: int = 3,
                        max_seconds: float | None = None) -> VerifyCost:
    """Median seconds of one verify forward (the target's own forward, `verify_tree`) over N tree tokens after
    `past_len` cached tokens, for N in `sizes`, in `repeats` interleaved rounds (every size once per round, in
    `coverage_order` and back in turn: a slow spell inflates one sample of every size, which the median discards).
    The smallest size is also timed `probes` times before and after the rounds (`check_curve` compares them); the
    warm-up runs the smallest and the largest size `warmup` times. `max_seconds` (None: no limit; warm-up and probes
    included) stops the measurement once that much time has passed: sizes not timed by then (the first round's
    coverage order makes them the finer steps of the range) are left out of the curve, the smallest and the largest
    are always timed. The record keeps the sizes asked for ("asked_sizes"), every sample ("samples"), each size's
    "spread" and how busy the machine was ("machine", `CpuUse`)."""
    device = target.device
    cfg = target.config.get_text_config()
    sizes = sorted({int(n) for n in sizes if n >= 1})
    if not sizes:
        raise ValueError("measure_verify_cost needs at least one tree size >= 1")
    max_pos = getattr(cfg, "max_position_embeddings", None) or 10**9
    past_len = max(1, min(past_len, max_pos - max(sizes) - 1))
    started = time.perf_counter()  # the deadline counts from here: prefill, warm-up and probes included
    g = torch.Generator().manual_seed(seed)
    cache = decode_cache(target.config)  # the cache a DART call decodes into (every layer full)
    target(input_ids=torch.randint(cfg.vocab_size, (1, past_len), generator=g).to(device), use_cache=True,
           logits_to_keep=1, **cache_kwargs(target, cache))
    trees = [synthetic_tree(n, device, cfg.vocab_size, seed=seed + n) for n in sizes]

    def timed(tree: DraftTree) -> float:
        _sync(device)
        start = time.perf_counter()
        verify_tree(target, tree, cache, past_len)
        _sync(device)
        elapsed = time.perf_counter() - start
        cache.crop(past_len - cache.get_seq_length())  # negative: drop the tree entries again
        return elapsed

    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(warmup):  # first-call costs (allocations, kernel choices): the smallest and the largest shape
        for tree in {0: trees[0], len(trees) - 1: trees[-1]}.values():
            timed(tree)
    rounds, order = 0, coverage_order(len(sizes))
    over = lambda: max_seconds is not None and time.perf_counter() - started > max_seconds  # noqa: E731
    with CpuUse() as use:
        probe_start = [timed(trees[0]) for _ in range(probes)]
        for r in range(repeats):
            for k, i in enumerate(order if r % 2 == 0 else order[::-1]):
                if over() and (r or k >= 2):
                    break
                times[i].append(timed(trees[i]))
            else:
                rounds += 1
                continue
            break
        probe_end = [timed(trees[0]) for _ in range(probes)]
    asked = sizes
    if not all(times):  # cut short in the first round: the sizes timed so far
        sizes, trees, times = zip(*[(n, t, ts) for n, t, ts in zip(sizes, trees, times) if ts])
        sizes, times = list(sizes), list(times)
    record = {
        "measured_at": time.time(),
        "measured_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "past_len": past_len,
        "asked_sizes": asked,
        "repeats": rounds,
        "measure_seconds": time.perf_counter() - started,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "machine": use.as_dict(),
        "samples": times,
        "spread": spread(times),
    }
    if probes:
        record["probe"] = {"size": sizes[0], "start": probe_start, "end": probe_end}
    return VerifyCost(sizes=sizes, seconds=[statistics.median(t) for t in times], record=record)
