"""`dart-hf calibrate`: measure a target's verify-cost curve on this device, check it, and write it where decoding
reads it (`dart_hf.core.cost`). `generate` never measures: without a curve the cost-aware budget chooses between
plain decoding and one fixed tree size (`dart_hf.core.budget`). On a CPU a curve belongs to one torch thread count
(part of its key: a verify on 1 thread and on 2 cost different amounts), so a process decoding on another count
finds none; `--threads N` measures for N threads.

What is timed is the target's own forward over N tree tokens (`dart_hf.core.eager_step.verify_tree`), every size
once per round, in a few interleaved rounds (ascending, then descending sizes): a slow spell inflates one sample of
every size, which each size's median discards. The default (3 rounds of 14 sizes) takes seconds for SmolLM2-135M on an idle
2-core CPU and 40-45 s beside a busy process; the measurement stops at `max_seconds` (`dart-hf calibrate`: 45 s),
after timing at least the smallest and the largest size.

A measurement is a claim about a machine that may have been busy, so it is checked (`check_curve`): the smallest size
is timed again at the end and must agree with the start, no size may cost much more than a larger one, and other
processes may not have used a large share of the cores (`CpuUse`; the load average where that cannot be read). A
measurement that fails is repeated once if time allows, its rounds pooled with the first's. A curve that still fails
is stored anyway, marked `"noisy"` with its problems and each size's spread, and used: the budget prices untimed tree
sizes through the curve's *shape* and corrects it with its own step timings as decoding runs. Only a curve that
passed its checks is never replaced by a noisy one: then the command says so and how to store the new one
(`--accept-noisy`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.cost import VerifyCost, cost_file, cost_key, load_curve
from ..core.eager_step import RaggedCache, decode_cache, verify_batch, verify_tree
from ..core.target import cache_kwargs
from ..core.tree import DraftTree, DraftTrees, ancestor_mask

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96)
DEFAULT_PAST_LEN = 256
DEFAULT_REPEATS = 3  # interleaved rounds per measurement: the median of 3 discards one slow spell per size
DEFAULT_MAX_SECONDS = 45.0  # `dart-hf calibrate`: the measurement stops here (a round under way is cut short)
START_END_FACTOR = 1.3  # the smallest size timed at the start and at the end of a measurement must agree this well
MONOTONE_FACTOR = 2.0  # no size may cost more than this times a larger size (CPU kernels differ by up to ~1.5x)
BUSY_CORES = 0.5  # other processes using this many cores' worth of CPU (on average) make a CPU timing untrustworthy
MEASURE_ATTEMPTS = 3


# ---------------------------------------------------------------------------------------------------- machine load
def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, busy CPU seconds of the cores this process may run on per /proc/stat, this process's CPU
    seconds); None where /proc/stat cannot be read (not Linux)."""
    try:
        cores = os.sched_getaffinity(0)
        lines = Path("/proc/stat").read_text().splitlines()
    except (AttributeError, OSError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
    return time.perf_counter(), busy / hz, time.process_time()


class CpuUse:
    """How busy the machine was around a timing, beside the timing itself: `with CpuUse() as use: ...`, then
    `use.other_cores` (cores' worth of CPU that OTHER processes used on this process's cores during the block; None
    where /proc/stat is missing), `use.load_average` (1-minute load average when the block began) and `use.cores`.
    `busy()` says why the block's timings do not describe this machine at rest (None: no reason found)."""

    def __init__(self) -> None:
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self.other_cores: float | None = None
        self._start = None

    def __enter__(self) -> "CpuUse":
        self._start = _cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        end = _cpu_seconds()
        if self._start is not None and end is not None and end[0] > self._start[0]:
            wall, busy, own = (b - a for a, b in zip(self._start, end))
            self.other_cores = max(0.0, (busy - own) / wall)

    def busy(self) -> str | None:
        if self.other_cores is not None:
            if self.other_cores >= BUSY_CORES:
                return (f"other processes used {self.other_cores:.1f} of the {self.cores} cores while it ran "
                        f"(load average {self.load_average:.1f})" if self.load_average is not None else
                        f"other processes used {self.other_cores:.1f} of the {self.cores} cores while it ran")
            return None
        if self.load_average is not None and self.load_average > self.cores:
            return f"the load average was {self.load_average:.1f} on {self.cores} cores"
        return None

    def as_dict(self) -> dict:
        return {"other_cores": self.other_cores, "load_average_1min": self.load_average, "cores": self.cores}


PROBE_SECONDS = 0.5  # `other_cpu_use`: long enough to see a busy process, short beside any timing


def other_cpu_use(seconds: float = PROBE_SECONDS) -> CpuUse:
    """How busy other processes keep the CPU right now: `CpuUse` around `seconds` of this process sleeping."""
    with CpuUse() as use:
        time.sleep(seconds)
    return use


@dataclass(frozen=True)
class ThreadChoice:
    """The torch thread count a timing command runs on (`choose_threads`), and why, in words for its user."""

    threads: int
    default: int  # torch's count in this process before the choice
    busy: str | None  # why the machine counted as busy before timing (`CpuUse.busy`); None: it looked idle
    reason: str


def choose_threads(requested: int | None = None, probe: Callable[[], CpuUse] | None = None) -> ThreadChoice:
    """The torch thread count for a command that owns its process and times decoding (`dart-hf demo`; `dart-hf
    bench` may call it too): `requested` where given, else torch's own count, or, when other processes are using the
    CPU (`probe`, default `other_cpu_use`, before any timing), one thread per core they leave free, at least one.

    Why: torch's threads meet at every operation, so one of them descheduled by another process stalls the rest. On
    a 2-core machine beside one busy process SmolLM2 decoded at about 1 token/s on torch's 2 threads, at 17 on one.
    Only the command's own process may take this choice (`torch.set_num_threads`): a library call never changes a
    process-wide setting. The verify-cost curve is stored per thread count (`dart_hf.core.cost`): a count other
    than the one `dart-hf calibrate` ran at decodes without a curve until it is calibrated at that count too."""
    default = torch.get_num_threads()
    if requested is not None:
        return ThreadChoice(requested, default, None, f"{_threads(requested)} (--threads)")
    use = (probe or other_cpu_use)()
    busy = use.busy()
    if busy is not None and use.other_cores is not None:  # CpuUse.busy's words are for a timing's aftermath
        busy = f"other processes were using {use.other_cores:.1f} of the {use.cores} cores"
    if busy is None:
        return ThreadChoice(default, default, None, f"{_threads(default)} (torch's default; the CPU looked idle)")
    taken = max(1, round(use.other_cores)) if use.other_cores is not None else 1
    threads = max(1, min(default, use.cores - taken))
    if threads == default:
        return ThreadChoice(default, default, busy, f"{_threads(default)} (torch's default); before timing, {busy}")
    return ThreadChoice(threads, default, busy,
                        f"{_threads(threads)} instead of torch's {default}: before timing, {busy}, and torch's "
                        f"threads wait for each other at every step, so a core taken by another process stalls them "
                        f"all (--threads {default} keeps torch's default)")


def _threads(n: int) -> str:
    return f"{n} torch thread{'s' if n != 1 else ''}"


# ---------------------------------------------------------------------------------------------------- measurement
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
    MONOTONE_FACTOR times a larger one, a busy machine (other processes' CPU use during the measurement, `CpuUse`;
    without it a 1-minute load average above the core count + 1), or the smallest size timed at the start and at the
    end disagreeing by more than START_END_FACTOR (the load changed during it)."""
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
    record = record or {}
    machine, load, cores = record.get("machine") or {}, record.get("load_average"), os.cpu_count() or 1
    if machine.get("other_cores") is not None:
        if machine["other_cores"] >= BUSY_CORES:
            problems.append(f"the machine was busy (other processes used {machine['other_cores']:.1f} of "
                            f"{machine.get('cores', cores)} cores during the measurement)")
    elif load and load[0] > cores + 1:
        problems.append(f"the machine was busy (load average {load[0]:.1f} on {cores} cores)")
    probe = record.get("probe")
    if probe:
        start, end = statistics.median(probe["start"]), statistics.median(probe["end"])
        if max(start, end) > START_END_FACTOR * min(start, end):
            problems.append(f"{probe['size']} tokens took {1e3 * start:.1f} ms at the start of the measurement and "
                            f"{1e3 * end:.1f} ms at the end: the machine's load changed")
    return problems


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


def monotone(seconds: Sequence[float]) -> list[float]:
    """Each size's time capped by every larger size's (a suffix minimum): a tree never costs more than a larger one,
    which a noisy measurement's medians can contradict."""
    return np.minimum.accumulate(np.asarray(seconds, dtype=float)[::-1])[::-1].tolist()


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


def pooled(first: VerifyCost, second: VerifyCost) -> VerifyCost:
    """One curve from two measurements: each size's median over both sets of samples (every size either timed; the
    second's record otherwise: its probe, its machine load). The second alone when either lacks samples."""
    a, b = first.record.get("samples"), second.record.get("samples")
    if not a or not b:
        return second
    by_size: dict[int, list[float]] = {}
    for cost, samples in ((first, a), (second, b)):
        for n, ts in zip(cost.sizes, samples):
            by_size.setdefault(int(n), []).extend(ts)
    sizes = sorted(by_size)
    samples = [by_size[n] for n in sizes]
    record = {**second.record, "samples": samples, "spread": spread(samples),
              "repeats": first.record.get("repeats", 0) + second.record.get("repeats", 0),
              "measure_seconds": first.record.get("measure_seconds", 0) + second.record.get("measure_seconds", 0)}
    return VerifyCost(sizes, [statistics.median(s) for s in samples], record=record)


@torch.no_grad()
def measure_batch_verify_cost(target, rows: Sequence[int] = (1, 2, 4, 8), nodes: Sequence[int] = (1, 2, 4, 8, 16),
                              past_len: int = DEFAULT_PAST_LEN, repeats: int = 5, warmup: int = 1, seed: int = 0,
                              extra: Sequence[tuple[int, int]] = ()) -> dict:
    """Median seconds of one batched verify forward (`verify_batch`, the forward `batch_loop` runs) over R rows of
    N tree tokens each (root included), after `past_len` cached tokens per row, for every (R, N): interleaved rounds,
    as `measure_verify_cost`. Returns {"rows", "nodes", "seconds": [len(rows)][len(nodes)], "past_len", ...};
    `extra`: more (R, N) pairs timed in the same rounds, in "extra_seconds" {"R,N": seconds}."""

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
            cache = decode_cache(target.config)  # the cache a DART call decodes into (every layer full)
            target(input_ids=prompt[:r], use_cache=True, logits_to_keep=1, **cache_kwargs(target, cache))
            caches[r] = RaggedCache(cache, torch.ones(r, past_len, dtype=torch.bool, device=device), target.config)
        trees = [synthetic_tree(n, device, cfg.vocab_size, seed=seed + 97 * i + n) for i in range(r)]
        setups[(r, n)] = (caches[r], DraftTrees.stack(trees))
    started = time.perf_counter()

    def timed(ragged, trees) -> float:
        _sync(device)
        start = time.perf_counter()
        verify_batch(target, trees, ragged, [0])
        _sync(device)
        elapsed = time.perf_counter() - start
        ragged.cache.crop(past_len - ragged.cache.get_seq_length())  # negative: drop the tree entries again
        return elapsed

    times = {key: [] for key in setups}
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


def calibrate(target, sizes: Sequence[int] | None = None, past_len: int | None = None,
              repeats: int = DEFAULT_REPEATS, force: bool = False, attempts: int = MEASURE_ATTEMPTS,
              verbose: bool = True, keep_noisy: bool = False, accept_noisy: bool = False,
              max_seconds: float | None = None) -> tuple[VerifyCost | None, list[str]]:
    """The target's verify-cost curve and the problems of its measurement:

    - (the stored curve, []) when one exists and `force` is false (nothing is measured);
    - (the curve, []) measured now, passing `check_curve`, and written. A failing measurement is repeated, up to
      `attempts` measurements, the next one only while less than half of `max_seconds` (None: no limit) is spent;
      each repeat pools its rounds with the earlier ones (`pooled`), so no measurement is thrown away;
    - (the curve, problems) when every measurement failed and `keep_noisy` or `accept_noisy`: written anyway, its
      record marked "noisy" with the problems and each size's "spread" - except over a stored curve that passed its
      checks, which only `accept_noisy` replaces;
    - (None, problems) otherwise: nothing written (a stored curve stays)."""
    key = cost_key(target)
    old = load_curve(target)
    if old is not None and not force:
        return old, []
    sizes = sizes or (old.record.get("asked_sizes") or old.sizes if old is not None else DEFAULT_SIZES)
    past_len = past_len or (old.record.get("past_len") if old is not None else None) or DEFAULT_PAST_LEN
    problems: list[str] = []
    measured: VerifyCost | None = None
    started = time.perf_counter()
    attempt = 0
    for attempt in range(1, max(1, attempts) + 1):
        left = None if max_seconds is None else max_seconds - (time.perf_counter() - started)
        if attempt > 1 and left is not None and left < max_seconds / 2:
            attempt -= 1
            break
        if verbose:
            print(f"dart_hf: measuring the verify cost of {key['name']} on {key['device_name']} ({key['dtype']}, "
                  f"{key['attn_implementation']}), {len(sizes)} tree sizes x {repeats} rounds"
                  + (f", measurement {attempt}" if attempt > 1 else ""), file=sys.stderr)
        new = measure_verify_cost(target, sizes=sizes, past_len=past_len, repeats=repeats,
                                  **({} if left is None else {"max_seconds": left}))
        measured = new if measured is None else pooled(measured, new)
        problems = check_curve(measured.sizes, measured.seconds, measured.record)
        if not problems:
            cost = VerifyCost(measured.sizes, measured.seconds, key=key, path=str(cost_file(key)),
                              record={**measured.record, "attempts": attempt, "noisy": False})
            write_curve(cost)
            return cost, []
        if verbose:
            print(f"dart_hf: the measurement looks noisy ({'; '.join(problems)})", file=sys.stderr)
    clean_old = old is not None and not old.record.get("noisy")
    if measured is not None and (accept_noisy or (keep_noisy and not clean_old)):
        cost = VerifyCost(measured.sizes, monotone(measured.seconds), key=key, path=str(cost_file(key)),
                          record={**measured.record, "attempts": attempt, "noisy": True, "problems": problems,
                                  "medians": list(measured.seconds)})
        write_curve(cost)
        return cost, problems
    return None, problems


def run(args: argparse.Namespace) -> int:
    """Load the target, load or measure its curve, print it. Exit status 0 when a curve is stored (a noisy one
    included: it says so), 1 when a new measurement failed its checks and a stored curve that passed them was kept
    (it says how to store the new one anyway)."""
    from .assets import announce_installs

    if args.repeats < 1:
        raise SystemExit("dart-hf calibrate: --repeats must be >= 1")
    if args.past_len is not None and args.past_len < 1:
        raise SystemExit("dart-hf calibrate: --past-len must be >= 1")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise SystemExit("dart-hf calibrate: --threads must be >= 1")
    announce_installs("dart-hf calibrate", args.target)
    default_threads = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)  # the command owns its process; the curve's key names the count
        return _calibrate_and_report(args)
    finally:
        torch.set_num_threads(default_threads)  # `dart_hf_cli.main` may run inside another program's process


def _calibrate_and_report(args: argparse.Namespace) -> int:
    """`run` on the thread count it set: load the target, load or measure its curve, print it."""
    from .assets import load_target

    target, _ = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device,
                            attn_implementation=args.attn)
    started = time.time()
    accept_noisy = getattr(args, "accept_noisy", False)
    cost, problems = calibrate(target, sizes=args.sizes, past_len=args.past_len, repeats=args.repeats,
                               force=args.force or accept_noisy or args.sizes is not None or args.past_len is not None,
                               attempts=2, keep_noisy=True, accept_noisy=accept_noisy,
                               max_seconds=getattr(args, "max_seconds", DEFAULT_MAX_SECONDS))
    if cost is None:
        kept = load_curve(target)
        when = kept.record.get("measured_at_utc", "?") if kept is not None else "?"
        print(f"dart-hf calibrate: the new measurement looks noisy ({'; '.join(problems)}), so the stored curve "
              f"(measured {when}, which passed these checks) was kept. To store the new one anyway: dart-hf calibrate "
              f"{args.target} --accept-noisy; to measure again: dart-hf calibrate {args.target} --force (best with "
              f"nothing else running).", file=sys.stderr)
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
    spreads = cost.record.get("spread") or [None] * len(cost.sizes)
    print(f"{'tokens':>7} {'ms':>9} {'x ' + str(cost.sizes[0]) + ' token(s)':>14} {'spread':>7}")
    for n, s, w in zip(cost.sizes, cost.seconds, spreads):
        print(f"{n:>7} {1e3 * s:>9.2f} {s / one:>14.2f} {'' if w is None else f'{100 * w:.0f}%':>7}")
    measured_now = cost.record.get("measured_at", 0) >= started
    state = "measured now" if measured_now else f"cached, measured {cost.record.get('measured_at_utc', '?')}"
    if measured_now and cost.record.get("measure_seconds") is not None:
        state += f" in {cost.record['measure_seconds']:.0f} s"
    print(f"{state}; stored in {cost.path}")
    if key.get("device") == "cpu":
        print(thread_note(torch.get_num_threads(), args.target))
    missing = sorted(set(cost.record.get("asked_sizes") or cost.sizes) - set(cost.sizes))
    if missing:
        print(f"dart-hf calibrate: sizes {missing} were not timed within --max-seconds; the budget chooses among the "
              f"others. `dart-hf calibrate {args.target} --force` on a quieter machine times them all.",
              file=sys.stderr)
    if cost.record.get("noisy"):
        print(f"dart-hf calibrate: this curve is noisy ({'; '.join(cost.record.get('problems') or problems)}). It "
              f"is stored with each size's spread and used: the budget corrects its prices with its own step "
              f"timings as decoding runs. For a cleaner one, run `dart-hf calibrate {args.target} --force` with "
              f"nothing else running.", file=sys.stderr)
    if getattr(args, "batch", False):
        print_batch_check(batch_check(target, cost, repeats=args.repeats))
    return 0


def thread_note(threads: int, target: str = "<target>") -> str:
    """Which processes a CPU curve serves: those decoding on `threads` torch threads (the count is part of the curve's
    key, `dart_hf.core.cost`), and how to calibrate for another count."""
    return (f"this curve applies to processes that decode on {threads} torch thread(s) (torch.get_num_threads()); "
            f"for another count N: `dart-hf calibrate {target} --threads N` (or OMP_NUM_THREADS=N dart-hf calibrate)")


def print_batch_check(measured: dict) -> None:
    print(f"\nbatched verify (R rows x N tokens each) against one row of R*N tokens timed in the same rounds and "
          f"the stored curve's curve(R*N); load average {measured.get('load_average')}")
    print(f"{'R':>3} {'N':>4} {'R*N':>5} {'batch ms':>9} {'1 row ms':>9} {'curve ms':>9} {'/1 row':>7} {'/curve':>7}")
    ms = lambda x: "n/a" if x is None else f"{1e3 * x:.1f}"
    ratio = lambda x: "n/a" if x is None else f"{x:.2f}"
    for t in measured["table"]:
        print(f"{t['rows']:>3} {t['nodes']:>4} {t['tokens']:>5} {ms(t['seconds']):>9} {ms(t['one_row_seconds']):>9} "
              f"{ms(t['curve_seconds']):>9} {ratio(t['vs_one_row']):>7} {ratio(t['vs_curve']):>7}")
