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
    dart_compiled_<B>   the same with assistant_model=head, dart_node_budget=B (`core.step`, a static cache), per --budget
    dart_compiled_auto  the same with dart_node_budget="auto" (per step, the size rule on the shape's held ladder)

reported also as a speed-up over plain_compiled; each is first called once on every prompt, untimed, to compile (those
seconds are reported apart). `--profile` adds top-level aten ops and host syncs per decoding step and per new token
of every method, on one prompt per data set (`bench_profile.profile_methods`).

`--temperature T` (with `--top-p`, `--top-k`, `--min-p`, or `--qwen3-sampling` for Qwen3's shipped 0.6 / 0.95 / 20)
samples instead: every method (and the batched, compiled, profiled and synthetic runs) gets `do_sample=True` and the
same settings (`bench_methods.sampling_settings`; a setting left out is off, not the target's generation config's),
and every call is seeded with `torch.manual_seed` right before it, the same seed for every method on a prompt
(`bench_methods.SEEDS_HOW`). Sampled texts differ by method (each consumes the random stream its own way), so outputs
are not compared: "equal to generate" reads "n/a (sampling)", `all_equal` is None and the exit status is 0; the
reports state the settings (`results["meta"]["sampling"]`). Without `--temperature` the bench is greedy as before.

Reported per data set and method: tokens/s, speedup over plain, accepted length (new
tokens per target forward, counted with a forward hook on the target; plain = 1), whether every output equals plain
generate, and for the tree methods where a step's time goes (head forward, tree search, target verify, accept +
cache bookkeeping).
Prompts are interleaved (each prompt runs every method before the next prompt) so slow drifts in machine load hit
all methods alike; `runs` repeats the whole interleaved pass and reports each run's speedup (median and spread).
`load` starts that many busy-loop processes (one per core: `--load`) beside the methods for the whole bench, so a
speedup on a busy machine is a command anyone can rerun. Nothing is measured before the timed runs but their
warm-up: the cost-aware size rule times its own steps as it decodes (`dart_hf.core.budget`). Writes results.json,
results.md and results.png; the exit status is 3 when any output differs.

`--hindsight` runs the default ("auto") against plain `generate` and every fixed tree size of `--budget` (default: the
ladder's sizes up to 8 nodes), interleaved, and reports the default beside the best of them in hindsight
(`results["hindsight"]`), greedy or sampled, one row or batches, eager or `--compiled`.

`--batch-size B [B ...]` (any B > 1) runs the batched bench instead: for each B the prompts of each data set go in
left-padded batches of B (each data set gets at least max(B) prompts, the same ones for every B), and plain batched
`generate` and the DART tree methods run batch by batch, the batch sizes taking turns;
every row is compared with plain's. Prompt lookup and chain mode decode one row at a time in transformers, so they run
at B = 1 only (the report says so); the static-cache (compiled) methods decode greedy batches too (every batch is first
run once, untimed, to compile). Reported per data set and B:
tokens/s (each row's new tokens up to its first EOS, over the wall time of the batch's calls), the ratio to plain at
the same B, and the DART methods' tree sizes per row (`results["batches"]`, results.md, and results.png: tokens/s
against B, a panel per data set).

Under `torchrun` (`python -m torch.distributed.run --nproc-per-node N -m dart_hf_cli bench ...`, or `torchrun
$(which dart-hf) bench ...`) the target is loaded tensor-parallel (`tp_plan="auto"`: gloo on CPU, nccl on GPUs),
every rank runs the same calls in lockstep and only rank 0 prints and writes the reports (its wall times: each step
waits for every rank). The cost-aware methods are left out there (a tensor-parallel target needs a fixed node budget,
`docs/TENSOR_PARALLEL.md`), and a cost-aware head gets the first `--budget` for chain mode.

`--synthetic` instead measures, on a CUDA GPU, a random target of Qwen3-8B's shape in bf16: the verify cost by tree
size and the head + tree-search overhead as a share of a DART step, and with `--compiled` the same on a static cache
with torch.compile against compiled plain decoding, with `--batch-size B [B ...]` on a batch of B random prompts per
B: time per row token, every row compared with plain's (`examples/gpu_check.sh` runs it).

This module is the command: `main` (arguments to a run), `selected_methods`, `run_bench` (the timed runs, the
profile and the reports) and the exit status. What it runs lives beside it, a module per
concern so that each stays readable alone: `bench_methods` (the methods), `bench_timing` (the timed runs and their
tokens/s, speed-ups and step breakdowns), `bench_report` (results.md, results.png, results.json), `bench_profile`
(`--profile`) and `bench_synthetic` (`--synthetic`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ..core.distributed import tensor_parallel_group
from .assets import shipped_head
from .bench_methods import (DEFAULT_BUDGET, SEEDS_HOW, Method, sampling_kwargs, sampling_settings,
                            standard_methods)
from .bench_profile import profile_methods
from .bench_report import markdown_report, write_reports
from .bench_synthetic import run_synthetic, synthetic_batch_sizes, synthetic_markdown
from .bench_timing import run_batched, run_rows

MISMATCH_EXIT = 3


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
    profile: bool = False,
    sampling: dict | None = None,
) -> dict:
    """Run every method on every prompt, `runs` times; returns (and, with `out_dir`, writes) the results.

    `prompts` maps a data set name to `[1, T]` id tensors. The first method must be "plain": the reference.
    `load`: busy-loop processes running beside the methods (`bench_timing.CompetingLoad`), 0 for none.
    `batch_sizes`: None or [1] for the single-row bench; otherwise the batched bench (`bench_timing.run_batched`): for
    each batch size B the prompts go in left-padded batches of B, and the results are per data set and batch size
    (`results["batches"]`).
    Compiled methods (`Method.compiled`) are first called once on every prompt, untimed, whether or not `warmup`:
    that compiles every graph the timed calls run; its seconds are `results["compile_warmup"]`.
    `profile`: afterwards, each method once more on the first prompt of each data set, untimed, counting aten ops
    and host syncs (`bench_profile.profile_methods`, `results["profile"]`).
    `sampling`: None for greedy (outputs compared with plain's), or `bench_methods.sampling_settings`: every method
    samples with them, each call seeded right before it (the same seed for every method on a prompt), outputs not
    compared (`all_equal` None); `results["meta"]["sampling"]` states the settings and the seeds.
    A tensor-parallel target (every rank calls this with the same arguments): only rank 0 shows progress, runs the
    competing load and writes `out_dir`; every rank returns its own results (rank 0's are the ones to report).
    """
    batched = batch_sizes is not None and list(batch_sizes) != [1]
    if batched and (not batch_sizes or min(batch_sizes) < 1):
        raise ValueError(f"batch sizes must be >= 1, got {batch_sizes}")
    methods = methods if methods is not None else standard_methods()
    if not methods or methods[0].name != "plain":
        raise ValueError("the first bench method must be 'plain' (the reference outputs are compared with)")
    ranks = tensor_parallel_ranks(target)
    if ranks is not None:
        meta = {**(meta or {}), "tensor_parallel": ranks[1]}
        if ranks[0] != 0:  # rank 0 reports; the others run the same calls in lockstep
            progress, out_dir, load = False, None, 0
    gen = dict(**sampling_kwargs(sampling), max_new_tokens=max_new_tokens)
    if sampling is not None:  # greedy meta stays as it was: no key
        meta = {**(meta or {}), "sampling": {**sampling, "seeds": SEEDS_HOW}}
    if getattr(target.generation_config, "pad_token_id", None) is None:
        eos = target.generation_config.eos_token_id
        gen["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    if batched:
        results = run_batched(target, head, prompts, methods, gen, sorted(set(batch_sizes)), warmup, progress,
                              meta, runs, load)
    else:
        results = run_rows(target, head, prompts, methods, gen, warmup, progress, meta, runs, load)
    if profile:  # the methods that ran (warmed up: nothing compiles under the profiler)
        ran = [m for m in methods if not batched or 1 in batch_sizes or m.one_row_only is None]
        results["profile"] = profile_methods(target, head, prompts, ran, gen)
    results["hindsight"] = hindsight(results)
    if out_dir is not None:
        write_reports(results, out_dir)
    return results


HINDSIGHT_BUDGETS = (1, 2, 3, 5, 8)  # `--hindsight` without --budget: the ladder's sizes a CPU step can afford


def hindsight(results: dict) -> list[dict]:
    """The default size rule against the best fixed choice in hindsight, per data set (and batch size) and for eager
    and compiled decoding where both ran: the default's speed-up over plain (median over runs), the best of plain
    decoding (1.0) and every fixed tree size that ran, and their ratio. Empty where the default did not run."""
    tables = results.get("batches") or {ds: {"1": rows} for ds, rows in results["datasets"].items()}
    out = []
    for ds, sizes in tables.items():
        for rows, methods in sizes.items():
            for default, prefix, key in (("dart_tree_auto", "dart_tree_", "speedup"),
                                         ("dart_compiled_auto", "dart_compiled_", "speedup_vs_baseline")):
                if default not in methods or key not in methods[default]:
                    continue
                median = lambda r: r.get(f"{key}_median", r[key])  # noqa: E731
                fixed = {int(n[len(prefix):]): median(r) for n, r in methods.items()
                         if n.startswith(prefix) and n[len(prefix):].isdigit() and key in r}
                best = max([(0, 1.0), *fixed.items()], key=lambda kv: kv[1])
                out.append({"dataset": ds, "rows": int(rows), "compiled": prefix == "dart_compiled_",
                            "default": median(methods[default]), "fixed": dict(sorted(fixed.items())),
                            "best_budget": best[0], "best": best[1], "default_over_best": median(methods[default]) /
                            best[1]})
    return out


def tensor_parallel_ranks(target) -> tuple[int, int] | None:
    """(this rank, ranks) of a tensor-parallel target's group, None for a target in one process."""
    group = tensor_parallel_group(target)
    if group is None:
        return None
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------------- CLI
def main(args: argparse.Namespace) -> int:
    try:
        sampling = sampling_settings(args.temperature, args.top_p, args.top_k, args.min_p, args.qwen3_sampling)
    except ValueError as err:
        print(f"dart-hf bench: error: {err}", file=sys.stderr)
        return 2
    batch_sizes = getattr(args, "batch_size", None) or [1]
    if min(batch_sizes) < 1:
        print(f"dart-hf bench: error: --batch-size takes sizes >= 1, got {batch_sizes}", file=sys.stderr)
        return 2
    if args.synthetic:
        try:
            synthetic_batch_sizes(batch_sizes, args.compiled)
        except ValueError as err:
            print(f"dart-hf bench: error: --synthetic --batch-size: {err}", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("dart-hf bench --synthetic needs a CUDA GPU: it builds a random Qwen3-8B-shaped target "
                  "(~16 GB in bf16) and times it there. No GPU is visible (torch.cuda.is_available() is False); "
                  "run the real-model bench without --synthetic on CPU.", file=sys.stderr)
            return 2
        budgets = {"budgets": tuple(args.budget)} if args.budget else {}
        results = run_synthetic(attn_implementation=args.attn, out_dir=args.out, new_tokens=args.max_new_tokens,
                                compiled=args.compiled, compile_backend=args.compile_backend, sampling=sampling,
                                batch_sizes=tuple(batch_sizes), **budgets)
        print(synthetic_markdown(results))
        return 0
    if args.n < 1:
        print(f"dart-hf bench: error: --n must be at least 1 (prompts per data set), got {args.n}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    from .datasets import eval_prompts
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
    n = max(args.n, *batch_sizes)  # every batch size decodes the same prompts, the largest at least one full batch
    prompts = {ds: eval_prompts(tokenizer, ds, n) for ds in args.datasets}
    budgets = args.budget or (list(HINDSIGHT_BUDGETS) if args.hindsight else [DEFAULT_BUDGET])
    names = args.methods
    if args.hindsight:  # the default and every fixed size, eager or compiled
        prefix = "dart_compiled_" if args.compiled else "dart_tree_"
        names = [*(names or []), f"{prefix}auto", *(f"{prefix}{b}" for b in budgets)]
    methods = selected_methods(standard_methods(fixed_budget=budgets, compiled=args.compiled,
                                                compile_backend=args.compile_backend), names)
    if args.runs < 1 or (args.load is not None and args.load < 0):
        print("dart-hf bench: error: --runs must be >= 1 and --load >= 0", file=sys.stderr)
        return 2
    meta = {"head": head_path, "target_name": args.target}
    results = run_bench(target, head, prompts, max_new_tokens=args.max_new_tokens, methods=methods,
                        out_dir=args.out, warmup=not args.no_warmup, meta=meta, runs=args.runs,
                        load=args.load or 0, batch_sizes=None if batch_sizes == [1] else batch_sizes,
                        profile=args.profile, sampling=sampling)
    if not report:
        return 0 if results["all_equal"] is not False else MISMATCH_EXIT
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
    """0 when every output equals plain generate or outputs were not compared (sampling: `all_equal` is None),
    MISMATCH_EXIT (3) otherwise (and says so on stderr)."""
    if results["all_equal"] is not False:
        return 0
    print("dart-hf bench: OUTPUT MISMATCH - "
          + "; ".join(f"{m['method']} on {m['dataset']} prompt {m['prompt']}" for m in results["mismatches"]),
          file=sys.stderr)
    return MISMATCH_EXIT


__all__ = ["HINDSIGHT_BUDGETS", "MISMATCH_EXIT", "exit_status", "hindsight", "load_tensor_parallel", "main", "run_bench",
           "selected_methods", "tensor_parallel_ranks"]
