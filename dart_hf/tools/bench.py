"""`dart-hf bench`: DART against plain `generate` and transformers' own speculative methods, in one process.

On the same prompts (HumanEval and held-out ShareGPT), greedy, after a warm-up generation per method:

    plain           target.generate(ids)                                   the reference every output must equal
    prompt_lookup   target.generate(ids, prompt_lookup_num_tokens=10)
    dart_chain      target.generate(ids, assistant_model=head, dart_mode="chain")   (transformers' assisted loop)
    dart_tree_60    target.generate(ids, assistant_model=head, dart_node_budget=60)  (reference fixed budget)
    dart_tree_auto  target.generate(ids, assistant_model=head, dart_node_budget="auto") (cost-aware budget)
    dart_tree_auto_no_lookup   the same without prompt-lookup candidates in the tree (what the head alone gives)

`--compiled` adds, one row each, what a GPU user runs (off by default: each compiles for a minute or more on a CPU):

    plain_compiled      target.generate(ids, cache_implementation="static", compile_config=...)
    dart_compiled_<B>   the same with assistant_model=head, dart_node_budget=B (`core.static_step`), per --budget

reported also as a speed-up over plain_compiled; each is first called once on every prompt, untimed, to compile (those
seconds are reported apart). `--profile` adds top-level aten ops and host syncs per decoding step and per new token
of every method, on one prompt per data set (`profile_methods`).

Reported per data set and method: tokens/s, speedup over plain, accepted length (new
tokens per target forward, counted with a forward hook on the target; plain = 1), whether every output equals plain
generate, and for the tree methods where a step's time goes (head forward, tree search, target verify, accept +
cache bookkeeping).
Prompts are interleaved (each prompt runs every method before the next prompt) so slow drifts in machine load hit
all methods alike; `runs` repeats the whole interleaved pass and reports each run's speedup (median and spread).
`load` starts that many busy-loop processes (one per core: `--load`) beside the methods for the whole bench, so a
speedup on a busy machine is a command anyone can rerun. Before any timing (and before the load starts) the target's
verify-cost curve is loaded or measured and written (`dart_hf.tools.calibrate`; not written when the measurement
fails its checks). Writes results.json, results.md and results.png; the exit status is 3 when any output differs.

`--batch-size B [B ...]` (any B > 1) runs the batched bench instead: for each B the prompts of each data set go in
left-padded batches of B (each data set gets at least max(B) prompts, the same ones for every B), and plain batched
`generate` and the DART tree methods run batch by batch, the batch sizes taking turns;
every row is compared with plain's. Prompt lookup and chain mode decode one row at a time in transformers, and so do
the static-cache (compiled) methods, so they run at B = 1 only (the report says so). Reported per data set and B:
tokens/s (each row's new tokens up to its first EOS, over the wall time of the batch's calls), the ratio to plain at
the same B, and the DART methods' tree sizes per row (`results["batches"]`, results.md, and results.png: tokens/s against B, a panel per data set).

Under `torchrun` (`python -m torch.distributed.run --nproc-per-node N -m dart_hf_cli bench ...`, or `torchrun
$(which dart-hf) bench ...`) the target is loaded tensor-parallel (`tp_plan="auto"`: gloo on CPU, nccl on GPUs),
every rank runs the same calls in lockstep and only rank 0 prints and writes the reports (its wall times: each step
waits for every rank). The cost-aware methods are left out there (a tensor-parallel target needs a fixed node budget,
`docs/TENSOR_PARALLEL.md`), a cost-aware head gets the first `--budget` for chain mode, and no verify-cost curve is
measured.

`--synthetic` instead measures, on a CUDA GPU, a random target of Qwen3-8B's shape in bf16: the verify cost by tree
size and the head + tree-search overhead as a share of a DART step, and with `--compiled` the same on a static cache
with torch.compile against compiled plain decoding (`examples/gpu_check.sh` runs it).
"""

from __future__ import annotations

import argparse
import json
import math
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
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..core.cost import load_curve
from ..core.distributed import tensor_parallel_group
from .assets import shipped_head

DATASETS = ("humaneval", "sharegpt")
PHASES = ("draft", "tree", "verify", "accept")
STEP = "step"  # the static greedy step, captured whole: its time is one phase (`DartStats.time["step"]`)
ALL_PHASES = (*PHASES, STEP)
PHASE_LABELS = {"draft": "head forward", "tree": "tree search", "verify": "target verify", "accept": "accept + cache",
                STEP: "captured step"}
MISMATCH_EXIT = 3


# ---------------------------------------------------------------------------------------------------- methods
@dataclass
class Method:
    """One way to generate. `run(target, head, ids, **generate_kwargs)` returns the output ids [1, T];
    `tree`: a DART tree method, whose `head.stats` carry per-phase times; `compiled`: it decodes on a static cache
    with `torch.compile` (its first calls compile: warmed up on every prompt, `_compile_warmup`, and never run with
    a forward hook, which dynamo would trace); `baseline`: another method whose tokens/s this one is also compared
    with (the compiled DART rows: compiled plain `generate`, what a GPU user would otherwise run)."""

    name: str
    label: str
    run: Callable
    tree: bool = False
    one_row_only: str | None = None  # why the method cannot decode a batch (None: it can); skipped at batch size > 1
    compiled: bool = False
    baseline: str | None = None


DEFAULT_BUDGET = 60
STATIC_ONE_ROW = "the static-cache step decodes one unpadded row (transformers' and DART's alike)"


def standard_methods(fixed_budget: int | list[int] = DEFAULT_BUDGET, lookup_tokens: int = 10, compiled: bool = False,
                     compile_backend: str = "inductor") -> list[Method]:
    """The bench's methods; `compiled` adds `compiled_methods` at the fixed budgets (off by default: each compiled
    method's first calls take a minute or more to compile on a CPU)."""
    fixed = [fixed_budget] if isinstance(fixed_budget, int) else list(fixed_budget)
    return [
        Method("plain", "generate", lambda t, h, ids, **kw: t.generate(ids, **kw)),
        Method("prompt_lookup", f"prompt lookup ({lookup_tokens})",
               lambda t, h, ids, **kw: t.generate(ids, prompt_lookup_num_tokens=lookup_tokens, **kw),
               one_row_only="transformers' prompt lookup decodes one row at a time"),
        Method("dart_chain", "DART chain (assisted loop)",
               lambda t, h, ids, **kw: t.generate(ids, assistant_model=h, dart_mode="chain", **kw),
               one_row_only="chain mode runs transformers' assisted loop, which decodes one row at a time"),
        *(_fixed_tree(b) for b in fixed),
        Method("dart_tree_auto", "DART tree, cost-aware budget",
               lambda t, h, ids, **kw: t.generate(ids, assistant_model=h, dart_node_budget="auto", **kw), tree=True),
        Method("dart_tree_auto_no_lookup", "DART tree, cost-aware, head only (no prompt lookup)",
               lambda t, h, ids, **kw: t.generate(ids, assistant_model=h, dart_node_budget="auto",
                                                  dart_prompt_lookup=False, **kw), tree=True),
        *(compiled_methods(fixed, compile_backend) if compiled else []),
    ]


def _fixed_tree(budget: int) -> Method:
    return Method(f"dart_tree_{budget}", f"DART tree, budget {budget}",
                  lambda t, h, ids, **kw: t.generate(ids, assistant_model=h, dart_node_budget=budget, **kw), tree=True)


def compile_config(device: torch.device, backend: str = "inductor"):
    """The `CompileConfig` a user passes for a compiled static-cache `generate`: fullgraph; on CUDA transformers'
    default mode ("reduce-overhead": CUDA graphs) for inductor; elsewhere no mode, and `_compile_all_devices` (else
    transformers compiles on accelerators only). `backend`: "inductor", or e.g. "eager" (dynamo's capture only, for
    quick checks)."""
    from transformers.generation.configuration_utils import CompileConfig

    cuda = torch.device(device).type == "cuda"
    config = CompileConfig(fullgraph=True, backend=backend,
                           mode="reduce-overhead" if cuda and backend == "inductor" else None)
    if not cuda:
        config._compile_all_devices = True
    return config


def compiled_methods(budgets: list[int], backend: str = "inductor") -> list[Method]:
    """plain_compiled (`generate(ids, cache_implementation="static", compile_config=...)`) and dart_compiled_<B> (the
    same with the head at node budget B: `core.static_step`); one row each."""
    def plain(t, h, ids, **kw):
        return t.generate(ids, cache_implementation="static", compile_config=compile_config(t.device, backend), **kw)

    def dart(budget: int) -> Method:
        return Method(f"dart_compiled_{budget}", f"DART, static cache + compile, budget {budget}",
                      lambda t, h, ids, **kw: plain(t, h, ids, assistant_model=h, dart_node_budget=budget, **kw),
                      tree=True, one_row_only=STATIC_ONE_ROW, compiled=True, baseline="plain_compiled")

    return [Method("plain_compiled", "generate, static cache + compile", plain, one_row_only=STATIC_ONE_ROW,
                   compiled=True), *(dart(b) for b in budgets)]


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


def _sync(device: torch.device) -> None:
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


def run_bench(
    target,
    head,
    prompts: dict[str, list[torch.Tensor]],
    max_new_tokens: int = 128,
    methods: list[Method] | None = None,
    out_dir: str | Path | None = None,
    warmup: bool = True,
    progress: bool = True,
    meta: dict | None = None,
    runs: int = 1,
    load: int = 0,
    batch_sizes: list[int] | None = None,
    calibrate: bool = True,
    profile: bool = False,
) -> dict:
    """Run every method on every prompt, `runs` times; returns (and, with `out_dir`, writes) the results.

    `prompts` maps a data set name to `[1, T]` id tensors. The first method must be "plain": the reference.
    `load`: busy-loop processes running beside the methods (`CompetingLoad`), 0 for none.
    `calibrate`: measure the verify-cost curve first when none is stored (False: decode with what is stored, as a
    user who never ran `dart-hf calibrate` does).
    `batch_sizes`: None or [1] for the single-row bench; otherwise the batched bench (`_batch_pass`): for each batch
    size B the prompts go in left-padded batches of B, and the results are per data set and batch size
    (`results["batches"]`).
    Compiled methods (`Method.compiled`) are first called once on every prompt, untimed, whether or not `warmup`:
    that compiles every graph the timed calls run; its seconds are `results["compile_warmup"]`.
    `profile`: afterwards, each method once more on the first prompt of each data set, untimed, counting aten ops
    and host syncs (`profile_methods`, `results["profile"]`).
    A tensor-parallel target (every rank calls this with the same arguments): no curve is measured (each rank's
    measurement would decide its own sizes and retries; the cost-aware methods use a stored curve or none, and every
    rank follows the first rank's choices, `core.distributed.shared_budget`), and only rank 0 shows progress, runs
    the competing load and writes `out_dir`; every rank returns its own results (rank 0's are the ones to report).
    """
    batched = batch_sizes is not None and list(batch_sizes) != [1]
    if batched and (not batch_sizes or min(batch_sizes) < 1):
        raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
    methods = methods if methods is not None else standard_methods()
    if not methods or methods[0].name != "plain":
        raise ValueError("the first bench method must be 'plain' (the reference outputs are compared with)")
    ranks = tensor_parallel_ranks(target)
    if ranks is not None:
        calibrate, meta = False, {**(meta or {}), "tensor_parallel": ranks[1]}
        if ranks[0] != 0:  # rank 0 reports; the others run the same calls in lockstep
            progress, out_dir, load = False, None, 0
    gen = dict(do_sample=False, max_new_tokens=max_new_tokens)
    if getattr(target.generation_config, "pad_token_id", None) is None:
        eos = target.generation_config.eos_token_id
        gen["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    curve = None
    if any(_cost_aware(m) for m in methods):
        from .calibrate import calibrate as measure  # the cost-aware budget reads the curve; measure outside timing

        curve = measure(target, verbose=progress)[0] if calibrate else load_curve(target)
    if batched:
        results = _run_batched(target, head, prompts, methods, gen, sorted(set(batch_sizes)), warmup, progress,
                               meta, runs, load, curve)
    else:
        results = _run_rows(target, head, prompts, methods, gen, warmup, progress, meta, runs, load, curve)
    if profile:  # the methods that ran (warmed up: nothing compiles under the profiler)
        ran = [m for m in methods if not batched or 1 in batch_sizes or m.one_row_only is None]
        results["profile"] = profile_methods(target, head, prompts, ran, gen)
    if out_dir is not None:
        write_reports(results, out_dir)
    return results


def _run_rows(target, head, prompts, methods, gen, warmup, progress, meta, runs, load, curve) -> dict:
    """The single-row bench: every method on every prompt, `runs` interleaved passes."""
    max_new_tokens = gen["max_new_tokens"]
    with CompetingLoad(load) if load else _no_load():
        compile_seconds = _compile_warmup(target, head, prompts, [m for m in methods if m.compiled], gen, progress)
        if warmup:
            first = next(p for ps in prompts.values() for p in ps).to(target.device)
            for m in methods:
                if not m.compiled:
                    m.run(target, head, first, **{**gen, "max_new_tokens": min(16, max_new_tokens)})
        tallies, mismatches = [], []
        for run in range(runs):
            tally, bad = _one_pass(target, head, prompts, methods, gen, progress, f" (run {run + 1}/{runs})"
                                   if runs > 1 else "")
            tallies.append(tally)
            mismatches += [{**m, "run": run} for m in bad] if runs > 1 else bad
    return {
        "meta": {**_environment(target), **(meta or {}), "max_new_tokens": max_new_tokens,
                 "prompts": {ds: len(ps) for ds, ps in prompts.items()}, "runs": runs, "competing_load": load,
                 "verify_curve": None if curve is None else curve.path},
        "methods": {m.name: m.label for m in methods},
        "datasets": {ds: _summarise([t[ds] for t in tallies], methods) for ds in prompts},
        "compile_warmup": compile_seconds,
        "mismatches": mismatches,
        "all_equal": not mismatches,
    }


def _compile_warmup(target, head, prompts: dict, methods: list[Method], gen: dict, progress: bool) -> dict:
    """Each compiled method once on every prompt, untimed, at the bench's full length, longest prompt first
    (transformers sizes a static cache for the longest call so far, so the shorter prompts then reuse its graph;
    DART's caches are rounded up to 256 slots): every graph the timed calls run is compiled here. Returns
    {method: {"seconds": all its warm-up calls, "first_call_seconds", "calls"}} (these seconds are not in the
    timed tokens/s)."""
    order = sorted((p for ps in prompts.values() for p in ps), key=lambda p: -p.shape[-1])
    out = {}
    for m in methods:
        times = []
        for ids in tqdm(order, desc=f"compile {m.name}", unit="prompt", disable=not progress):
            ids = ids.to(target.device)
            _sync(ids.device)
            start = time.perf_counter()
            m.run(target, head, ids, attention_mask=torch.ones_like(ids), **gen)
            _sync(ids.device)
            times.append(time.perf_counter() - start)
        out[m.name] = {"seconds": sum(times), "first_call_seconds": times[0], "calls": len(times)}
    return out


def _cost_aware(m: Method) -> bool:
    return m.name.endswith("_auto") or m.name.endswith("_auto_no_lookup")


def tensor_parallel_ranks(target) -> tuple[int, int] | None:
    """(this rank, ranks) of a tensor-parallel target's group, None for a target in one process."""
    group = tensor_parallel_group(target)
    if group is None:
        return None
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


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
                    out, seconds = _timed_run(m, target, head, ids, torch.ones_like(ids), gen, counter, tally)
                    new = out.shape[1] - ids.shape[1]
                    tally.new_tokens += new
                    row = {"prompt": i, "prompt_tokens": ids.shape[1], "new_tokens": new, "seconds": seconds,
                           "forwards": counter.count}
                    if ref is None:
                        ref = out
                    elif not torch.equal(out, ref):
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
    """(output, wall seconds) of one method call with device syncs around it; adds its time, target forwards and (for
    DART tree methods) its steps, phase times and node budgets to `tally`. Leaves the call's forwards in
    `counter.count`."""
    _sync(ids.device)
    start = time.perf_counter()
    out, stats = _counted_run(m, target, head, ids, mask, gen, counter)
    _sync(ids.device)
    seconds = time.perf_counter() - start
    tally.seconds += seconds
    tally.forwards += counter.count
    if m.tree:
        tally.steps += stats.steps
        for p in ALL_PHASES:
            tally.phases[p] += stats.time.get(p, 0.0)
        tally.budgets += list(stats.node_budgets)
        if m.compiled and not stats.compiled:
            tally.not_compiled.append(stats.static_reason or "not compiled (transformers' compile criteria)")
    return out, seconds


def _counted_run(m: Method, target, head, ids, mask, gen: dict, counter: ForwardCounter):
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


def _run_batched(target, head, prompts, methods, gen, batch_sizes, warmup, progress, meta, runs, load,
                 curve) -> dict:
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
        compile_seconds = _compile_warmup(target, head, prompts, [m for m in per_size.get(1, []) if m.compiled],
                                          gen, progress)
        if warmup:
            ps = next(iter(prompts.values()))
            for b in batch_sizes:
                ids, mask = left_pad(ps[: b], pad_id)
                for m in per_size[b]:
                    if not m.compiled:
                        m.run(target, head, ids.to(target.device), attention_mask=mask.to(target.device),
                              **{**gen, "max_new_tokens": min(8, gen["max_new_tokens"])})
        tallies, mismatches = [], []
        for run in range(runs):
            tally, bad = _batch_pass(target, head, prompts, groups, per_size, gen, pad_id, progress,
                                     f" (run {run + 1}/{runs})" if runs > 1 else "")
            tallies.append(tally)
            mismatches += [{**m, "run": run} for m in bad] if runs > 1 else bad
    return {
        "meta": {**_environment(target), **(meta or {}), "max_new_tokens": gen["max_new_tokens"],
                 "prompts": {ds: len(ps) for ds, ps in prompts.items()}, "runs": runs, "competing_load": load,
                 "verify_curve": None if curve is None else curve.path, "batch_sizes": batch_sizes,
                 "skipped_for_batches": skipped},
        "methods": {m.name: m.label for m in methods},
        "batch_sizes": batch_sizes,
        "batches": {ds: {str(b): _summarise([t[(ds, b)] for t in tallies], per_size[b]) for b in batch_sizes}
                    for ds in prompts},
        "compile_warmup": compile_seconds,
        "mismatches": mismatches,
        "all_equal": not mismatches,
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
                    out, seconds = _timed_run(m, target, head, ids, mask, gen, counter, tally)
                    counts = new_token_counts(out, ids.shape[1], eos)
                    new = sum(counts)
                    tally.new_tokens += new
                    entry = {"batch": i, "prompts": rows, "batch_size": len(rows), "prompt_tokens": ids.shape[1],
                             "new_tokens": new, "seconds": seconds, "forwards": counter.count}
                    if ref is None:
                        ref, ref_counts = out, counts
                    else:
                        bad = _row_differences(out, ref, ids.shape[1])
                        if bad:
                            tally.mismatches += 1
                            entry["mismatched_rows"] = [r for r, _ in bad]
                        for r, where in bad:
                            mismatches.append({"dataset": ds, "batch_size": b, "batch": i, "row": r,
                                               "prompt": rows[r], "method": m.name, "first_difference": where,
                                               "new_tokens": counts[r], "reference_new_tokens": ref_counts[r]})
                    entry["rows_compared"] = len(rows) if ref is not out else 0
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


def _summarise(runs: list[dict[str, _Tally]], methods: list[Method]) -> dict:
    """One row per method over all runs (tokens/s of all runs together), with each run's speedup over plain (and
    over the method's `baseline`, when it has one: `speedup_vs_baseline`)."""
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
            "target_forwards": t.forwards,
            "equal_to_plain": t.mismatches == 0,
            "mismatched_prompts": t.mismatches,
            "per_prompt": t.per_prompt,
        }
        if m.baseline in tallies:
            row["baseline"] = m.baseline
            row.update(_ratios(runs, tallies, m.name, m.baseline, "speedup_vs_baseline"))
        if t.not_compiled:
            row["not_compiled"] = dict(Counter(t.not_compiled))
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


def _environment(target) -> dict:
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


# ---------------------------------------------------------------------------------------------------- profile
CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
PROFILE_HOW = (
    "aten ops: `torch.profiler` CPU events named `aten::*` with no `aten::*` event above them (the ops Python, "
    "transformers or a compiled graph's wrapper dispatched; inductor's generated C++/Triton kernels are not aten ops "
    "and do not appear, while its extern kernels such as `aten::mm` do, so a compiled step shows far fewer). "
    "Per step: the call's count (prefill included) over its decoding steps (DART: `DartStats.steps`; other methods: "
    "target forwards, plain decoding one per new token)."
)
SYNCS_HOW = {
    "value reads": "host syncs: reads of tensor values into Python (`item`, `tolist`, `__bool__`, `__int__`, "
                   "`__float__`, `__index__`, `nonzero`, `numpy`), counted by wrapping those `Tensor` methods; on a CPU "
                   "this also counts reads of tensors that already live on the host (on a GPU those are no sync)",
    "cuda": "host syncs: the profiler's `cudaStreamSynchronize` / `cudaDeviceSynchronize` / `cudaEventSynchronize` "
            "calls (every device-to-host copy the host waits for is one)",
}


class HostReads:
    """Counts reads of tensor values into Python while active (per method name, `reads`): each one a host sync on a
    GPU. Wraps those `torch.Tensor` methods rather than pushing a `TorchFunctionMode` (as tests/test_static_step.py's
    HostSyncs does): dynamo guards on the torch-function mode stack, so an active mode would recompile every compiled
    step it meets (a minute each on a CPU); a captured step has no host read to count anyway (fullgraph)."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")

    def __init__(self):
        self.reads: Counter = Counter()
        self._saved: dict = {}

    def __enter__(self) -> "HostReads":
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = (name in vars(torch.Tensor), original)
            setattr(torch.Tensor, name, self._counted(name, original))
        return self

    def _counted(self, name: str, original: Callable) -> Callable:
        def counted(tensor, *args, **kwargs):
            self.reads[name] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for name, (own, original) in self._saved.items():
            if own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)  # the method is inherited from torch._C.TensorBase
        self._saved = {}


def top_level_aten_ops(events) -> int:
    """Profiler events named aten::* that no other aten::* event encloses."""
    def top(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in events if e.name.startswith("aten::") and top(e))


def profile_methods(target, head, prompts: dict[str, list[torch.Tensor]], methods: list[Method], gen: dict) -> dict:
    """Each method once on the first prompt of each data set (untimed; after the bench's warm-up and timed runs, so
    nothing compiles here): top-level aten ops and host syncs per decoding step and per new token (`PROFILE_HOW`,
    `SYNCS_HOW`). Returns {"how", "syncs", "datasets": {data set: {method: counts}}}."""
    counter = ForwardCounter(target)
    try:
        rows = {ds: {m.name: _profile_call(m, target, head, ps[0].to(target.device), gen, counter) for m in methods}
                for ds, ps in prompts.items()}
    finally:
        counter.remove()
    syncs = "cuda" if target.device.type == "cuda" else "value reads"
    return {"how": PROFILE_HOW, "syncs": SYNCS_HOW[syncs], "datasets": rows}


def _profile_call(m: Method, target, head, ids: torch.Tensor, gen: dict, counter: ForwardCounter) -> dict:
    """One profiled call of `m`: its steps, new tokens, top-level aten ops, host syncs (and host value reads by
    method; on CUDA also device-to-host copies)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = ids.device.type == "cuda"
    _sync(ids.device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof, \
            HostReads() as reads:
        out, stats = _counted_run(m, target, head, ids, torch.ones_like(ids), gen, counter)
    events = prof.events()
    new = out.shape[1] - ids.shape[1]
    steps = stats.steps if stats is not None else counter.count
    ops = top_level_aten_ops(events)
    syncs = sum(1 for e in events if e.name in CUDA_SYNCS) if cuda else sum(reads.reads.values())
    row = {"steps": steps, "new_tokens": new, "aten_ops": ops, "aten_ops_per_step": ops / max(steps, 1),
           "aten_ops_per_token": ops / max(new, 1), "host_syncs": syncs, "host_syncs_per_step": syncs / max(steps, 1),
           "host_syncs_per_token": syncs / max(new, 1), "host_reads": dict(reads.reads)}
    if cuda:
        row["dtoh_copies"] = sum(1 for e in events if "DtoH" in e.name)
    return row


def _profile_lines(results: dict) -> list[str]:
    """The profile table (`profile_methods`), when the bench ran with `profile`."""
    profile = results.get("profile")
    if not profile:
        return []
    lines = ["## Profile: aten ops and host syncs per step", "",
             "One call per method on the first prompt of each data set, after the warm-up and the timed runs, "
             f"untimed. {profile['how']} {profile['syncs'][0].upper()}{profile['syncs'][1:]}.", "",
             "| data set | method | steps | new tokens | aten ops / step | aten ops / token | host syncs / step | "
             "host syncs / token |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for ds, rows in profile["datasets"].items():
        for name, r in rows.items():
            lines.append(f"| {ds} | {results['methods'][name]} | {r['steps']} | {r['new_tokens']} | "
                         f"{r['aten_ops_per_step']:.1f} | {r['aten_ops_per_token']:.1f} | "
                         f"{r['host_syncs_per_step']:.2f} | {r['host_syncs_per_token']:.2f} |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------------- reports
def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _report_head(results: dict) -> list[str]:
    meta = results["meta"]
    lines = ["# dart-hf bench", ""]
    if not results["all_equal"]:
        lines += ["**OUTPUT MISMATCH: some methods did not reproduce plain `generate` (greedy must be identical).**",
                  ""]
        lines += [f"- {m['method']} on {m['dataset']} "
                  + (f"batch size {m['batch_size']} batch {m['batch']} row {m['row']} (prompt {m['prompt']})"
                     if "batch_size" in m else f"prompt {m['prompt']}")
                  + f": first difference at new token {m['first_difference']} ({m['new_tokens']} vs "
                  f"{m['reference_new_tokens']} new tokens)"
                  for m in results["mismatches"]]
        lines.append("")
    else:
        lines += ["Every method's output equals plain `generate` on every prompt (greedy).", ""]
    lines += [
        f"Target `{meta.get('target')}` ({meta.get('dtype')}, {meta.get('attn_implementation')}) on "
        f"{meta.get('device')} ({meta.get('torch_threads')} threads); head `{meta.get('head', 'n/a')}`; "
        f"{meta.get('max_new_tokens')} new tokens max; prompts {meta.get('prompts')}; torch {meta.get('torch')}, "
        f"transformers {meta.get('transformers')}; {meta.get('date')}.",
        "",
    ]
    if meta.get("runs", 1) > 1:
        lines += [f"{meta['runs']} interleaved runs: speedup is the median of the runs' speedups (min-max of the "
                  "runs in parentheses); tokens/s is over all runs.", ""]
    if meta.get("competing_load"):
        lines += [f"Under a competing load of {meta['competing_load']} busy-loop process(es) for the whole bench.", ""]
    if meta.get("tensor_parallel"):
        lines += [f"Tensor-parallel target over {meta['tensor_parallel']} ranks (torchrun); rank 0's wall times.", ""]
    return lines


def markdown_report(results: dict) -> str:
    if "batches" in results:
        return batch_markdown_report(results)
    lines = _report_head(results) + _compile_lines(results)
    for ds, rows in results["datasets"].items():
        baselines = list(dict.fromkeys(r["baseline"] for r in rows.values() if "baseline" in r))
        extra = "".join(f" vs {results['methods'][b]} |" for b in baselines)
        lines += [f"## {ds}", "", "| method | tokens/s | speedup | accepted length | equal to generate |" + extra,
                  "|---|---:|---:|---:|---|" + "---:|" * len(baselines)]
        for name, r in rows.items():
            equal = "yes" if r["equal_to_plain"] else f"**NO ({r['mismatched_prompts']} prompts)**"
            vs = "".join(f" {_speedup_text(r, 'speedup_vs_baseline')} |" if r.get("baseline") == b else " |"
                         for b in baselines)
            lines.append(f"| {results['methods'][name]} | {_fmt(r['tokens_per_s'], '.1f')} | "
                         f"{_speedup_text(r)} | {_fmt(r['accepted_length'])} | {equal} |{vs}")
        lines += _phase_lines(results, rows)
        lines.append("")
    return "\n".join(lines + _profile_lines(results))


def _phase_lines(results: dict, rows: dict) -> list[str]:
    """The DART rows' step breakdown ("captured step": the compiled static step, one phase)."""
    tree_rows = {n: r for n, r in rows.items() if "phase_share" in r}
    if not tree_rows:
        return []
    phases = [p for p in ALL_PHASES if any(p in r["phase_share"] for r in tree_rows.values())]
    lines = ["", "Where a DART tree step's time goes (share of the average step; prefill excluded):", "",
             "| method | step (ms) | " + " | ".join(PHASE_LABELS[p] for p in phases) + " | node budget |",
             "|---|---:|" + "---:|" * len(phases) + "---|"]
    for name, r in tree_rows.items():
        shares = " | ".join(f"{100 * r['phase_share'].get(p, 0.0):.0f}% ({r['phase_ms'].get(p, 0.0):.1f} ms)"
                            for p in phases)
        lines.append(f"| {results['methods'][name]} | {r['step_ms']:.1f} | {shares} | {_budget_text(r) or 'n/a'} |")
    notes = [f"- {results['methods'][name]}: {calls} call(s) ran uncompiled: {why}"
             for name, r in tree_rows.items() for why, calls in r.get("not_compiled", {}).items()]
    return lines + ([""] + notes if notes else [])


def _compile_lines(results: dict) -> list[str]:
    """The compiled methods' warm-up (compile) seconds, which the timed tokens/s leave out."""
    warm = results.get("compile_warmup") or {}
    if not warm:
        return []
    lines = ["Compiled methods (static cache + `torch.compile`) were first called once on every prompt, untimed, "
             "longest first: that compiles every graph the timed calls run. Those warm-up seconds are not in any "
             "tokens/s:", "", "| method | warm-up s (all calls) | first call s | calls |", "|---|---:|---:|---:|"]
    lines += [f"| {results['methods'][n]} | {w['seconds']:.1f} | {w['first_call_seconds']:.1f} | {w['calls']} |"
              for n, w in warm.items()]
    return lines + [""]


def batch_markdown_report(results: dict) -> str:
    """The batched bench's report: per data set, one row per (batch size, method)."""
    meta = results["meta"]
    lines = _report_head(results) + _compile_lines(results)
    sizes_text = ", ".join(map(str, meta["batch_sizes"]))
    lines += [f"Batches: the prompts of each data set in left-padded batches of {sizes_text} rows; every batch runs "
              "every method before the next batch, the batch sizes take turns. tokens/s: new "
              "tokens (each row's up to its first EOS) over the wall time of the batch's `generate` calls; vs plain: "
              "over plain batched `generate` at the same batch size; tree: the mean node budget per row over the "
              "DART steps (0: a plain decoding step).", ""]
    for name, why in meta.get("skipped_for_batches", {}).items():
        lines.append(f"- {results['methods'][name]} runs at batch size 1 only: {why}.")
    if meta.get("skipped_for_batches"):
        lines.append("")
    for ds, sizes in results["batches"].items():
        lines += [f"## {ds}", "",
                  "| batch size | method | tokens/s | vs plain | tree (nodes per row) | equal to generate |",
                  "|---:|---|---:|---:|---|---|"]
        for b, rows in sizes.items():
            for name, r in rows.items():
                equal = "yes" if r["equal_to_plain"] else f"**NO ({r['mismatched_prompts']} batches)**"
                lines.append(f"| {b} | {results['methods'][name]} | {_fmt(r['tokens_per_s'], '.1f')} | "
                             f"{_speedup_text(r)} | "
                             f"{_budget_text(r)} | {equal} |")
        lines.append("")
    return "\n".join(lines + _profile_lines(results))


def _speedup_text(r: dict, key: str = "speedup") -> str:
    """The speed-up over plain (or another `_ratios` key); over several runs, their median with the runs' min-max."""
    if len(r.get(f"{key}_runs", [])) > 1:
        lo, hi = r[f"{key}_spread"]
        return f"{_fmt(r[f'{key}_median'])}x ({_fmt(lo)}-{_fmt(hi)})"
    return f"{_fmt(r[key])}x"


def _budget_text(r: dict) -> str:
    """The mean node budget per step, with the steps per budget where there were several ("" for no DART steps)."""
    if "node_budget_mean" not in r:
        return ""
    text = _fmt(r["node_budget_mean"], ".1f")
    counts = r.get("node_budget_counts") or {}
    if len(counts) > 1:
        text += " (" + ", ".join(f"{b}: {c}" for b, c in counts.items()) + ")"
    return text


def plot_batch_results(results: dict, path: str | Path) -> None:
    """tokens/s against batch size, one line per method, one panel per data set (red x: output differs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(results["batches"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        sizes = results["batches"][ds]
        for name, label in results["methods"].items():
            points = [(int(b), rows[name]) for b, rows in sizes.items() if name in rows]
            if not points:
                continue
            xs = [b for b, _ in points]
            ax.plot(xs, [r["tokens_per_s"] for _, r in points], marker="o", label=label)
            bad = [(b, r["tokens_per_s"]) for b, r in points if not r["equal_to_plain"]]
            if bad:
                ax.scatter(*zip(*bad), marker="x", color="red", s=80, zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(b) for b in sizes], [str(b) for b in sizes])
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{ds} (red x: output differs from generate)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_results(results: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(results["datasets"])
    names = list(results["methods"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        values = [results["datasets"][ds][name]["tokens_per_s"] for ds in datasets]
        bars = ax1.bar([i + j * width for i in range(len(datasets))], values, width, label=results["methods"][name])
        for bar, ds in zip(bars, datasets):
            if not results["datasets"][ds][name]["equal_to_plain"]:
                bar.set_hatch("xx")
                bar.set_edgecolor("red")
    ax1.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(datasets))], datasets)
    ax1.set_ylabel("tokens / s")
    ax1.set_title("Throughput (hatched red: output differs from generate)")
    ax1.legend(fontsize=8)
    labels, bottoms = [], []
    tree = [(ds, n) for ds in datasets for n in names if "phase_ms" in results["datasets"][ds][n]]
    for ds, n in tree:
        labels.append(f"{ds}\n{n.replace('dart_tree_', 'tree ').replace('dart_compiled_', 'compiled ')}")
    bottoms = [0.0] * len(tree)
    for p in [p for p in ALL_PHASES if any(p in results["datasets"][ds][n]["phase_ms"] for ds, n in tree)]:
        values = [results["datasets"][ds][n]["phase_ms"].get(p, 0.0) for ds, n in tree]
        ax2.bar(range(len(tree)), values, bottom=bottoms, label=PHASE_LABELS[p])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax2.set_xticks(range(len(tree)), labels, fontsize=8)
    ax2.set_ylabel("ms per DART step")
    ax2.set_title("DART tree step breakdown")
    if tree:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["md"].write_text(markdown_report(results))
    (plot_batch_results if "batches" in results else plot_results)(results, paths["png"])
    return paths


# ---------------------------------------------------------------------------------------------------- synthetic (GPU)
QWEN3_8B_SHAPE = dict(
    hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    tie_word_embeddings=False, rms_norm_eps=1e-6,
)


def synthetic_target(shape: dict, device: str | torch.device, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """A random Qwen3 model of `shape`, built directly on `device` (no weights are loaded or downloaded)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def run_synthetic(
    shape: dict = QWEN3_8B_SHAPE,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    budgets: tuple[int, ...] = (7, 15, 31, 63, 95),
    prompt_len: int = 512,
    new_tokens: int = 48,
    draft_length: int = 7,
    draft_vocab_size: int | None = 32000,
    cost_sizes: tuple[int, ...] | None = None,
    repeats: int = 5,
    out_dir: str | Path | None = None,
    progress: bool = True,
    compiled: bool = False,
    compile_backend: str = "inductor",
) -> dict:
    """Verify cost by tree size, and the per-phase time of real DART steps (random head, random n-gram) by budget.

    The head has the reference Qwen3-8B head's layout (draft length 7, a 32000-token draft vocabulary, norm applied
    twice), with random weights: it accepts about nothing, so steps are timed at about one token each.

    Correct by construction: the cost curve is `calibrate.measure_verify_cost` and the steps are the real tree
    loop (`generate(..., assistant_model=head, dart_timing=True)`); nothing here re-implements decoding.

    `compiled`: also plain and DART `generate` on a static cache with `torch.compile` (`compile_backend`), what a GPU
    user runs: `results["compiled"]` (`_synthetic_compiled`).
    """
    from .calibrate import DEFAULT_SIZES, measure_verify_cost
    from ..core.modeling import DartHead
    from ..core.ngram import NGramModel

    device = torch.device(device)
    t0 = time.perf_counter()
    target = synthetic_target(shape, device, dtype, attn_implementation)
    build_s = time.perf_counter() - t0
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (1, prompt_len), generator=g).to(device)
    torch.manual_seed(0)
    dv = None if draft_vocab_size is None else min(draft_vocab_size, vocab)
    with torch.device(device):
        head = DartHead.from_target(target, draft_length=draft_length, draft_vocab_size=dv, final_norm_repeats=2)
    head.eval()
    if dv is not None:
        head.set_draft_vocab(torch.randperm(vocab, generator=g)[:dv])
    seqs = torch.randint(vocab, (64, 256), generator=g).tolist()
    head.ngram = NGramModel.build(seqs, order=3, vocab_size=vocab, progress=False)

    cost = measure_verify_cost(target, sizes=cost_sizes or DEFAULT_SIZES, past_len=prompt_len, repeats=repeats,
                               warmup=2)
    gen = dict(do_sample=False, max_new_tokens=new_tokens, attention_mask=torch.ones_like(ids))
    target.generate(ids, **{**gen, "max_new_tokens": 8})  # warm-up
    _sync(device)
    start = time.perf_counter()
    plain_out = target.generate(ids, **gen)
    _sync(device)
    plain_s = time.perf_counter() - start
    plain_ms = 1e3 * plain_s / (plain_out.shape[1] - ids.shape[1])

    rows = []
    for budget in tqdm(budgets, desc="synthetic budgets", disable=not progress):
        run = dict(assistant_model=head, dart_node_budget=budget, **gen)
        target.generate(ids, **{**run, "max_new_tokens": 8})  # warm-up at this tree size
        _sync(device)
        start = time.perf_counter()
        out = target.generate(ids, **run)  # untimed phases: the real wall time of a step
        _sync(device)
        wall = time.perf_counter() - start
        steps_plain = head.stats["steps"]
        target.generate(ids, dart_timing=True, **run)  # synchronised phases: where the time goes
        stats = head.stats
        phase_ms = {p: 1e3 * stats["time"].get(p, 0.0) / max(stats["steps"], 1) for p in PHASES}
        step_ms = sum(phase_ms.values())
        wall_step_ms = 1e3 * (wall - stats["time"].get("prefill", 0.0)) / max(steps_plain, 1)
        overhead = phase_ms["draft"] + phase_ms["tree"] + phase_ms["accept"]
        rows.append({
            "node_budget": budget,
            "tree_tokens": budget + 1,
            "step_ms_wall": wall_step_ms,
            "step_ms_timed": step_ms,
            "phase_ms": phase_ms,
            "overhead_share": overhead / step_ms if step_ms else float("nan"),
            "head_and_tree_share": (phase_ms["draft"] + phase_ms["tree"]) / step_ms if step_ms else float("nan"),
            # the accepted length (tokens per step) at which DART only matches plain decoding
            "break_even_accepted_length": wall_step_ms / plain_ms,
            "projected_speedup_at_3.7": 3.7 * plain_ms / wall_step_ms,
            "output_equal_to_plain": bool(torch.equal(out, plain_out)),
        })
    results = {
        "meta": {**_environment(target), "shape": shape, "build_seconds": build_s, "prompt_len": prompt_len,
                 "new_tokens": new_tokens, "draft_length": draft_length, "draft_vocab_size": dv},
        "verify_cost_ms": {str(n): 1e3 * s for n, s in zip(cost.sizes, cost.seconds)},
        "plain_ms_per_token": plain_ms,
        "budgets": rows,
    }
    if compiled:
        results["compiled"] = _synthetic_compiled(target, head, ids, gen, budgets, plain_out, compile_backend,
                                                  progress)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "synthetic.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "synthetic.md").write_text(synthetic_markdown(results))
    return results


def _timed_generate(target, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, float]:
    """(output, wall seconds) of one `generate` call, with device syncs around it."""
    _sync(ids.device)
    start = time.perf_counter()
    out = target.generate(ids, **kwargs)
    _sync(ids.device)
    return out, time.perf_counter() - start


class TokenClock:
    """A `generate` streamer that notes when each put reached the host (the prompt, then the new tokens one step at a
    time): the decoding steps' time without the prefill."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None

    def step_seconds(self) -> float:
        """Mean seconds per decoding step: from the prefill's token to the last new token."""
        new = self.times[1:]
        return (new[-1] - new[0]) / max(len(new) - 1, 1)


def _synthetic_compiled(target, head, ids: torch.Tensor, gen: dict, budgets, plain_out: torch.Tensor, backend: str,
                        progress: bool) -> dict:
    """Plain `generate` and DART per budget on a static cache with `torch.compile` (`compile_config`). Every compiled
    call is first made once untimed (it compiles; its seconds are reported). The plain step is timed between the
    first and the last new token reaching the host (`TokenClock`): its decoding steps without the (eager) prefill,
    as DART's step leaves the prefill out."""
    static = {**gen, "cache_implementation": "static", "compile_config": compile_config(ids.device, backend)}
    _, plain_compile_s = _timed_generate(target, ids, **static)
    clock = TokenClock()
    out, seconds = _timed_generate(target, ids, streamer=clock, **static)
    plain_step_ms = 1e3 * clock.step_seconds()
    rows = [_synthetic_compiled_row(target, head, ids, {**static, "assistant_model": head, "dart_node_budget": b},
                                    plain_step_ms, plain_out, split=b == max(budgets))
            for b in tqdm(budgets, desc="synthetic compiled budgets", disable=not progress)]
    return {"backend": backend, "plain_step_ms": plain_step_ms, "plain_ms_per_token": 1e3 * seconds
            / (out.shape[1] - ids.shape[1]), "plain_first_call_seconds": plain_compile_s,
            "plain_equal_to_eager": bool(torch.equal(out, plain_out)), "budgets": rows}


def _synthetic_compiled_row(target, head, ids: torch.Tensor, run: dict, plain_step_ms: float,
                            plain_out: torch.Tensor, split: bool) -> dict:
    """One budget's compiled DART step: its wall time (the captured greedy step), then, with `split` (the largest
    budget only: three more graphs to compile, minutes each on a large target), with `dart_timing=True` (its parts
    captured and timed one by one: draft = head forward + tree search, verify, accept). Each variant's first call
    compiles, untimed."""
    _, first_s = _timed_generate(target, ids, **run)
    out, wall = _timed_generate(target, ids, **run)
    stats = head.stats
    step_ms = 1e3 * (wall - stats.time.get("prefill", 0.0)) / max(stats.steps, 1)
    phase_ms, timing_first_s = {p: float("nan") for p in ("draft", "verify", "accept")}, float("nan")
    if split:
        _, timing_first_s = _timed_generate(target, ids, dart_timing=True, **run)
        _timed_generate(target, ids, dart_timing=True, **run)
        timed = head.stats
        phase_ms = {p: 1e3 * timed.time.get(p, 0.0) / max(timed.steps, 1) for p in ("draft", "verify", "accept")}
    total = sum(phase_ms.values())
    return {
        "node_budget": run["dart_node_budget"],
        "compiled": stats.compiled,
        "static_reason": stats.static_reason,
        "step_ms": step_ms,
        "step_over_plain_compiled_step": step_ms / plain_step_ms,
        "phase_ms": phase_ms,
        "head_and_tree_share": phase_ms["draft"] / total if total else float("nan"),
        "first_call_seconds": first_s,
        "timing_first_call_seconds": timing_first_s,
        "output_equal_to_plain": bool(torch.equal(out, plain_out)),
    }


def synthetic_markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# dart-hf bench --synthetic", "",
        f"Random target of shape {meta['shape']} in {meta['dtype']} ({meta['attn_implementation']}) on "
        f"{meta['device']}; prompt {meta['prompt_len']} tokens; {meta['new_tokens']} new tokens; torch "
        f"{meta['torch']}, transformers {meta['transformers']}. Plain decoding: "
        f"{results['plain_ms_per_token']:.2f} ms per token.", "",
        "## Verify cost by tree size", "", "| tree tokens | ms | x one token |", "|---:|---:|---:|",
    ]
    one = results["verify_cost_ms"].get("1")
    for n, ms in results["verify_cost_ms"].items():
        lines.append(f"| {n} | {ms:.2f} | {_fmt(ms / one if one else None)} |")
    lines += ["", "## DART step by node budget (random head: about one token accepted per step)", "",
              "| budget | step ms (wall) | " + " | ".join(PHASE_LABELS[p] + " ms" for p in PHASES)
              + " | head + tree share | overhead share | break-even accepted length | speedup at 3.7 |",
              "|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---:|---:|"]
    for r in results["budgets"]:
        phases = " | ".join(f"{r['phase_ms'][p]:.2f}" for p in PHASES)
        lines.append(f"| {r['node_budget']} | {r['step_ms_wall']:.2f} | {phases} | "
                     f"{100 * r['head_and_tree_share']:.0f}% | {100 * r['overhead_share']:.0f}% | "
                     f"{r['break_even_accepted_length']:.2f} | {r['projected_speedup_at_3.7']:.2f}x |")
    equal = all(r["output_equal_to_plain"] for r in results["budgets"])
    lines += ["", f"Outputs equal to plain generate at every budget: {'yes' if equal else 'no'} "
              "(random bf16 weights give near-tied logits; batched and one-token kernels may round differently).",
              ""]
    return "\n".join(lines + _synthetic_compiled_lines(results.get("compiled")))


def _synthetic_compiled_lines(c: dict | None) -> list[str]:
    """The static cache + torch.compile section of the synthetic report."""
    if c is None:
        return []
    lines = [f"## Static cache + torch.compile ({c['backend']})", "",
             f"Plain `generate`: {c['plain_step_ms']:.2f} ms per decoding step ({c['plain_ms_per_token']:.2f} ms per "
             f"token with the prefill; first call {c['plain_first_call_seconds']:.1f} s; output equal to plain eager: "
             f"{'yes' if c['plain_equal_to_eager'] else 'no'}).", ""]
    by_budget = {r["node_budget"]: r for r in c["budgets"]}
    headline = by_budget.get(60) or by_budget[max(by_budget)]
    lines += [f"**{headline['node_budget']}-node DART compiled step / plain compiled step: "
              f"{headline['step_over_plain_compiled_step']:.2f}** (the accepted length at which compiled DART only "
              "matches compiled plain decoding).", "",
              "| budget | step ms | / plain compiled step | draft (head + tree) ms | verify ms | accept ms | "
              "head + tree share | first call s | equal to plain |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in c["budgets"]:
        ph = r["phase_ms"]
        equal = "yes" if r["output_equal_to_plain"] else "no"
        note = "" if r["compiled"] else f" (not compiled: {r['static_reason']})"
        lines.append(f"| {r['node_budget']}{note} | {r['step_ms']:.2f} | {r['step_over_plain_compiled_step']:.2f} | "
                     f"{_fmt(ph['draft'])} | {_fmt(ph['verify'])} | {_fmt(ph['accept'])} | "
                     f"{_fmt(100 * r['head_and_tree_share'], '.0f')}% | {r['first_call_seconds']:.1f} | {equal} |")
    return lines + ["", "Step ms: the captured greedy step's wall time per step (prefill excluded); the split comes "
                    "from a second run with `dart_timing=True` at the largest budget (the step's parts captured and "
                    "timed one by one: three graphs, so their sum differs from the one-graph step). First call s: the "
                    "untimed call that compiles.", ""]


# ---------------------------------------------------------------------------------------------------- CLI
def main(args: argparse.Namespace) -> int:
    if args.synthetic:
        if not torch.cuda.is_available():
            print("dart-hf bench --synthetic needs a CUDA GPU: it builds a random Qwen3-8B-shaped target "
                  "(~16 GB in bf16) and times it there. No GPU is visible (torch.cuda.is_available() is False); "
                  "run the real-model bench without --synthetic on CPU.", file=sys.stderr)
            return 2
        budgets = {"budgets": tuple(args.budget)} if args.budget else {}
        results = run_synthetic(attn_implementation=args.attn, out_dir=args.out, new_tokens=args.max_new_tokens,
                                compiled=args.compiled, compile_backend=args.compile_backend, **budgets)
        print(synthetic_markdown(results))
        return 0
    if args.n < 1:
        print(f"dart-hf bench: error: --n must be at least 1 (prompts per data set), got {args.n}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    from .assets import eval_prompts
    from .demo import load_target_and_head

    hf_logging.set_verbosity_error()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under torchrun: a tensor-parallel target
    try:
        if distributed:
            target, tokenizer, head = load_tensor_parallel(args.target, args.head, getattr(torch, args.dtype),
                                                           attn_implementation=args.attn)
        else:
            target, tokenizer, head = load_target_and_head(args.target, args.head, getattr(torch, args.dtype),
                                                           attn_implementation=args.attn)
    except (OSError, ValueError) as err:  # unknown target, missing or broken head folder, head for another model
        print(f"dart-hf bench: error: {err}", file=sys.stderr)
        return 2
    ranks = tensor_parallel_ranks(target)
    report = ranks is None or ranks[0] == 0
    head_path = args.head if args.head is not None else str(shipped_head())
    batch_sizes = getattr(args, "batch_size", None) or [1]
    if min(batch_sizes) < 1:
        print(f"dart-hf bench: error: --batch-size takes sizes >= 1, got {batch_sizes}", file=sys.stderr)
        return 2
    n = max(args.n, *batch_sizes)  # every batch size decodes the same prompts, the largest at least one full batch
    prompts = {ds: eval_prompts(tokenizer, ds, n) for ds in args.datasets}
    methods = selected_methods(standard_methods(fixed_budget=args.budget or [DEFAULT_BUDGET], compiled=args.compiled,
                                                compile_backend=args.compile_backend), args.methods)
    if args.runs < 1 or (args.load is not None and args.load < 0):
        print("dart-hf bench: error: --runs must be >= 1 and --load >= 0", file=sys.stderr)
        return 2
    meta = {"head": head_path, "target_name": args.target}
    results = run_bench(target, head, prompts, max_new_tokens=args.max_new_tokens, methods=methods,
                        out_dir=args.out, warmup=not args.no_warmup, meta=meta, runs=args.runs,
                        load=args.load or 0, batch_sizes=None if batch_sizes == [1] else batch_sizes,
                        calibrate=not args.no_calibrate, profile=args.profile)
    if not report:
        return 0 if results["all_equal"] else MISMATCH_EXIT
    print(markdown_report(results))
    print(f"\nwrote {Path(args.out) / 'results.json'}, results.md, results.png")
    return exit_status(results)


def selected_methods(methods: list[Method], names: list[str] | None) -> list[Method]:
    """The methods named (all for None), plain (the reference) and the baselines of those named."""
    if names is None:
        return methods
    keep = {"plain", *names}
    keep |= {m.baseline for m in methods if m.name in keep and m.baseline}
    return [m for m in methods if m.name in keep]


def load_tensor_parallel(target_name: str, head_path, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """(target, tokenizer, head placed for it) on this rank of a `torchrun` launch: the target loaded
    tensor-parallel over every rank (`distributed_config=DistributedConfig(tp_plan="auto")`, the same as
    `tp_plan="auto"`; gloo on CPU, nccl on CUDA), the head from its folder on every rank (the same weights
    everywhere, checked on every call). Starts the process group when the launcher has not."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    from ..core.modeling import DartHead
    from ..core.target import check_head_matches_target, prepare_head
    from .assets import target_folder

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    head = DartHead.from_pretrained(head_path if head_path is not None else shipped_head()).eval()
    folder = target_folder(target_name)  # a known target is converted once (a file lock: one rank converts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation,
                                                  distributed_config=DistributedConfig(tp_plan="auto")).eval()
    check_head_matches_target(head, target)
    return target, tokenizer, prepare_head(head, target)


def exit_status(results: dict) -> int:
    """0 when every output equals plain generate, MISMATCH_EXIT (3) otherwise (and says so on stderr)."""
    if results["all_equal"]:
        return 0
    print("dart-hf bench: OUTPUT MISMATCH - "
          + "; ".join(f"{m['method']} on {m['dataset']} prompt {m['prompt']}" for m in results["mismatches"]),
          file=sys.stderr)
    return MISMATCH_EXIT


__all__ = [
    "Method", "compile_config", "compiled_methods", "exit_status", "left_pad", "load_tensor_parallel", "main",
    "markdown_report", "new_token_counts", "profile_methods", "run_bench", "run_synthetic", "selected_methods",
    "standard_methods", "tensor_parallel_ranks",
]
