"""Cost-aware node budget: verify as many draft nodes per step as pays on THIS target and device.

A DART step costs t_draft + t_tree + t_verify(B + 1) + t_accept and yields 1 + (accepted draft tokens) tokens.
On a GPU, t_verify is nearly flat in the tree size up to some knee; on a CPU it grows from the first extra token,
so the budget that maximises tokens per second depends on the device (measured curves: BENCHMARKS.md).

Five parts:

1. `verify_cost(target)`: the target's verify time by number of tree tokens N (one forward over N tree tokens with
   a tree mask after a KV cache of a realistic length; interleaved rounds, median per size), cached on disk in
   `$DART_HF_CACHE/cost/` (default `~/.cache/dart_hf/cost/`), keyed by model name and shape, device, dtype,
   attention implementation, CPU thread count and torch / transformers versions. `dart-hf calibrate` measures it
   ahead of time (`dart_hf.tools.calibrate`).
2. A measurement is a claim about a machine that may have been busy, so it is checked before it is trusted
   (`check_curve`): the smallest size is timed again at the end and must agree with the start, and no size may
   cost much more than a larger one. A measurement that fails is repeated; if every attempt fails, the quietest
   reading per size is kept but marked suspect and lives only `SUSPECT_MAX_AGE_S` instead of `MAX_AGE_S`.
3. Counterfactual acceptance: the tree of budget B' < B is exactly the top-B' nodes (by score) of the budget-B
   tree, closed under ancestors because scores fall along every path. So if the accepted path's nodes have
   score ranks r_1 < r_2 < ... (rank 0 = best non-root node), budget B' would have accepted
   #{i : r_i < B'} draft tokens (exact for greedy; an estimate under sampling, where removing siblings changes
   the order in which children are tried). One verified tree thus gives the accepted length of every B' <= B.
4. `BudgetController`: running (exponentially discounted) E[accepted | B'] for every B', the per-step overhead
   (head + tree + bookkeeping, per budget: a larger budget drafts deeper and searches more depths), and the choice
   argmax_B (1 + E[accepted | B]) / (overhead(B) + t_verify(B + 1)), kept while another budget beats it by at most
   `switch_margin` (3%): near the optimum the estimates differ by less than their noise. It starts at the largest
   candidate for a few steps (one such tree informs every smaller budget), then now and then verifies a tree about
   twice the current choice, so the statistics just above the choice stay fresh without paying for the largest
   tree again. Such a revisit is paced by what it costs: at most every `revisit_every` steps, and no more often
   than keeps its extra time under `explore_share` (2%) of the decoding time. On a GPU a twice-as-large tree costs
   about the same, so it revisits every 16 steps; on a 2-core CPU, where verifying 8 tokens costs ~1.5x verifying
   4, about every 30. (Measured on SmolLM2 on the CPU: with one shared overhead, no margin and unpaced revisits the
   cost-aware budget ran 7-19% slower than the fixed 3-node tree it mostly chose; BENCHMARKS.md.)
   Where the loop can time the verify exactly (CPU, or synchronised CUDA), every step also checks the cached curve:
   t_verify is taken from the verify times of this run (median per budget, and the median ratio observed / cached
   for budgets not yet run), and when that ratio stays outside [1 / STALE_FACTOR, STALE_FACTOR] over a window of
   steps the curve is stale: the run tries once each budget near its choice (up to twice its verify size) that it
   has no verify time for, and the cache file is marked stale, so the next `verify_cost` measures again instead of
   starting from the bad curve. A re-measurement that agrees with the curve it replaces is marked `confirmed`: the
   disagreement came from the workload (a long context makes every verify dearer), not from the measurement, and
   runs then correct themselves without re-marking it.
5. `BudgetState`: what persists across `generate` calls, one controller per (target configuration, prompt lookup
   on/off). Each head carries one as `head.budget_state` (`budget_state(head)`), which `.reset()` empties;
   `budget_controller(..., state=...)` takes another. Statistics persist because a fresh controller pays its
   exploration steps at the largest (dearest) tree again on every call.

The decoding loop (`dart_hf.core.loop.dart_decode`) uses a controller when the head's `config.node_budget` is
None or when `generate(..., dart_node_budget="auto")`. The controller draws no random numbers.
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
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import transformers
from transformers import DynamicCache, PreTrainedModel

from .runtime import verify_runtime
from .target import cache_kwargs
from .tree import DraftTree, ancestor_mask
from .verify import GROUPED_SDPA, verify_tree

DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96)
DEFAULT_PAST_LEN = 256
COST_VERSION = 5  # 5: torch/transformers versions in the key; measurement record with sanity checks and stale marks
MAX_AGE_S = 30 * 24 * 3600  # a curve that passed its checks: re-measured after 30 days (cost: BENCHMARKS.md)
SUSPECT_MAX_AGE_S = 3600  # a curve that failed its checks on every attempt: used for an hour at most
STALE_FACTOR = 1.5  # in-run verify times this far from the curve (median over the window) mark it stale
STALE_WINDOW = 16  # steps in the in-run comparison window
STALE_MIN_STEPS = 8  # steps observed before the comparison may decide anything
START_END_FACTOR = 1.3  # the smallest size timed at the start and at the end of a measurement must agree this well
MONOTONE_FACTOR = 2.0  # no size may cost more than this times a larger size (CPU kernels differ by up to ~1.5x)
MEASURE_ATTEMPTS = 3


# ---------------------------------------------------------------------------------------------------- verify cost
@dataclass
class VerifyCost:
    """Seconds of one target verify forward by number of tree tokens N (root included), piecewise linear between
    the measured sizes and extrapolated along the last segment. `record` is how and when it was measured (as
    stored in the cache file: measured_at, past_len, repeats, sanity, stale / confirmed marks)."""

    sizes: list[int]
    seconds: list[float]
    key: dict | None = None
    path: str | None = None
    record: dict = field(default_factory=dict)

    def __call__(self, n) -> np.ndarray | float:
        xs, ys = np.asarray(self.sizes, dtype=float), np.asarray(self.seconds, dtype=float)
        n_arr = np.asarray(n, dtype=float)
        out = np.interp(n_arr, xs, ys)
        if len(xs) >= 2:
            slope_hi = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            out = np.where(n_arr > xs[-1], ys[-1] + slope_hi * (n_arr - xs[-1]), out)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict:
        return {**self.record, "sizes": list(self.sizes), "seconds": list(self.seconds), "key": self.key}


def cost_dir() -> Path:
    """`$DART_HF_CACHE/cost`, else `~/.cache/dart_hf/cost` (same root as dart_hf.tools.assets.cache_dir)."""
    return Path(os.environ.get("DART_HF_CACHE", "~/.cache/dart_hf")).expanduser() / "cost"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"{platform.machine()}-{platform.processor() or 'cpu'}-{torch.get_num_threads()}threads"
    return device.type


def attn_implementation(target: PreTrainedModel) -> str:
    """The attention implementation the target was loaded with (the verify may swap in its grouped SDPA variant
    for the duration of one forward; that is still SDPA)."""
    impl = target.config._attn_implementation or "eager"
    return "sdpa" if impl == GROUPED_SDPA else impl


def cost_key(target: PreTrainedModel) -> dict:
    """What the verify cost depends on: the model's name and shape, the device, dtype, attention backend and the
    library versions (a torch or transformers upgrade changes kernels). How it was measured (sizes, KV length) is
    not part of the key: one file per configuration, so a curve from `dart-hf calibrate --sizes ...` is the one
    decoding uses."""
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
        "attn_implementation": attn_implementation(target),
        "quantization": None if quant is None else str(getattr(quant, "quant_method", quant)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
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


def check_curve(sizes: Sequence[int], seconds: Sequence[float], record: dict | None = None) -> list[str]:
    """Why a verify cost curve should not be trusted (empty: no reason found).

    Shape: no size may cost more than MONOTONE_FACTOR times a larger size. More tokens can really cost a little
    less on CPU (a 1-token forward runs MKL's matrix-vector path), but not several times less; a point that is,
    was measured while something else ran. Drift: the record's timings of the smallest size at the start and at
    the end of the measurement must agree within START_END_FACTOR, else the machine's load changed during it."""
    problems = []
    ys = np.asarray(seconds, dtype=float)
    if len(sizes) != len(ys) or len(ys) == 0 or not np.all(np.isfinite(ys)) or np.any(ys <= 0):
        return ["the curve is empty or has non-positive times"]
    later_min = np.minimum.accumulate(ys[::-1])[::-1]  # min over this size and every larger one
    for i in range(len(ys) - 1):
        if ys[i] > MONOTONE_FACTOR * later_min[i + 1]:
            j = i + 1 + int(np.argmin(ys[i + 1 :]))
            problems.append(
                f"{sizes[i]} tokens cost {1e3 * ys[i]:.1f} ms, more than {MONOTONE_FACTOR}x the "
                f"{1e3 * ys[j]:.1f} ms of {sizes[j]} tokens"
            )
    probe = (record or {}).get("probe")
    if probe:
        start, end = statistics.median(probe["start"]), statistics.median(probe["end"])
        if max(start, end) > START_END_FACTOR * min(start, end):
            problems.append(
                f"{probe['size']} tokens took {1e3 * start:.1f} ms at the start of the measurement and "
                f"{1e3 * end:.1f} ms at the end: the machine's load changed"
            )
    return problems


@torch.no_grad()
def measure_verify_cost(
    target: PreTrainedModel,
    sizes: Sequence[int] = DEFAULT_SIZES,
    past_len: int = DEFAULT_PAST_LEN,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    probes: int = 3,
) -> VerifyCost:
    """Median seconds of one verify forward over N tree tokens after `past_len` cached tokens, for N in `sizes`.

    The sizes are measured in interleaved rounds (every size once per round) rather than one size at a time: on a
    shared or throttled CPU a slow spell then inflates one sample of every size instead of every sample of one
    size, which the median discards. The medians are kept as measured, not smoothed into a nondecreasing curve:
    on CPU more tokens can really cost less (a 1-token forward takes MKL's matrix-vector path), and pooling such
    points hid real steps between neighbouring sizes. The smallest size is also timed `probes` times before and
    after the rounds; `check_curve` compares the two. The result's `record` says how it was measured.
    """
    device = target.device
    cfg = target.config.get_text_config()
    max_pos = getattr(cfg, "max_position_embeddings", None) or 10**9
    sizes = sorted({int(n) for n in sizes if n >= 1})
    if not sizes:
        raise ValueError("measure_verify_cost needs at least one tree size >= 1")
    past_len = max(1, min(past_len, max_pos - max(sizes) - 1))
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(cfg.vocab_size, (1, past_len), generator=g).to(device)
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(target, cache))
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
        "measured_past_len": past_len,
        "repeats": repeats,
        "warmup": warmup,
        "measure_seconds": time.perf_counter() - started,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if probes:
        record["probe"] = {"size": sizes[0], "start": probe_start, "end": probe_end}
    return VerifyCost(sizes=sizes, seconds=[statistics.median(t) for t in times], record=record)


def _write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def _read_record(path: Path, key: dict) -> dict | None:
    """The cache file's record if it exists, parses and belongs to `key`; None otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps(key, default=str)):
        return None
    if not isinstance(data.get("sizes"), list) or not isinstance(data.get("seconds"), list):
        return None
    return data


def cached_cost_problem(record: dict, now: float | None = None) -> str | None:
    """Why a cached curve must be measured again (None: usable): marked stale by a run, too old, or insane."""
    now = time.time() if now is None else now
    stale = record.get("stale")
    if stale:
        return f"marked stale by a run ({stale.get('reason', 'verify times disagreed with it')})"
    suspect = not record.get("sanity", {}).get("ok", True)
    max_age = SUSPECT_MAX_AGE_S if suspect else MAX_AGE_S
    measured_at = record.get("measured_at")
    if not isinstance(measured_at, (int, float)) or now - measured_at > max_age:
        return f"older than {max_age / 3600:g} hours" + (" (it failed its checks when measured)" if suspect else "")
    problems = check_curve(record["sizes"], record["seconds"])
    return "; ".join(problems) if problems else None


def verify_cost(
    target: PreTrainedModel,
    sizes: Sequence[int] | None = None,
    past_len: int | None = None,
    repeats: int = 5,
    refresh: bool = False,
    verbose: bool = True,
    attempts: int = MEASURE_ATTEMPTS,
) -> VerifyCost:
    """The target's verify cost curve: from the disk cache if it is usable (`cached_cost_problem`) and was measured
    with the `sizes` and `past_len` asked for (None: whatever it was measured with), else measured now (up to
    `attempts` times until `check_curve` passes) and cached. `refresh` measures regardless. A measurement takes
    the sizes and KV length asked for, else those of the cached curve it replaces, else DEFAULT_SIZES and
    DEFAULT_PAST_LEN."""
    key = cost_key(target)
    path = cost_file(key)
    want_sizes = None if sizes is None else sorted({int(n) for n in sizes if n >= 1})
    old = _read_record(path, key)
    if old is not None and not refresh:
        problem = cached_cost_problem(old)
        if problem is None and want_sizes not in (None, old["sizes"]):
            problem = f"measured at sizes {old['sizes']}, not {want_sizes}"
        if problem is None and past_len not in (None, old.get("past_len")):
            problem = f"measured after {old.get('past_len')} cached tokens, not {past_len}"
        if problem is None:
            return VerifyCost(old["sizes"], old["seconds"], key=key, path=str(path), record=_record_of(old))
        if verbose:
            print(f"dart_hf: the cached verify cost in {path} is {problem}; measuring it again", file=sys.stderr)
    sizes = want_sizes or (old["sizes"] if old is not None else list(DEFAULT_SIZES))  # measure the same again
    past_len = past_len or (old or {}).get("past_len") or DEFAULT_PAST_LEN
    if verbose:
        print(f"dart_hf: measuring verify cost of {key['name']} on {key['device_name']} "
              f"({key['dtype']}, {key['attn_implementation']}; sizes {sizes}), cached in {path}",
              file=sys.stderr)
    tries = []
    for _ in range(max(1, attempts)):
        measured = measure_verify_cost(target, sizes=sizes, past_len=past_len, repeats=repeats)
        problems = check_curve(measured.sizes, measured.seconds, measured.record)
        tries.append((measured, problems))
        if not problems:
            break
        if verbose:
            print(f"dart_hf: verify cost measurement rejected ({'; '.join(problems)}); measuring again",
                  file=sys.stderr)
    measured, problems = tries[-1]
    seconds = measured.seconds
    if problems:  # every attempt failed: a busy spell only adds time, so the quietest reading per size is best
        seconds = np.min([t.seconds for t, _ in tries], axis=0).tolist()
        if verbose:
            print(f"dart_hf: every verify cost measurement failed its checks; using the fastest reading per size "
                  f"for at most {SUSPECT_MAX_AGE_S / 3600:g} hour(s)", file=sys.stderr)
    record = {**measured.record, "past_len": past_len, "attempts": len(tries),
              "sanity": {"ok": not problems, "problems": problems}}
    if old is not None and old.get("stale"):
        # measured again because a run disagreed: if the new curve agrees with the old one, the measurement was
        # fine and the disagreement came from that run's workload; runs then stop marking this curve stale
        ratio = float(np.median(np.asarray(old["seconds"]) / np.interp(old["sizes"], measured.sizes, seconds)))
        record["confirmed"] = bool(1 / STALE_FACTOR <= ratio <= STALE_FACTOR)
        record["replaced"] = {"seconds": old["seconds"], "stale": old["stale"], "ratio_old_to_new": ratio}
    cost = VerifyCost(measured.sizes, seconds, key=key, path=str(path), record=record)
    _write_record(path, cost.to_dict())
    return cost


def _record_of(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("sizes", "seconds", "key")}


def mark_stale(cost: VerifyCost, reason: dict) -> bool:
    """Mark `cost`'s cache file stale so the next `verify_cost` measures again. Only the very curve this run used
    is marked (not a newer one another process wrote meanwhile), and never a `confirmed` one. True if marked."""
    if cost.path is None or cost.key is None or cost.record.get("confirmed"):
        return False
    path = Path(cost.path)
    data = _read_record(path, cost.key)
    if data is None or data["seconds"] != list(cost.seconds) or data.get("confirmed"):
        return False
    data["stale"] = {**reason, "marked_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_record(path, data)
    cost.record["stale"] = data["stale"]
    return True


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

    Verify time per candidate, when the caller passes exact verify times: the median of this run's recent verify
    times at that budget once there are `min_observed` of them, else the cached curve times `scale`, the median
    ratio (observed / curve) over the last STALE_WINDOW steps. Medians, not means: one step that shares the CPU
    with something else must not move the choice. Without exact verify times the curve is used as measured.
    overhead: step wall time - verify time (head, tree search and bookkeeping), measured from whole steps, which stay
    exact on a GPU without per-phase syncs (each step ends with a host sync): per budget the median of this run's
    recent steps at it once there are `min_observed`, else the moving average over all steps.
    """

    def __init__(
        self,
        cost: VerifyCost,
        candidates: Sequence[int] | None = None,
        explore_steps: int = 4,
        revisit_every: int = 16,
        explore_share: float = 0.02,
        switch_margin: float = 0.03,
        half_life: float = 256.0,
        ema: float = 0.1,
        min_observed: int = 3,
    ):
        self.cost = cost
        self.candidates = np.array(sorted(set(int(b) for b in (candidates or default_candidates(cost)))), dtype=int)
        if self.candidates.size == 0 or self.candidates[0] < 1:
            raise ValueError("budget candidates must be >= 1")
        self.max_budget = int(self.candidates[-1])
        self._index = {int(b): i for i, b in enumerate(self.candidates)}  # budget -> position in candidates
        self.explore_steps = explore_steps
        self.revisit_every = revisit_every
        self.explore_share = explore_share
        self.switch_margin = switch_margin
        self.decay = 0.5 ** (1.0 / half_life)
        self.ema = ema
        self.min_observed = min_observed
        self.inc = np.zeros(self.max_budget + 1)
        self.obs = np.zeros(self.max_budget + 1)
        self.verify_at = np.asarray(cost(self.candidates + 1), dtype=float)  # the cached curve at each candidate
        self.ratios: deque[float] = deque(maxlen=STALE_WINDOW)  # observed / curve, recent steps
        self.observed: dict[int, deque[float]] = {}  # budget -> recent exact verify seconds
        self.stale: dict | None = None  # why this run found the cached curve wrong (None: it agrees)
        self.overhead: float | None = None
        self.residuals: dict[int, deque[float]] = {}  # budget -> recent (step - verify) seconds
        self.current: int | None = None  # the budget next_budget last chose outside exploration
        self.steps = 0
        self.max_steps = 0  # steps run at the largest candidate (they inform every candidate)
        self.since_explore = 0

    # -- statistics
    def observe(
        self,
        ranks,
        budget: int,
        step_seconds: float | None = None,
        verify_seconds: float | None = None,
        tree_size: int | None = None,
    ):
        """Record one verified tree: accepted path ranks, the budget used, and (optionally) the step's wall time,
        its exact verify time and the verified tree's size (default budget + 1). O(max_budget) numpy work."""
        budget = min(int(budget), self.max_budget)
        self.inc *= self.decay
        self.obs *= self.decay
        ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
        np.add.at(self.inc, ranks[ranks < budget] + 1, 1.0)
        self.obs[1 : budget + 1] += 1.0
        self.steps += 1
        if budget >= self.max_budget:
            self.max_steps += 1
        curve = float(self.cost(tree_size or budget + 1))
        if verify_seconds is not None:
            self.observed.setdefault(budget, deque(maxlen=2 * self.min_observed + 1)).append(float(verify_seconds))
            if curve > 0:
                self.ratios.append(verify_seconds / curve)
                self._check_curve()
        if step_seconds is not None:
            verify = verify_seconds if verify_seconds is not None else curve
            resid = max(step_seconds - verify, 0.0)
            self.residuals.setdefault(budget, deque(maxlen=2 * self.min_observed + 1)).append(resid)
            self.overhead = resid if self.overhead is None else self.overhead + self.ema * (resid - self.overhead)

    def observe_tree(self, tree: DraftTree, path: torch.Tensor, budget: int, step_seconds=None, verify_seconds=None):
        self.observe(path_ranks(tree, path).tolist(), budget, step_seconds, verify_seconds, tree_size=tree.size)

    def _check_curve(self) -> None:
        """Once per run: when the median ratio over a full enough window is off by STALE_FACTOR, the cached curve
        is stale; record why and mark its cache file (this run already uses its own verify times)."""
        if self.stale is not None or len(self.ratios) < STALE_MIN_STEPS:
            return
        ratio = self.scale
        if 1 / STALE_FACTOR <= ratio <= STALE_FACTOR:
            return
        self.stale = {
            "reason": f"verify times in a run were {ratio:.3g}x the curve (median of {len(self.ratios)} steps)",
            "ratio": ratio,
            "observed_seconds": {str(b + 1): statistics.median(t) for b, t in sorted(self.observed.items())},
        }
        self.stale["marked"] = mark_stale(self.cost, self.stale)

    # -- estimates
    @property
    def scale(self) -> float:
        """Median of observed / cached verify time over recent steps (1 before any exact verify time)."""
        return float(statistics.median(self.ratios)) if self.ratios else 1.0

    def verify_seconds(self) -> np.ndarray:
        """Expected verify seconds per candidate: this run's own median where observed enough (once the curve is
        stale, one observation is enough: it beats a curve known to be wrong), else the scaled curve."""
        out = self.scale * self.verify_at
        enough = 1 if self.stale is not None else self.min_observed
        for i, b in enumerate(self.candidates.tolist()):
            seen = self.observed.get(b)
            if seen is not None and len(seen) >= enough:
                out[i] = statistics.median(seen)
        return out

    def expected_accepted(self) -> np.ndarray:
        """E[accepted draft tokens | B] per candidate (nan where never observed)."""
        rate = np.divide(self.inc, self.obs, out=np.zeros_like(self.inc), where=self.obs > 0)
        expected = np.cumsum(rate)[self.candidates]
        return np.where(self.obs[self.candidates] > 0, expected, np.nan)

    def overhead_seconds(self) -> np.ndarray:
        """Expected head + tree search + bookkeeping seconds per candidate: this run's median at that budget once
        observed `min_observed` times, else the moving average over all steps. Per budget because a larger budget
        drafts deeper and searches more depths (on a 2-core CPU ~12 ms at 3-4 nodes, ~22 ms at 60): one shared figure
        made large trees look cheaper than they are."""
        out = np.full(self.candidates.shape, self.overhead or 0.0)
        for i, b in enumerate(self.candidates.tolist()):
            seen = self.residuals.get(b)
            if seen is not None and len(seen) >= self.min_observed:
                out[i] = statistics.median(seen)
        return out

    def tokens_per_second(self) -> np.ndarray:
        """Expected tokens per second per candidate (nan where never observed)."""
        step = self.overhead_seconds() + self.verify_seconds()
        return (1.0 + self.expected_accepted()) / step

    def best(self) -> int:
        """The candidate with the highest expected tokens/s (the largest candidate before any observation)."""
        return self._best_of(self.tokens_per_second())

    def _best_of(self, tps: np.ndarray) -> int:
        if np.all(np.isnan(tps)):
            return self.max_budget
        return int(self.candidates[int(np.nanargmax(tps))])

    def next_budget(self) -> int:
        """Budget for the next step: the largest candidate for the first `explore_steps` steps, then the chosen one
        (`_choice`: the best, unless within `switch_margin` of the current choice), and now and then
        (`revisit_period`) the smallest candidate >= 2 * best + 1 (see module docstring).

        Once the curve is stale, every other step tries a candidate near the best (at most twice its verify size)
        that this run has no verify time for yet, nearest first: the scaled curve keeps the wrong curve's shape, and
        a size it prices too high would otherwise never be run, so never corrected. At most one step per candidate;
        farther candidates are reached as the best moves (on a CPU one 96-node verify costs 5-6 small steps)."""
        if self.max_steps < self.explore_steps:
            return self.max_budget
        best = self._choice()
        if self.stale is not None and self.steps % 2 == 0:
            untried = [b for b in self.candidates.tolist() if b not in self.observed and b + 1 <= 2 * (best + 1)]
            if untried:
                return min(untried, key=lambda b: (abs(math.log((b + 1) / (best + 1))), b))
        self.since_explore += 1
        above = self.candidates[self.candidates >= 2 * best + 1]
        revisit = int(above[0]) if above.size else self.max_budget
        if revisit == best or self.since_explore < self.revisit_period(best, revisit):
            return best
        self.since_explore = 0
        return revisit

    def _choice(self) -> int:
        """The best candidate, except that the current choice stays while the best beats it by at most
        `switch_margin` (relative tokens/s): near the optimum the estimates differ by less than their noise, and
        following the noise sent steps to dearer trees that won nothing."""
        tps = self.tokens_per_second()
        best, current = self._best_of(tps), self.current
        if current is not None and current != best:
            now = tps[self._index[current]]
            if np.isfinite(now) and tps[self._index[best]] <= (1 + self.switch_margin) * now:
                best = current
        self.current = best
        return best

    def revisit_period(self, best: int, revisit: int) -> int:
        """Steps between revisits: `revisit_every`, or more where verifying `revisit` instead of `best` costs more
        than `explore_share` of `revisit_every` steps at `best` (spread over enough steps to stay within it)."""
        step_seconds = self.verify_seconds() + self.overhead_seconds()
        step = float(step_seconds[self._index[best]])
        extra = max(float(step_seconds[self._index[revisit]]) - step, 0.0)
        if step <= 0 or self.explore_share <= 0:
            return self.revisit_every
        return max(self.revisit_every, math.ceil(extra / (self.explore_share * step)))

    def summary(self) -> dict:
        return {
            "candidates": self.candidates.tolist(),
            "expected_accepted": [None if math.isnan(x) else round(float(x), 4) for x in self.expected_accepted()],
            "tokens_per_second": [None if math.isnan(x) else round(float(x), 3) for x in self.tokens_per_second()],
            "verify_seconds": [round(float(x), 6) for x in self.verify_seconds()],
            "curve_seconds": [round(float(x), 6) for x in self.verify_at],
            "curve_file": self.cost.path,
            "curve_stale": self.stale,
            "overhead_seconds": self.overhead,
            "overhead_by_budget": [round(float(x), 6) for x in self.overhead_seconds()],
            "verify_scale": self.scale,
            "best": self.best(),
            "steps": self.steps,
        }


# ---------------------------------------------------------------------------------------------------- state
class BudgetState:
    """The cost-aware budget's memory across `generate` calls: one `BudgetController` per (target configuration,
    prompt lookup on/off), created on first use from the target's cached verify cost curve.

    Trees with and without prompt-lookup candidates accept differently, so each keeps its own statistics. A head
    carries one as `head.budget_state`; `reset()` forgets everything (e.g. after changing the head's tree-search
    settings, or to time a cold start); pass another to `budget_controller(..., state=...)` to keep runs apart.
    """

    def __init__(self) -> None:
        self.controllers: dict[tuple[str, bool], BudgetController] = {}
        self.curves: dict[str, VerifyCost] = {}  # one curve per cost file, shared by its controllers

    def controller(self, target: PreTrainedModel, prompt_lookup: bool, **kwargs) -> BudgetController:
        """The controller of (target configuration, prompt lookup), created on first use; `kwargs` go to
        `BudgetController` then. The verify cost curve is loaded (or measured) once per state: a curve that a run
        marked stale is measured again by the next state, never in the middle of this one's calls (a benchmark
        timing them would time the measurement)."""
        name = str(cost_file(cost_key(target)))
        key = (name, bool(prompt_lookup))
        controller = self.controllers.get(key)
        if controller is None:
            if name not in self.curves:
                self.curves[name] = verify_cost(target)
            controller = BudgetController(self.curves[name], **kwargs)
            self.controllers[key] = controller
        return controller

    def reset(self) -> None:
        """Forget every controller and curve: the next call starts from the cached curve (measured again if a run
        marked it stale) with no acceptance statistics."""
        self.controllers.clear()
        self.curves.clear()

    def summary(self) -> dict:
        return {f"{Path(name).name} lookup={lookup}": c.summary() for (name, lookup), c in self.controllers.items()}

    def __len__(self) -> int:
        return len(self.controllers)

    def __repr__(self) -> str:
        return f"BudgetState({len(self)} controller(s))"


def budget_state(head) -> BudgetState:
    """`head.budget_state`: the head's own `BudgetState`, attached on first use."""
    state = getattr(head, "budget_state", None)
    if state is None:
        state = BudgetState()
        head.budget_state = state
    elif not isinstance(state, BudgetState):
        raise TypeError(f"head.budget_state must be a BudgetState, got {type(state).__name__}")
    return state


def budget_controller(
    head, target: PreTrainedModel, prompt_lookup: bool | None = None, state: BudgetState | None = None, **kwargs
) -> BudgetController:
    """The controller of (target, prompt lookup on/off) in `state` (default: `head.budget_state`)."""
    lookup = head.config.prompt_lookup if prompt_lookup is None else bool(prompt_lookup)
    if state is not None and not isinstance(state, BudgetState):
        raise TypeError(f"the budget state must be a dart_hf.core.budget.BudgetState, got {type(state).__name__}")
    return (state if state is not None else budget_state(head)).controller(target, lookup, **kwargs)


def cost_aware_budget(head, target: PreTrainedModel) -> int:
    """One budget for a whole generation (chain mode, `DartHead.node_budget_for`): the controller's current best."""
    return budget_controller(head, target).best()


__all__ = [
    "BudgetController",
    "BudgetState",
    "VerifyCost",
    "accepted_for_budgets",
    "budget_controller",
    "budget_state",
    "check_curve",
    "cost_aware_budget",
    "mark_stale",
    "measure_verify_cost",
    "path_ranks",
    "verify_cost",
]
