"""The timed part of `dart-hf bench`: every method called with device syncs around it, the target's forwards counted
(`ForwardCounter`) and the DART steps' phase times and node budgets tallied; one prompt at a time in interleaved passes
(`run_rows`) or in left-padded batches (`run_batched`), beside an optional competing load (`CompetingLoad`); then per
data set and method the tokens/s, speed-ups over plain (median and spread over runs), accepted length and step
breakdown (`_summarise`), with how busy other processes kept the machine while each method was timed
(`machine.CpuUse` around every timed call: "other_cores", "busy") and whether a DART method decoded plainly in every
call ("plain_decoding", "plain_calls"), so that the reports can say so beside the figure. Apart from the command
(`bench`) and the reports (`bench_report`): what each number means is decided here, in one place, and the reports
only format the results dict this returns.
When `gen` samples (`do_sample`: `bench_methods.sampling_kwargs`), every call is seeded right before it
(`bench_methods.seed_call`: the same seed for every method on a prompt or batch) and outputs are not compared with
plain's (sampled texts differ by method): `equal_to_plain` and `all_equal` are None, "not compared".
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .bench_methods import Method, call_seed, seed_call
from .machine import BUSY_CORES, CpuUse

PHASES = ("draft", "tree", "verify", "accept")
STEP = "step"  # the static greedy step, captured whole: its time is one phase (`DartStats.time["step"]`)
ALL_PHASES = (*PHASES, STEP)
PHASE_LABELS = {"draft": "head forward", "tree": "tree search", "verify": "target verify", "accept": "accept + cache",
                STEP: "captured step"}


class ForwardCounter:
    """Counts forwards of the target (a forward hook on the top-level model)."""

    def __init__(self, target):
        self.target = target
        self.count = 0
        self._handle = target.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.count += 1

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No hook while a compiled method runs: dynamo would trace it into the captured step (and recompile for
        every value of the count)."""
        self._handle.remove()
        try:
            yield
        finally:
            self._handle = self.target.register_forward_hook(self._hook)

    def remove(self) -> None:
        self._handle.remove()


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_difference(out: torch.Tensor, ref: torch.Tensor) -> int:
    n = min(out.shape[1], ref.shape[1])
    diff = (out[0, :n] != ref[0, :n]).nonzero()
    return int(diff[0, 0]) if diff.numel() else n


@dataclass
class _Tally:
    seconds: float = 0.0
    new_tokens: int = 0
    forwards: int = 0
    steps: int = 0
    phases: dict = field(default_factory=lambda: dict.fromkeys(ALL_PHASES, 0.0))
    budgets: list = field(default_factory=list)
    per_prompt: list = field(default_factory=list)
    mismatches: int = 0
    not_compiled: list = field(default_factory=list)  # why calls of a compiled DART method ran uncompiled
    calls: int = 0
    plain_calls: int = 0  # DART tree calls that drafted nothing (node budget 0 in every step): plain decoding
    other_core_seconds: float = 0.0  # other processes' CPU during the timed calls (`CpuUse`), over `read_seconds`
    read_seconds: float = 0.0  # the timed seconds whose other processes' CPU use was read (/proc/stat)
    cores: int = 0
    load_busy: list = field(default_factory=list)  # unread calls' busy load average (`CpuUse.busy`), in words


# ---------------------------------------------------------------------------------------------------- the bench
class CompetingLoad:
    """`processes` busy-loop Python processes (default: one per core) for at most `seconds`, ended on exit: a
    fixed, reproducible share of the CPU taken away from the methods being timed."""

    def __init__(self, processes: int | None = None, seconds: float = 3600.0):
        self.processes = (os.cpu_count() or 1) if processes is None else processes
        self.seconds = seconds
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "CompetingLoad":
        loop = f"import time\nend = time.time() + {float(self.seconds)}\nwhile time.time() < end:\n    pass\n"
        self.procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(self.processes)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []


def run_rows(target, head, prompts, methods, gen, warmup, progress, meta, runs, load) -> dict:
    """The single-row bench: every method on every prompt, `runs` interleaved passes."""
    max_new_tokens = gen["max_new_tokens"]
    with CompetingLoad(load) if load else _no_load():
        calls = [(ids, torch.ones_like(ids)) for ps in prompts.values() for ids in ps]
        compile_seconds = _compile_warmup(target, head, calls, [m for m in methods if m.compiled], gen, progress)
        if warmup:
            first = next(p for ps in prompts.values() for p in ps).to(target.device)
            for m in methods:
                if not m.compiled:
                    seed_call(gen, "warm-up")
                    m.run(target, head, first, **{**gen, "max_new_tokens": min(16, max_new_tokens)})
        tallies, mismatches = [], []
        for run in range(runs):
            tally, bad = _one_pass(target, head, prompts, methods, gen, progress, f" (run {run + 1}/{runs})"
                                   if runs > 1 else "")
            tallies.append(tally)
            mismatches += [{**m, "run": run} for m in bad] if runs > 1 else bad
    return {
        "meta": {**environment(target), **(meta or {}), "max_new_tokens": max_new_tokens,
                 "prompts": {ds: len(ps) for ds, ps in prompts.items()}, "runs": runs, "competing_load": load,
},
        "methods": {m.name: m.label for m in methods},
        "datasets": {ds: _summarise([t[ds] for t in tallies], methods, _compares(gen)) for ds in prompts},
        "compile_warmup": compile_seconds,
        "mismatches": mismatches,
        "all_equal": not mismatches if _compares(gen) else None,
    }


def _compares(gen: dict) -> bool:
    """Whether outputs are compared with plain's: greedy only (a sampled output depends on how a method consumes
    the random stream: prompt lookup, chain and tree draw differently from plain `generate`, so equal distributions
    still give different texts from the same seed)."""
    return not gen.get("do_sample")


def _compile_warmup(target, head, calls: list[tuple[torch.Tensor, torch.Tensor]], methods: list[Method], gen: dict,
                    progress: bool) -> dict:
    """Each compiled method once on every call the timed passes make (`calls`: (ids, attention mask), a prompt or a
    left-padded batch), untimed, at the bench's full length, longest first (transformers sizes a static cache for the
    longest call so far, so the shorter ones then reuse its graph; DART's buffers are sized by a bucket of 256
    slots): every graph the timed calls run is compiled here (a cost-aware compiled call takes its shape's size at
    that shape's first call and keeps it, with its ladder neighbours, all compiled in that call:
    `core.budget.ladder_around`). Returns {method: {"seconds": all
    its warm-up calls, "first_call_seconds", "calls"}} (these seconds are not in the timed tokens/s)."""
    order = sorted(calls, key=lambda call: -call[0].shape[-1])

    def warm(run, ids, mask) -> float:
        ids, mask = ids.to(target.device), mask.to(target.device)
        seed_call(gen, "warm-up")
        sync_device(ids.device)
        start = time.perf_counter()
        run(target, head, ids, attention_mask=mask, **gen)
        sync_device(ids.device)
        return time.perf_counter() - start

    out = {}
    for m in methods:
        times = [warm(m.run, ids, mask) for ids, mask in tqdm(order, desc=f"compile {m.name}", unit="call",
                                                              disable=not progress)]
        out[m.name] = {"seconds": sum(times), "first_call_seconds": times[0], "calls": len(times)}
    return out


class _no_load:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None


def _one_pass(target, head, prompts, methods, gen, progress, label) -> tuple[dict, list]:
    """One interleaved pass over every prompt: (tallies per data set and method, mismatches)."""
    device = target.device
    counter = ForwardCounter(target)
    tallies = {ds: {m.name: _Tally() for m in methods} for ds in prompts}
    mismatches = []
    try:
        for ds, ds_prompts in prompts.items():
            for i, ids in enumerate(tqdm(ds_prompts, desc=f"bench {ds}{label}", unit="prompt",
                                         disable=not progress)):
                ids = ids.to(device)
                ref = None
                for m in methods:
                    tally = tallies[ds][m.name]
                    seed_call(gen, ds, i)  # outside the timed call: every method starts this prompt from one seed
                    out, seconds = _timed_run(m, target, head, ids, torch.ones_like(ids), gen, counter, tally)
                    new = out.shape[1] - ids.shape[1]
                    tally.new_tokens += new
                    row = {"prompt": i, "prompt_tokens": ids.shape[1], "new_tokens": new, "seconds": seconds,
                           "forwards": counter.count}
                    if not _compares(gen):
                        row["seed"] = call_seed(ds, i)
                    if ref is None:
                        ref = out
                    elif _compares(gen) and not torch.equal(out, ref):
                        where = _first_difference(out, ref) - ids.shape[1]  # index among the new tokens
                        tally.mismatches += 1
                        row["mismatch_at"] = where
                        mismatches.append({"dataset": ds, "prompt": i, "method": m.name, "first_difference": where,
                                           "new_tokens": new, "reference_new_tokens": ref.shape[1] - ids.shape[1]})
                    tally.per_prompt.append(row)
    finally:
        counter.remove()
    return tallies, mismatches


def _timed_run(m: Method, target, head, ids, mask, gen: dict, counter, tally) -> tuple[torch.Tensor, float]:
    """(output, wall seconds) of one method call with device syncs around it; adds its time, target forwards, other
    processes' CPU use while it ran (`CpuUse`, read outside the timed span) and (for DART tree methods) its steps,
    phase times, node budgets and whether it decoded plainly throughout to `tally`. Leaves the call's forwards in
    `counter.count`."""
    with CpuUse() as use:
        sync_device(ids.device)
        start = time.perf_counter()
        out, stats = counted_run(m, target, head, ids, mask, gen, counter)
        sync_device(ids.device)
        seconds = time.perf_counter() - start
    tally.seconds += seconds
    tally.forwards += counter.count
    tally.calls += 1
    _add_cpu_use(tally, use, seconds)
    if m.tree:
        tally.plain_calls += int(not any(stats.node_budgets))
        tally.steps += stats.steps
        for p in ALL_PHASES:
            tally.phases[p] += stats.time.get(p, 0.0)
        tally.budgets += list(stats.node_budgets)
        if m.compiled and not stats.compiled:
            tally.not_compiled.append(stats.static_reason or "not compiled (transformers' compile criteria)")
    return out, seconds


def _add_cpu_use(tally: _Tally, use: CpuUse, seconds: float) -> None:
    """One timed call's reading of other processes' CPU use into `tally`: their cores' worth of CPU weighted by the
    call's seconds (a short call spans few /proc/stat ticks: the method's average over all its calls is the figure),
    or where /proc/stat is unread the load average's verdict."""
    tally.cores = use.cores
    if use.other_cores is not None:
        tally.other_core_seconds += use.other_cores * seconds
        tally.read_seconds += seconds
    elif use.busy() is not None:
        tally.load_busy.append(use.busy())


def counted_run(m: Method, target, head, ids, mask, gen: dict, counter: ForwardCounter):
    """(output, the call's `DartStats` or None when it did not use the head); `counter.count` becomes the call's
    target forwards: hooked, or for a compiled method (no hook) the prefill + one per DART step, or one per new
    token for plain decoding."""
    counter.count = 0
    before = head.stats
    with counter.paused() if m.compiled else nullcontext():
        out = m.run(target, head, ids, attention_mask=mask, **gen)
    stats = head.stats if head.stats is not before else None
    if m.compiled:
        counter.count = stats.steps + 1 if stats is not None else out.shape[1] - ids.shape[1]
    return out, stats


# ---------------------------------------------------------------------------------------------------- batches
def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask [B, T]) of `[1, T_i]` prompts, left-padded with `pad_id`: what a tokenizer
    with padding_side='left' gives for the same chat prompts."""
    width = max(r.shape[-1] for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        n = r.shape[-1]
        ids[b, width - n :] = r.reshape(-1)
        mask[b, width - n :] = 1
    return ids, mask


def new_token_counts(out: torch.Tensor, prompt_len: int, eos_ids) -> list[int]:
    """Per row: the new tokens up to and including the row's first EOS (all of them without one); what follows is
    `generate`'s padding of a finished row."""
    eos = torch.tensor(sorted(eos_ids), dtype=out.dtype, device=out.device) if eos_ids else None
    counts = []
    for row in out[:, prompt_len:]:
        if eos is None:
            counts.append(row.numel())
            continue
        hits = torch.isin(row, eos).nonzero()
        counts.append(int(hits[0, 0]) + 1 if hits.numel() else row.numel())
    return counts


def _eos_ids(target, gen: dict) -> list[int]:
    eos = gen.get("eos_token_id", target.generation_config.eos_token_id)
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def run_batched(target, head, prompts, methods, gen, batch_sizes, warmup, progress, meta, runs, load,
                ) -> dict:
    """The batched bench: for every batch size, plain batched `generate` and the methods that decode a batch, run
    batch by batch (each batch runs every method before the next batch; the batch sizes take turns), outputs
    compared row by row with plain's."""
    pad_id = gen.get("pad_token_id", target.generation_config.pad_token_id)
    if pad_id is None:
        raise ValueError("the batched bench needs a pad_token_id (generation config) to left-pad the prompts")
    per_size = {b: [m for m in methods if b == 1 or m.one_row_only is None] for b in batch_sizes}
    skipped = {m.name: m.one_row_only for m in methods if m.one_row_only and max(batch_sizes) > 1}
    groups = {ds: {b: [list(range(i, min(i + b, len(ps)))) for i in range(0, len(ps), b)] for b in batch_sizes}
              for ds, ps in prompts.items()}
    with CompetingLoad(load) if load else _no_load():
        calls = [left_pad([ps[r] for r in rows], pad_id) for ds, ps in prompts.items() for b in batch_sizes
                 for rows in groups[ds][b]]
        compile_seconds = _compile_warmup(target, head, calls, [m for m in methods if m.compiled], gen, progress)
        if warmup:
            ps = next(iter(prompts.values()))
            for b in batch_sizes:
                ids, mask = left_pad(ps[: b], pad_id)
                for m in per_size[b]:
                    if not m.compiled:
                        seed_call(gen, "warm-up")
                        m.run(target, head, ids.to(target.device), attention_mask=mask.to(target.device),
                              **{**gen, "max_new_tokens": min(8, gen["max_new_tokens"])})
        tallies, mismatches = [], []
        for run in range(runs):
            tally, bad = _batch_pass(target, head, prompts, groups, per_size, gen, pad_id, progress,
                                     f" (run {run + 1}/{runs})" if runs > 1 else "")
            tallies.append(tally)
            mismatches += [{**m, "run": run} for m in bad] if runs > 1 else bad
    return {
        "meta": {**environment(target), **(meta or {}), "max_new_tokens": gen["max_new_tokens"],
                 "prompts": {ds: len(ps) for ds, ps in prompts.items()}, "runs": runs, "competing_load": load,
                 "batch_sizes": batch_sizes,
                 "skipped_for_batches": skipped},
        "methods": {m.name: m.label for m in methods},
        "batch_sizes": batch_sizes,
        "batches": {ds: {str(b): _summarise([t[(ds, b)] for t in tallies], per_size[b], _compares(gen))
                         for b in batch_sizes} for ds in prompts},
        "compile_warmup": compile_seconds,
        "mismatches": mismatches,
        "all_equal": not mismatches if _compares(gen) else None,
    }


def _batch_pass(target, head, prompts, groups, per_size, gen, pad_id, progress, label) -> tuple[dict, list]:
    """One pass: per data set, the batches of every batch size in turns (batch i of each size, then batch i + 1),
    every method on each batch. Returns (tallies per (data set, batch size) and method, mismatched rows)."""
    device = target.device
    eos = _eos_ids(target, gen)
    counter = ForwardCounter(target)
    tallies = {(ds, b): {m.name: _Tally() for m in ms} for ds in prompts for b, ms in per_size.items()}
    mismatches = []
    try:
        for ds, ds_prompts in prompts.items():
            turns = [(b, i, rows) for i in range(max(len(g) for g in groups[ds].values()))
                     for b, g in groups[ds].items() if i < len(g) for rows in [g[i]]]
            for b, i, rows in tqdm(turns, desc=f"bench {ds} batches{label}", unit="batch", disable=not progress):
                ids, mask = left_pad([ds_prompts[r] for r in rows], pad_id)
                ids, mask = ids.to(device), mask.to(device)
                ref = None
                for m in per_size[b]:
                    tally = tallies[(ds, b)][m.name]
                    seed_call(gen, ds, f"b{b}", i)
                    out, seconds = _timed_run(m, target, head, ids, mask, gen, counter, tally)
                    counts = new_token_counts(out, ids.shape[1], eos)
                    new = sum(counts)
                    tally.new_tokens += new
                    entry = {"batch": i, "prompts": rows, "batch_size": len(rows), "prompt_tokens": ids.shape[1],
                             "new_tokens": new, "seconds": seconds, "forwards": counter.count}
                    if not _compares(gen):
                        entry["seed"] = call_seed(ds, f"b{b}", i)
                    if ref is None:
                        ref, ref_counts = out, counts
                    elif _compares(gen):
                        bad = _row_differences(out, ref, ids.shape[1])
                        if bad:
                            tally.mismatches += 1
                            entry["mismatched_rows"] = [r for r, _ in bad]
                        for r, where in bad:
                            mismatches.append({"dataset": ds, "batch_size": b, "batch": i, "row": r,
                                               "prompt": rows[r], "method": m.name, "first_difference": where,
                                               "new_tokens": counts[r], "reference_new_tokens": ref_counts[r]})
                    entry["rows_compared"] = len(rows) if ref is not out and _compares(gen) else 0
                    tally.per_prompt.append(entry)
    finally:
        counter.remove()
    return tallies, mismatches


def _row_differences(out: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> list[tuple[int, int]]:
    """(row, first differing new token) for every row of `out` that differs from the same row of `ref` (a row
    that is a strict prefix of the other differs at its end)."""
    bad = []
    for r in range(max(out.shape[0], ref.shape[0])):
        if r >= out.shape[0] or r >= ref.shape[0]:
            bad.append((r, 0))
            continue
        a, b = out[r], ref[r]
        n = min(a.numel(), b.numel())
        diff = (a[:n] != b[:n]).nonzero()
        if diff.numel():
            bad.append((r, int(diff[0, 0]) - prompt_len))
        elif a.numel() != b.numel():
            bad.append((r, n - prompt_len))
    return bad


def _tokens_per_s(t: _Tally) -> float:
    return t.new_tokens / t.seconds if t.seconds else float("nan")


def _ratios(runs: list[dict[str, _Tally]], merged: dict[str, _Tally], name: str, base: str, key: str) -> dict:
    """Tokens/s of `name` over `base`'s: over all runs together (`key`), per run, their median and min-max."""
    per_run = [_tokens_per_s(run[name]) / _tokens_per_s(run[base]) for run in runs]
    base_tps = _tokens_per_s(merged[base])
    return {key: _tokens_per_s(merged[name]) / base_tps if base_tps else float("nan"), f"{key}_runs": per_run,
            f"{key}_median": statistics.median(per_run), f"{key}_spread": [min(per_run), max(per_run)]}


def _summarise(runs: list[dict[str, _Tally]], methods: list[Method], compared: bool = True) -> dict:
    """One row per method over all runs (tokens/s of all runs together), with each run's speedup over plain (and
    over the method's `baseline`, when it has one: `speedup_vs_baseline`). `compared`: outputs were compared with
    plain's (greedy); when not (sampling), `equal_to_plain` and `mismatched_prompts` are None."""
    def merged(name: str) -> _Tally:
        out = _Tally()
        for run in runs:
            t = run[name]
            out.seconds += t.seconds
            out.new_tokens += t.new_tokens
            out.forwards += t.forwards
            out.steps += t.steps
            out.mismatches += t.mismatches
            out.budgets += t.budgets
            out.per_prompt += t.per_prompt
            out.not_compiled += t.not_compiled
            out.calls += t.calls
            out.plain_calls += t.plain_calls
            out.other_core_seconds += t.other_core_seconds
            out.read_seconds += t.read_seconds
            out.cores = max(out.cores, t.cores)
            out.load_busy += t.load_busy
            for p in ALL_PHASES:
                out.phases[p] += t.phases[p]
        return out

    tallies = {m.name: merged(m.name) for m in methods}
    out = {}
    for m in methods:
        t = tallies[m.name]
        row = {
            "tokens_per_s": _tokens_per_s(t),
            **_ratios(runs, tallies, m.name, "plain", "speedup"),
            "accepted_length": t.new_tokens / t.forwards if t.forwards else float("nan"),
            "new_tokens": t.new_tokens,
            "seconds": t.seconds,
            "calls": t.calls,
            "target_forwards": t.forwards,
            "equal_to_plain": t.mismatches == 0 if compared else None,
            "mismatched_prompts": t.mismatches if compared else None,
            "per_prompt": t.per_prompt,
        }
        if m.baseline in tallies:
            row["baseline"] = m.baseline
            row.update(_ratios(runs, tallies, m.name, m.baseline, "speedup_vs_baseline"))
        if t.not_compiled:
            row["not_compiled"] = dict(Counter(t.not_compiled))
        row.update(_machine_use(t))
        if m.tree:
            row["plain_calls"] = t.plain_calls
            row["plain_decoding"] = t.calls > 0 and t.plain_calls == t.calls
        if m.tree and t.steps:
            phases = [p for p in ALL_PHASES if p in PHASES or t.phases[p]]  # "step": the captured static step
            step_total = sum(t.phases.values())
            row["steps"] = t.steps
            row["step_ms"] = 1e3 * step_total / t.steps
            row["phase_ms"] = {p: 1e3 * t.phases[p] / t.steps for p in phases}
            row["phase_share"] = {p: t.phases[p] / step_total if step_total else 0.0 for p in phases}
        if t.budgets:
            row["node_budget_mean"] = sum(t.budgets) / len(t.budgets)
            row["node_budget_counts"] = dict(sorted(Counter(t.budgets).items()))
        out[m.name] = row
    return out


def _machine_use(t: _Tally) -> dict:
    """How busy other processes kept the machine while the method's calls were timed: "other_cores" (their cores'
    worth of CPU on average over the timed seconds; None: not read) and "busy" (why its tokens/s do not describe
    this machine at rest, in words; None: no reason found, under `machine.BUSY_CORES`)."""
    other = t.other_core_seconds / t.read_seconds if t.read_seconds else None
    busy = None
    if other is not None and other >= BUSY_CORES:
        busy = f"other processes used {other:.1f} of the {t.cores} cores on average while its calls were timed"
    elif t.load_busy:
        busy = f"{t.load_busy[0]} at {len(t.load_busy)} of its {t.calls} timed calls"
    return {"other_cores": other, "busy": busy}


def environment(target) -> dict:
    import transformers

    device = target.device
    return {
        "target": str(getattr(target.config, "name_or_path", "") or target.config.model_type),
        "dtype": str(target.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'}",
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": target.config._attn_implementation,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


__all__ = [
    "ALL_PHASES", "PHASES", "PHASE_LABELS", "CompetingLoad", "ForwardCounter", "counted_run", "environment",
    "left_pad", "new_token_counts", "run_batched", "run_rows", "sync_device",
]
