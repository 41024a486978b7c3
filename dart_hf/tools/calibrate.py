"""`dart-hf calibrate`: measure a target's verify-cost curve on this device, check it, and write it where decoding
reads it (`dart_hf.core.cost`). `generate` never measures: without a curve the cost-aware budget chooses between
plain decoding and one fixed tree size (`dart_hf.core.budget`).

A measurement is a claim about a machine that may have been busy, so it is checked before it is written
(`check_curve`): the smallest size is timed again at the end and must agree with the start, no size may cost much
more than a larger one, and the load average may not exceed the core count by more than one (a uniformly busy
machine passes the other checks with every time several times too high). A measurement that fails is repeated; if
every attempt fails nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache

from ..core.cost import VerifyCost, cost_file, cost_key, load_curve
from ..core.runtime import verify_runtime
from ..core.target import cache_kwargs
from ..core.tree import DraftTree, ancestor_mask
from ..core.verify import verify_tree

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96)
DEFAULT_PAST_LEN = 256
START_END_FACTOR = 1.3  # the smallest size timed at the start and at the end of a measurement must agree this well
MONOTONE_FACTOR = 2.0  # no size may cost more than this times a larger size (CPU kernels differ by up to ~1.5x)
MEASURE_ATTEMPTS = 3


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


def check_curve(sizes: Sequence[int], seconds: Sequence[float], record: dict | None = None) -> list[str]:
    """Why a measured curve should not be trusted (empty: no reason found): a size that costs more than
    MONOTONE_FACTOR times a larger one, a 1-minute load average above the core count + 1, or the smallest size
    timed at the start and at the end disagreeing by more than START_END_FACTOR (the load changed during it)."""
    ys = np.asarray(seconds, dtype=float)
    if len(sizes) != len(ys) or len(ys) == 0 or not np.all(np.isfinite(ys)) or np.any(ys <= 0):
        return ["the curve is empty or has non-positive times"]
    problems = []
    later_min = np.minimum.accumulate(ys[::-1])[::-1]  # min over this size and every larger one
    for i in range(len(ys) - 1):
        if ys[i] > MONOTONE_FACTOR * later_min[i + 1]:
            j = i + 1 + int(np.argmin(ys[i + 1 :]))
            problems.append(f"{sizes[i]} tokens cost {1e3 * ys[i]:.1f} ms, more than {MONOTONE_FACTOR}x the "
                            f"{1e3 * ys[j]:.1f} ms of {sizes[j]} tokens")
    load, cores = (record or {}).get("load_average"), os.cpu_count() or 1
    if load and load[0] > cores + 1:
        problems.append(f"the machine was busy (load average {load[0]:.1f} on {cores} cores)")
    probe = (record or {}).get("probe")
    if probe:
        start, end = statistics.median(probe["start"]), statistics.median(probe["end"])
        if max(start, end) > START_END_FACTOR * min(start, end):
            problems.append(f"{probe['size']} tokens took {1e3 * start:.1f} ms at the start of the measurement and "
                            f"{1e3 * end:.1f} ms at the end: the machine's load changed")
    return problems


def _sync(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


@torch.no_grad()
def measure_verify_cost(target, sizes: Sequence[int] = DEFAULT_SIZES, past_len: int = DEFAULT_PAST_LEN,
                        repeats: int = 5, warmup: int = 1, seed: int = 0, probes: int = 3) -> VerifyCost:
    """Median seconds of one verify forward over N tree tokens after `past_len` cached tokens, for N in `sizes`,
    in interleaved rounds (a slow spell inflates one sample of every size, which the median discards). The smallest
    size is also timed `probes` times before and after the rounds (`check_curve` compares them)."""
    device = target.device
    cfg = target.config.get_text_config()
    sizes = sorted({int(n) for n in sizes if n >= 1})
    if not sizes:
        raise ValueError("measure_verify_cost needs at least one tree size >= 1")
    max_pos = getattr(cfg, "max_position_embeddings", None) or 10**9
    past_len = max(1, min(past_len, max_pos - max(sizes) - 1))
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(cfg.vocab_size, (1, past_len), generator=g).to(device), use_cache=True,
           logits_to_keep=1, **cache_kwargs(target, cache))
    trees = [synthetic_tree(n, device, cfg.vocab_size, seed=seed + n) for n in sizes]
    started = time.perf_counter()

    def timed(tree: DraftTree) -> float:
        _sync(device)
        start = time.perf_counter()
        verify_tree(target, tree, cache, past_len)
        _sync(device)
        elapsed = time.perf_counter() - start
        cache.crop(past_len - cache.get_seq_length())  # negative: drop the tree entries again
        return elapsed

    times: list[list[float]] = [[] for _ in sizes]
    with verify_runtime(target):  # the attention and linears dart_decode verifies with
        for _ in range(warmup):
            for tree in trees:
                timed(tree)
        probe_start = [timed(trees[0]) for _ in range(probes)]
        for _ in range(repeats):
            for i, tree in enumerate(trees):
                times[i].append(timed(tree))
        probe_end = [timed(trees[0]) for _ in range(probes)]
    record = {
        "measured_at": time.time(),
        "measured_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "past_len": past_len,
        "repeats": repeats,
        "measure_seconds": time.perf_counter() - started,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if probes:
        record["probe"] = {"size": sizes[0], "start": probe_start, "end": probe_end}
    return VerifyCost(sizes=sizes, seconds=[statistics.median(t) for t in times], record=record)


@torch.no_grad()
def measure_batch_verify_cost(target, rows: Sequence[int] = (1, 2, 4, 8), nodes: Sequence[int] = (1, 2, 4, 8, 16),
                              past_len: int = DEFAULT_PAST_LEN, repeats: int = 5, warmup: int = 1, seed: int = 0,
                              extra: Sequence[tuple[int, int]] = ()) -> dict:
    """Median seconds of one batched verify forward (`verify_batch`, the forward `batch_loop` runs) over R rows of
    N tree tokens each (root included), after `past_len` cached tokens per row, for every (R, N): interleaved rounds,
    as `measure_verify_cost`. Returns {"rows", "nodes", "seconds": [len(rows)][len(nodes)], "past_len", ...};
    `extra`: more (R, N) pairs timed in the same rounds, in "extra_seconds" {"R,N": seconds}."""
    from ..core.ragged import RaggedCache
    from ..core.tree_batch import TreeBatch
    from ..core.verify import verify_batch

    device = target.device
    cfg = target.config.get_text_config()
    rows, nodes = sorted({int(r) for r in rows if r >= 1}), sorted({int(n) for n in nodes if n >= 1})
    if not rows or not nodes:
        raise ValueError("measure_batch_verify_cost needs at least one row count and one tree size >= 1")
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(cfg.vocab_size, (max([*rows, *(r for r, _ in extra)]), past_len), generator=g).to(device)
    pairs = [(r, n) for r in rows for n in nodes] + [(int(r), int(n)) for r, n in extra]
    setups, caches = {}, {}
    for r, n in pairs:
        if r not in caches:
            cache = DynamicCache(config=target.config)
            target(input_ids=prompt[:r], use_cache=True, logits_to_keep=1, **cache_kwargs(target, cache))
            caches[r] = RaggedCache(cache, torch.ones(r, past_len, dtype=torch.bool, device=device))
        trees = [synthetic_tree(n, device, cfg.vocab_size, seed=seed + 97 * i + n) for i in range(r)]
        setups[(r, n)] = (caches[r], TreeBatch.stack(trees))
    started = time.perf_counter()

    def timed(ragged, trees) -> float:
        _sync(device)
        start = time.perf_counter()
        verify_batch(target, trees, ragged)
        _sync(device)
        elapsed = time.perf_counter() - start
        ragged.cache.crop(past_len - ragged.cache.get_seq_length())  # negative: drop the tree entries again
        return elapsed

    times = {key: [] for key in setups}
    with verify_runtime(target):
        for _ in range(warmup):
            for key, setup in setups.items():
                timed(*setup)
        for _ in range(repeats):
            for key, setup in setups.items():
                times[key].append(timed(*setup))
    return {
        "rows": rows,
        "nodes": nodes,
        "seconds": [[statistics.median(times[(r, n)]) for n in nodes] for r in rows],
        "extra_seconds": {f"{r},{n}": statistics.median(times[(int(r), int(n))]) for r, n in extra},
        "past_len": past_len,
        "repeats": repeats,
        "measure_seconds": time.perf_counter() - started,
        "measured_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def batch_check(target, curve: VerifyCost | None, rows: Sequence[int] = (1, 2, 4, 8),
                nodes: Sequence[int] = (1, 2, 4, 8, 16), repeats: int = 5, past_len: int | None = None) -> dict:
    """The batch rule's verify model against measurement: every (R rows, N tokens per row) batched verify, and one
    row of R * N tokens, timed in the same interleaved rounds (`measure_batch_verify_cost`), next to the stored
    curve's price curve(R * N). Returns the measurement with "table" (`batch_table`)."""
    nodes = sorted({int(n) for n in nodes})
    extra = sorted({(1, r * n) for r in rows for n in nodes if r > 1 and r * n not in nodes})
    measured = measure_batch_verify_cost(target, rows=rows, nodes=nodes, repeats=repeats, extra=extra,
                                         past_len=past_len or (curve.record.get("past_len") if curve else None)
                                         or DEFAULT_PAST_LEN)
    measured["table"] = batch_table(measured, curve)
    return measured


def batch_table(measured: dict, curve: VerifyCost | None) -> list[dict]:
    """Per (R, N): the batched verify's seconds, one row of R * N tokens' seconds (same rounds, where measured),
    the curve's price of R * N tokens, and the batched time over each."""
    one = {n: s for n, s in zip(measured["nodes"], measured["seconds"][0])} if measured["rows"][0] == 1 else {}
    one.update({int(k.split(",")[1]): v for k, v in measured.get("extra_seconds", {}).items()
                if k.split(",")[0] == "1"})
    table = []
    for r, row in zip(measured["rows"], measured["seconds"]):
        for n, sec in zip(measured["nodes"], row):
            single = one.get(r * n)
            price = float(curve(r * n)) if curve is not None else None
            table.append({"rows": r, "nodes": n, "tokens": r * n, "seconds": sec, "one_row_seconds": single,
                          "curve_seconds": price,
                          "vs_one_row": sec / single if single else None,
                          "vs_curve": sec / price if price else None})
    return table


def write_curve(cost: VerifyCost) -> None:
    path = Path(cost.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cost.to_dict(), indent=1, default=str))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def calibrate(target, sizes: Sequence[int] | None = None, past_len: int | None = None, repeats: int = 5,
              force: bool = False, attempts: int = MEASURE_ATTEMPTS, verbose: bool = True
              ) -> tuple[VerifyCost | None, list[str]]:
    """(the curve, []) from the cache, or measured now (up to `attempts` times until `check_curve` passes) and
    written; (None, problems of the last attempt) when every attempt failed: then nothing is written."""
    key = cost_key(target)
    old = load_curve(target)
    if old is not None and not force:
        return old, []
    sizes = sizes or (old.sizes if old is not None else DEFAULT_SIZES)
    past_len = past_len or (old.record.get("past_len") if old is not None else None) or DEFAULT_PAST_LEN
    problems: list[str] = []
    for attempt in range(max(1, attempts)):
        if verbose:
            print(f"dart_hf: measuring the verify cost of {key['name']} on {key['device_name']} ({key['dtype']}, "
                  f"{key['attn_implementation']}), attempt {attempt + 1}", file=sys.stderr)
        measured = measure_verify_cost(target, sizes=sizes, past_len=past_len, repeats=repeats)
        problems = check_curve(measured.sizes, measured.seconds, measured.record)
        if not problems:
            cost = VerifyCost(measured.sizes, measured.seconds, key=key, path=str(cost_file(key)),
                              record={**measured.record, "attempts": attempt + 1})
            write_curve(cost)
            return cost, []
        if verbose:
            print(f"dart_hf: measurement rejected ({'; '.join(problems)})", file=sys.stderr)
    return None, problems


def run(args: argparse.Namespace) -> int:
    """Load the target, load or measure its curve, print it. Exit status 0, or 1 when every measurement failed
    its checks (nothing written: calibrate again on a quieter machine)."""
    from .assets import load_target

    if args.repeats < 1:
        raise SystemExit("dart-hf calibrate: --repeats must be >= 1")
    if args.past_len is not None and args.past_len < 1:
        raise SystemExit("dart-hf calibrate: --past-len must be >= 1")
    target, _ = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device,
                            attn_implementation=args.attn)
    started = time.time()
    cost, problems = calibrate(target, sizes=args.sizes, past_len=args.past_len, repeats=args.repeats,
                               force=args.force or args.sizes is not None or args.past_len is not None)
    if cost is None:
        print("dart-hf calibrate: every measurement failed its checks (" + "; ".join(problems) + "); nothing was "
              "written. Calibrate again on a quieter machine.", file=sys.stderr)
        return 1
    if args.json:
        out = cost.to_dict()
        if getattr(args, "batch", False):
            out["batch_check"] = batch_check(target, cost, repeats=args.repeats)
        print(json.dumps(out, indent=1, default=str))
        return 0
    key = cost.key or {}
    print(f"verify cost of {key.get('name')} on {key.get('device_name')} ({key.get('dtype')}, "
          f"{key.get('attn_implementation')}), after {cost.record.get('past_len')} cached tokens")
    one = cost.seconds[0]
    print(f"{'tokens':>7} {'ms':>9} {'x ' + str(cost.sizes[0]) + ' token(s)':>14}")
    for n, s in zip(cost.sizes, cost.seconds):
        print(f"{n:>7} {1e3 * s:>9.2f} {s / one:>14.2f}")
    measured_now = cost.record.get("measured_at", 0) >= started
    state = "measured now" if measured_now else f"cached, measured {cost.record.get('measured_at_utc', '?')}"
    print(f"{state}; stored in {cost.path}")
    if getattr(args, "batch", False):
        print_batch_check(batch_check(target, cost, repeats=args.repeats))
    return 0


def print_batch_check(measured: dict) -> None:
    print(f"\nbatched verify (R rows x N tokens each) against one row of R*N tokens timed in the same rounds and "
          f"the stored curve's curve(R*N); load average {measured.get('load_average')}")
    print(f"{'R':>3} {'N':>4} {'R*N':>5} {'batch ms':>9} {'1 row ms':>9} {'curve ms':>9} {'/1 row':>7} {'/curve':>7}")
    ms = lambda x: "n/a" if x is None else f"{1e3 * x:.1f}"
    ratio = lambda x: "n/a" if x is None else f"{x:.2f}"
    for t in measured["table"]:
        print(f"{t['rows']:>3} {t['nodes']:>4} {t['tokens']:>5} {ms(t['seconds']):>9} {ms(t['one_row_seconds']):>9} "
              f"{ms(t['curve_seconds']):>9} {ratio(t['vs_one_row']):>7} {ratio(t['vs_curve']):>7}")
