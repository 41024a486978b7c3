"""The methods `dart-hf bench` times, each one way to call `generate`: plain, prompt lookup, DART chain, DART tree at
fixed budgets and cost-aware, and with `--compiled` plain and DART on a static cache with `torch.compile`
(`compile_config`). Kept apart from the timing (`bench_timing`) and the reports (`bench_report`): a method is a
`Method` in the list `standard_methods` returns, and adding one touches only this module. How every method samples
(`--temperature` and the rest: `sampling_settings`, `sampling_kwargs`, `call_seed`) lives here too, so the
single-row, batched, profiled and synthetic benches all pass one method the same settings and seeds.
"""

from __future__ import annotations

import zlib
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
    """plain_compiled (`generate(ids, cache_implementation="static", compile_config=...)`), dart_compiled_<B> (the
    same with the head at node budget B: `core.step` on a static cache) and dart_compiled_auto (the size the call's shape
    holds and its ladder neighbours, per step: `core.budget.ladder_around`); one row or a left-padded batch each."""
    def plain(t, h, ids, **kw):
        return t.generate(ids, cache_implementation="static", compile_config=compile_config(t.device, backend), **kw)

    def dart(budget: int | str) -> Method:
        label = "cost-aware" if budget == "auto" else f"budget {budget}"
        return Method(f"dart_compiled_{budget}", f"DART, static cache + compile, {label}",
                      lambda t, h, ids, **kw: plain(t, h, ids, assistant_model=h, dart_node_budget=budget, **kw),
                      tree=True, compiled=True, baseline="plain_compiled")

    return [Method("plain_compiled", "generate, static cache + compile", plain, compiled=True),
            *(dart(b) for b in [*budgets, "auto"])]


# ---------------------------------------------------------------------------------------------------- sampling
# Qwen3's shipped generation_config.json (thinking mode): what a Qwen3 user samples with (`--qwen3-sampling`)
QWEN3_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
# what a setting left out is (passed explicitly, so a run's sampling never depends on the target's generation config,
# and the report states every setting the methods used): transformers adds no warper for any of these values
SAMPLING_OFF = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None}
SEEDS_HOW = ("torch.manual_seed(crc32('<data set>/<prompt>')) right before every call of every method on that prompt "
             "(batches: crc32('<data set>/b<batch size>/<batch>'); untimed warm-up and compile calls: "
             "crc32('warm-up')), so every method decodes a prompt from the same seed")


def sampling_settings(temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                      min_p: float | None = None, qwen3: bool = False) -> dict | None:
    """The sampling settings of a bench run, {temperature, top_p, top_k, min_p}, or None for greedy decoding (no
    temperature and not `qwen3`: the bench as it always ran). `qwen3` starts from `QWEN3_SAMPLING`; any value given
    replaces the shortcut's; what neither gives is off (`SAMPLING_OFF`). Raises ValueError for a top-p, top-k or
    min-p without a temperature (it would be silently ignored by greedy `generate`) and for out-of-range values."""
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    if temperature is None and not qwen3:
        stray = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
        if stray:
            raise ValueError(f"{', '.join(stray)} only apply when sampling: add --temperature T or --qwen3-sampling")
        return None
    settings = {**SAMPLING_OFF, **(QWEN3_SAMPLING if qwen3 else {}),
                **{k: v for k, v in given.items() if v is not None}}
    if not settings["temperature"] > 0:
        raise ValueError(f"--temperature must be > 0 (greedy: leave it out), got {settings['temperature']}")
    if not 0 < settings["top_p"] <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {settings['top_p']}")
    if settings["top_k"] < 0:
        raise ValueError(f"--top-k must be >= 0 (0: off), got {settings['top_k']}")
    if settings["min_p"] is not None and not 0 <= settings["min_p"] <= 1:
        raise ValueError(f"--min-p must be in [0, 1], got {settings['min_p']}")
    return settings


def sampling_kwargs(sampling: dict | None) -> dict:
    """The `generate` kwargs every method of a run gets for `sampling` (`sampling_settings`): greedy for None."""
    return {"do_sample": False} if sampling is None else {"do_sample": True, **sampling}


def sampling_text(sampling: dict) -> str:
    """The settings as the reports state them, e.g. "temperature 0.6, top-p 0.95, top-k 20, min-p off"."""
    def show(key: str) -> str:
        value = sampling.get(key)
        return "off" if value is None or value == SAMPLING_OFF[key] and key != "temperature" else f"{value:g}"

    return ", ".join(f"{k.replace('_', '-')} {show(k)}" for k in ("temperature", "top_p", "top_k", "min_p"))


def call_seed(*key) -> int:
    """The torch seed of the calls on one prompt (or batch) `key`, e.g. ("humaneval", 3): a CRC of the key, stable
    across processes and machines (Python's `hash` of a string is not), the same for every method and every run."""
    return zlib.crc32("/".join(map(str, key)).encode())


def seed_call(gen: dict, *key) -> None:
    """Seed torch for the next call when `gen` samples (`call_seed(*key)`); nothing when greedy, so a greedy bench
    leaves torch's RNG as it always did."""
    if gen.get("do_sample"):
        torch.manual_seed(call_seed(*key))


__all__ = ["DEFAULT_BUDGET", "QWEN3_SAMPLING", "SAMPLING_OFF", "SEEDS_HOW", "Method", "call_seed", "compile_config",
           "compiled_methods", "sampling_kwargs", "sampling_settings", "sampling_text", "seed_call",
           "standard_methods"]
