"""What one DART generation did, in one layout for the tree loop and for chain mode.

Why a per-call object: the statistics belong to a call, not to the head. `generate(..., dart_stats=DartStats())` fills
the object it is given (safe when one head serves several calls at once); `head.stats` is only a convenience that
points at the latest call's object. Item access (`stats["steps"]`) is kept because scripts read it like a dict.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

import torch


@dataclass
class DartStats:
    """Counts and phase times of one `generate` call.

    steps: target forwards after the prefill (one per tree verify, or per chain proposal in chain mode).
    new_tokens: tokens appended to the prompt, the prefill's token included.
    accepted_lengths: tokens each step appended (accepted draft tokens + the target's own token); in a batch, over all
    rows (so `mean_accepted_length` is new tokens per verify forward of the batch; plain batched decoding: the rows).
    node_budget / node_budgets: the tree size in force (the budget policy's choice for "auto") and the one used per
    step (0: a plain decoding step, no head forward and no tree).
    time: seconds per phase. Tree mode: prefill, draft (head forward), tree (search), verify (target forward),
    accept (acceptance + cache compaction). Chain mode: prefill, draft, tree, verify (transformers' target forward
    and acceptance, timed from the proposal to the next `update_candidate_strategy`). The static greedy step is one
    captured function: its time is "step" (draft + tree + verify + accept + commit).
    static / compiled: whether the call ran the fixed-shape step (`cache_implementation="static"`), and whether
    compiled; static_reason: why a call that asked for a static cache ran over a `DynamicCache` instead, or which part
    of its steps runs outside the captured graph. acceptance: how the tree mode accepted ("greedy", "device": sampling
    and the generation config's processors in batched passes on the device, "walk": other processors, one row and
    node at a time with a host read per node; `acceptance.StepAcceptance`).
    """

    mode: str = "tree"
    steps: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    node_budget: int | None = None
    node_budgets: list[int] = field(default_factory=list)
    budget_mode: str = "fixed"
    time: dict[str, float] = field(default_factory=dict)
    static: bool = False
    compiled: bool = False
    static_reason: str | None = None
    acceptance: str | None = None

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per target forward while decoding (the speculation's yield; plain decoding is 1)."""
        return sum(self.accepted_lengths) / self.steps if self.steps else 0.0

    def reset(self, mode: str, budget_mode: str, node_budget: int | None) -> None:
        """Start a new call in place (the caller may hold this object)."""
        self.__init__(mode=mode, budget_mode=budget_mode, node_budget=node_budget)

    def record_step(self, accepted: int, node_budget: int) -> None:
        self.steps += 1
        self.new_tokens += accepted
        self.accepted_lengths.append(accepted)
        self.node_budgets.append(node_budget)

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_accepted_length": self.mean_accepted_length}

    def keys(self) -> list[str]:
        return [*(f.name for f in fields(self)), "mean_accepted_length"]

    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key) if key in self.keys() else default

    def __contains__(self, key: object) -> bool:
        return key in self.keys()


class PhaseTimer:
    """Adds wall time per phase into a `time` dict; synchronises CUDA only when exact times were asked for
    (on a GPU, unsynchronised times are kernel launch times)."""

    def __init__(self, totals: dict[str, float], device: torch.device, sync: bool = False):
        self.totals = totals
        self.requested = sync  # the caller asked for exact phase times (the static step then times its parts)
        self.sync = sync and device.type == "cuda"
        self.exact = device.type == "cpu" or self.sync
        self.last: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.last[name] = seconds
        self.totals[name] = self.totals.get(name, 0.0) + seconds
