"""The methods `dart-hf bench` times, each one way to call `generate`: plain, prompt lookup, DART chain, DART tree at
fixed budgets and cost-aware, and with `--compiled` plain and DART on a static cache with `torch.compile`
(`compile_config`). Kept apart from the timing (`bench_timing`) and the reports (`bench_report`): a method is a
`Method` in the list `standard_methods` returns, and adding one touches only this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Method:
    """One way to generate. `run(target, head, ids, **generate_kwargs)` returns the output ids [1, T];
    `tree`: a DART tree method, whose `head.stats` carry per-phase times; `compiled`: it decodes on a static cache
    with `torch.compile` (its first calls compile: warmed up on every prompt, `bench_timing._compile_warmup`, and
    never run with a forward hook, which dynamo would trace); `baseline`: another method whose tokens/s this one is
    also compared with (the compiled DART rows: compiled plain `generate`, what a GPU user would otherwise run)."""

    name: str
    label: str
    run: Callable
    tree: bool = False
    one_row_only: str | None = None  # why the method cannot decode a batch (None: it can); skipped at batch size > 1
    compiled: bool = False
    baseline: str | None = None


DEFAULT_BUDGET = 60


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
    same with the head at node budget B: `core.static_step`); one row or a left-padded greedy batch each."""
    def plain(t, h, ids, **kw):
        return t.generate(ids, cache_implementation="static", compile_config=compile_config(t.device, backend), **kw)

    def dart(budget: int) -> Method:
        return Method(f"dart_compiled_{budget}", f"DART, static cache + compile, budget {budget}",
                      lambda t, h, ids, **kw: plain(t, h, ids, assistant_model=h, dart_node_budget=budget, **kw),
                      tree=True, compiled=True, baseline="plain_compiled")

    return [Method("plain_compiled", "generate, static cache + compile", plain, compiled=True),
            *(dart(b) for b in budgets)]


__all__ = ["DEFAULT_BUDGET", "Method", "compile_config", "compiled_methods", "standard_methods"]
