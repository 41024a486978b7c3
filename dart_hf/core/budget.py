"""Cost-aware node budget: verify as many draft nodes per step as pays on THIS target and device.

A DART step costs t_draft + t_tree + t_verify(B + 1) + t_accept and yields 1 + (accepted draft tokens) tokens.
On a GPU, t_verify is nearly flat in the tree size up to some knee; on a CPU it is not (SmolLM2-135M fp32:
2 tokens 32 ms, 64 tokens 178 ms on 2 cores), so the budget that maximises tokens per second depends on the device.

Three parts:

1. `verify_cost(target)`: the target's verify time by number of tree tokens N, measured once (one forward over N
   tree tokens with a tree mask after a KV cache of a realistic length; median of a few repeats after warm-up)
   and cached on disk in `$DART_HF_CACHE/cost/` (default `~/.cache/dart_hf/cost/`), keyed by model name and
   shape, device, dtype, attention implementation (and CPU thread count).
2. Counterfactual acceptance: the tree of budget B' < B is exactly the top-B' nodes (by score) of the budget-B
   tree, closed under ancestors because scores fall along every path. So if the accepted path's nodes have
   score ranks r_1 < r_2 < ... (rank 0 = best non-root node), budget B' would have accepted
   #{i : r_i < B'} draft tokens (exact for greedy; an estimate under sampling, where removing siblings changes
   the order in which children are tried). One verified tree thus gives the accepted length of every B' <= B.
3. `BudgetController`: running (exponentially discounted) E[accepted | B'] for every B', an online estimate of
   the per-step overhead (head + tree + bookkeeping, measured as step time minus the verify curve), and the
   choice argmax_B (1 + E[accepted | B]) / (overhead + t_verify(B + 1)). It starts at the largest candidate for a
   few steps (one such tree informs every smaller budget), then every `revisit_every` steps verifies a tree about
   twice the current choice, so the statistics just above the choice stay fresh without paying for the largest
   tree again (on a CPU a 96-node verify costs about four small steps).

The decoding loop (`dart_hf.core.loop.dart_decode`) uses a controller when the head's `config.node_budget` is
None or when `generate(..., dart_node_budget="auto")`; controllers persist per (head, target, prompt lookup on/off)
across calls.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from .cpu_linear import few_row_linears
from .tree import DraftTree, ancestor_mask
from .verify import verify_tree

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96)
DEFAULT_PAST_LEN = 256
COST_VERSION = 4  # 2: through dart_hf.core.cpu_linear as dart_decode runs it; 3: interleaved rounds; 4: no smoothing
_MEMO: dict[str, "VerifyCost"] = {}
_CONTROLLERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------------------------------- verify cost
@dataclass
class VerifyCost:
    """Seconds of one target verify forward by number of tree tokens N (root included), piecewise linear between
    the measured sizes and extrapolated along the last segment."""

    sizes: list[int]
    seconds: list[float]
    key: dict | None = None
    path: str | None = None

    def __call__(self, n) -> np.ndarray | float:
        xs, ys = np.asarray(self.sizes, dtype=float), np.asarray(self.seconds, dtype=float)
        n_arr = np.asarray(n, dtype=float)
        out = np.interp(n_arr, xs, ys)
        if len(xs) >= 2:
            slope_hi = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out = np.where(n_arr > xs[-1], ys[-1] + slope_hi * (n_arr - xs[-1]), out)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "key": self.key}


def cost_dir() -> Path:
    """`$DART_HF_CACHE/cost`, else `~/.cache/dart_hf/cost` (same root as dart_hf.tools.assets.cache_dir)."""
    return Path(os.environ.get("DART_HF_CACHE", "~/.cache/dart_hf")).expanduser() / "cost"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{platform.machine()}-{platform.processor() or 'cpu'}-{torch.get_num_threads()}threads"
    return device.type


def cost_key(target: PreTrainedModel, past_len: int = DEFAULT_PAST_LEN) -> dict:
    """What the verify cost depends on: the model's name and shape, the device, dtype and attention backend."""
    cfg = target.config.get_text_config()
    shape = {
        k: getattr(cfg, k, None)
        for k in (
            "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size",
        )
    }
    quant = getattr(target.config, "quantization_config", None)
    return {
        "name": str(getattr(target.config, "name_or_path", "") or cfg.model_type),
        **shape,
        "device": target.device.type,
        "device_name": _device_name(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "attn_implementation": target.config._attn_implementation or "eager",
        "quantization": None if quant is None else str(getattr(quant, "quant_method", quant)),
        "past_len": past_len,
        "version": COST_VERSION,
    }


def cost_file(key: dict) -> Path:
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(key["name"]).name or key["model_type"] or "model")[:60]
    return cost_dir() / f"{slug}-{key['device']}-{key['dtype']}-{digest}.json"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()


def synthetic_tree(n: int, device: torch.device, vocab_size: int, max_depth: int = 8, seed: int = 0) -> DraftTree:
    """A valid draft tree of n nodes shaped like a beam-search tree (wide near the root, depth <= max_depth)."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, math.ceil((n - 1) / max_depth))
    level = torch.cat([torch.zeros(1, dtype=torch.long), (torch.arange(1, n) - 1) // width + 1])
    # nodes of level L >= 1 are indices (L-1)*width+1 .. L*width; a node's parent is a random node one level up
    lo = torch.where(level <= 1, 0, (level - 2) * width + 1)
    count = torch.where(level <= 1, 1, width)
    parents = lo + (torch.rand(n, generator=g) * count).long()
    parents[0] = 0
    depths = level
    tokens = torch.randint(vocab_size, (n,), generator=g)
    tree = DraftTree(tokens, parents, depths, ancestor_mask(parents, int(depths.max())), -torch.arange(n).float())
    return tree.to(device)


@torch.no_grad()
def measure_verify_cost(
    target: PreTrainedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    past_len: int = DEFAULT_PAST_LEN,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> VerifyCost:
    """Median seconds of one verify forward over N tree tokens after `past_len` cached tokens, for N in `sizes`.

    The sizes are measured in interleaved rounds (every size once per round) rather than one size at a time: on a
    shared or throttled CPU a slow spell then inflates one sample of every size instead of every sample of one
    size, which the median discards; measured one by one, a 2-second spell once made 1 token look slower than 4.
    The medians are kept as measured, not smoothed into a nondecreasing curve: on CPU more tokens can really cost
    less (SmolLM2 fp32: 1 token 44 ms through MKL's matrix-vector path, 2 tokens 31 ms; 3 tokens 38 ms, 4 tokens
    35 ms), and pooling such points once made a 5-token verify look 3 ms dearer than 4 tokens instead of 8.
    """
    device = target.device
    cfg = target.config.get_text_config()
    max_pos = getattr(cfg, "max_position_embeddings", None) or 10**9
    sizes = sorted({int(n) for n in sizes if n >= 1})
    past_len = max(1, min(past_len, max_pos - max(sizes) - 1))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(cfg.vocab_size, (1, past_len), generator=g).to(device)
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    trees = [synthetic_tree(n, device, cfg.vocab_size, seed=seed + n) for n in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    with few_row_linears(target):  # as dart_decode verifies
        for round_ in range(warmup + repeats):
            for i, tree in enumerate(trees):
                _sync(device)
                start = time.perf_counter()
                verify_tree(target, tree, cache, past_len)
                _sync(device)
                if round_ >= warmup:
                    times[i].append(time.perf_counter() - start)
                cache.crop(past_len - cache.get_seq_length())  # negative: drop the tree entries again
    seconds = [statistics.median(t) for t in times]
    return VerifyCost(sizes=sizes, seconds=seconds, key={"past_len": past_len})


def verify_cost(
    target: PreTrainedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    past_len: int = DEFAULT_PAST_LEN,
    repeats: int = 5,
    refresh: bool = False,
    verbose: bool = True,
) -> VerifyCost:
    """The target's verify cost curve: from memory, else from the disk cache, else measured now and cached."""
    key = {**cost_key(target, past_len), "sizes": sorted({int(n) for n in sizes})}
    path = cost_file(key)
    memo_key = str(path)
    if not refresh and memo_key in _MEMO:
        return _MEMO[memo_key]
    if not refresh and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == json.loads(json.dumps(key, default=str)):
                cost = VerifyCost(data["sizes"], data["seconds"], key=key, path=str(path))
                _MEMO[memo_key] = cost
                return cost
        except (OSError, ValueError, KeyError):
            pass  # unreadable or stale: measure again
    if verbose:
        print(f"dart_hf: measuring verify cost of {key['name']} on {key['device_name']} "
              f"({key['dtype']}, {key['attn_implementation']}; sizes {key['sizes']}), cached in {path}",
              file=sys.stderr)
    measured = measure_verify_cost(target, sizes=sizes, past_len=past_len, repeats=repeats)
    cost = VerifyCost(measured.sizes, measured.seconds, key=key, path=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    record = {
        **cost.to_dict(),
        "measured_past_len": measured.key["past_len"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)
    _MEMO[memo_key] = cost
    return cost


# ---------------------------------------------------------------------------------------------------- acceptance
def path_ranks(tree: DraftTree, path: torch.Tensor) -> torch.Tensor:
    """Score rank (0 = best non-root node) of every accepted draft node (path without the root), ascending."""
    scores = tree.scores[1:]
    on_path = tree.scores[path[1:]]
    return (scores.unsqueeze(0) > on_path.unsqueeze(1)).sum(dim=1)


def accepted_for_budgets(ranks, budgets) -> np.ndarray:
    """Draft tokens each budget in `budgets` would have accepted: #{path ranks < budget} (greedy: exact)."""
    ranks = np.sort(np.asarray(ranks, dtype=np.int64).reshape(-1))
    return np.searchsorted(ranks, np.asarray(budgets, dtype=np.int64), side="left")


# ---------------------------------------------------------------------------------------------------- controller
def default_candidates(cost: VerifyCost, max_budget: int = 95) -> list[int]:
    """Budgets whose verify size (B + 1) was measured, up to `max_budget`."""
    cands = [n - 1 for n in cost.sizes if 2 <= n and n - 1 <= max_budget]
    return cands or [max(1, min(max_budget, 60))]


class BudgetController:
    """Chooses the node budget per step from a verify cost curve and running acceptance statistics.

    E[accepted | b] is a telescoping sum of increments: budget b accepts one more draft token than b - 1 exactly
    when the accepted path holds the node of rank b - 1. inc[b] / obs[b] estimates that probability from every step
    whose budget was >= b (discounted counts), so the estimate is monotone in b and each increment uses all steps
    that could observe it, even when steps ran at different budgets.

    overhead: moving average of (step wall time - scale * cost(B + 1)): head, tree search and bookkeeping, measured
    from whole steps, which stay exact on a GPU without per-phase syncs (each step ends with a host sync).
    scale: moving average of (verify time / cost(B + 1)) when the caller can time the verify exactly (CPU, or
    synchronised timing); it follows a machine that got busier or quieter since the curve was measured.
    """

    def __init__(
        self,
        cost: VerifyCost,
        candidates: Sequence[int] | None = None,
        explore_steps: int = 4,
        revisit_every: int = 16,
        half_life: float = 256.0,
        ema: float = 0.1,
    ):
        self.cost = cost
        self.candidates = np.array(sorted(set(int(b) for b in (candidates or default_candidates(cost)))), dtype=int)
        if self.candidates.size == 0 or self.candidates[0] < 1:
            raise ValueError("budget candidates must be >= 1")
        self.max_budget = int(self.candidates[-1])
        self.explore_steps = explore_steps
        self.revisit_every = revisit_every
        self.decay = 0.5 ** (1.0 / half_life)
        self.ema = ema
        self.inc = np.zeros(self.max_budget + 1)
        self.obs = np.zeros(self.max_budget + 1)
        self.verify_at = np.asarray(cost(self.candidates + 1), dtype=float)
        self.overhead: float | None = None
        self.scale = 1.0
        self.steps = 0
        self.max_steps = 0  # steps run at the largest candidate (they inform every candidate)
        self.since_explore = 0

    # -- statistics
    def observe(self, ranks, budget: int, step_seconds: float | None = None, verify_seconds: float | None = None):
        """Record one verified tree: accepted path ranks, the budget used, and (optionally) the step's wall time
        and its exact verify time. O(max_budget) numpy work."""
        budget = min(int(budget), self.max_budget)
        self.inc *= self.decay
        self.obs *= self.decay
        ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
        np.add.at(self.inc, ranks[ranks < budget] + 1, 1.0)
        self.obs[1 : budget + 1] += 1.0
        self.steps += 1
        if budget >= self.max_budget:
            self.max_steps += 1
        predicted = float(self.cost(budget + 1))
        if verify_seconds is not None and predicted > 0:
            ratio = min(max(verify_seconds / predicted, 0.25), 4.0)
            self.scale += self.ema * (ratio - self.scale)
        if step_seconds is not None:
            resid = max(step_seconds - self.scale * predicted, 0.0)
            self.overhead = resid if self.overhead is None else self.overhead + self.ema * (resid - self.overhead)

    def observe_tree(self, tree: DraftTree, path: torch.Tensor, budget: int, step_seconds=None, verify_seconds=None):
        self.observe(path_ranks(tree, path).tolist(), budget, step_seconds, verify_seconds)

    # -- estimates
    def expected_accepted(self) -> np.ndarray:
        """E[accepted draft tokens | B] per candidate (nan where never observed)."""
        rate = np.divide(self.inc, self.obs, out=np.zeros_like(self.inc), where=self.obs > 0)
        expected = np.cumsum(rate)[self.candidates]
        return np.where(self.obs[self.candidates] > 0, expected, np.nan)

    def tokens_per_second(self) -> np.ndarray:
        """Expected tokens per second per candidate (nan where never observed)."""
        step = (self.overhead or 0.0) + self.scale * self.verify_at
        return (1.0 + self.expected_accepted()) / step

    def best(self) -> int:
        """The candidate with the highest expected tokens/s (the largest candidate before any observation)."""
        tps = self.tokens_per_second()
        if np.all(np.isnan(tps)):
            return self.max_budget
        return int(self.candidates[int(np.nanargmax(tps))])

    def next_budget(self) -> int:
        """Budget for the next step: the largest candidate for the first `explore_steps` steps, then the best one,
        and every `revisit_every`-th step the smallest candidate >= 2 * best + 1 (see module docstring)."""
        if self.max_steps < self.explore_steps:
            return self.max_budget
        best = self.best()
        self.since_explore += 1
        if self.since_explore < self.revisit_every:
            return best
        self.since_explore = 0
        above = self.candidates[self.candidates >= 2 * best + 1]
        return int(above[0]) if above.size else self.max_budget

    def summary(self) -> dict:
        return {
            "candidates": self.candidates.tolist(),
            "expected_accepted": [None if math.isnan(x) else round(float(x), 4) for x in self.expected_accepted()],
            "tokens_per_second": [None if math.isnan(x) else round(float(x), 3) for x in self.tokens_per_second()],
            "verify_seconds": [round(float(x), 6) for x in self.verify_at],
            "overhead_seconds": self.overhead,
            "verify_scale": self.scale,
            "best": self.best(),
            "steps": self.steps,
        }


def budget_controller(
    head, target: PreTrainedModel, prompt_lookup: bool | None = None, **kwargs
) -> BudgetController:
    """The controller of (head, target, prompt lookup on/off), created on first use (measuring or loading the verify
    cost curve). Trees with and without lookup candidates accept differently, so each keeps its own statistics."""
    per_head = _CONTROLLERS.setdefault(head, weakref.WeakKeyDictionary())
    lookup = head.config.prompt_lookup if prompt_lookup is None else bool(prompt_lookup)
    per_target = per_head.setdefault(target, {})
    controller = per_target.get(lookup)
    if controller is None:
        controller = BudgetController(verify_cost(target), **kwargs)
        per_target[lookup] = controller
    return controller


def reset_budget_stats(head) -> None:
    """Forget the acceptance statistics of `head` (e.g. after changing its tree-search settings)."""
    _CONTROLLERS.pop(head, None)


def cost_aware_budget(head, target: PreTrainedModel) -> int:
    """One budget for a whole generation (chain mode, `DartHead.node_budget_for`): the controller's current best."""
    return budget_controller(head, target).best()


__all__ = [
    "BudgetController",
    "VerifyCost",
    "accepted_for_budgets",
    "budget_controller",
    "cost_aware_budget",
    "measure_verify_cost",
    "path_ranks",
    "reset_budget_stats",
    "verify_cost",
]
