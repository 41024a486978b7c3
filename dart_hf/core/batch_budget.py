"""The node budget of a batched step (`dart_hf.core.loop`, more than one active row): the single-row policy's E[accepted | n] per row
(`dart_hf.core.budget`), over a step time modelled rather than timed per (rows, n),

    T(R, n) = s(n) * curve(R * (n + 1)) + R * D(n)

the verify of R rows x (n + 1) tokens priced as one row of as many tokens (measured within ~15% on a 2-core CPU,
`dart-hf calibrate --batch`), s(n) the recent batched verifies' measured / predicted time at n (the load now, and the
curve's own error there), D(n) each row's head forward + tree search as recent batched steps measured it. Every row
drafts alone, so D grows the step by R * D(n) and large batches fall back to plain decoding first; a tree must
promise `batch_margin` more than plain decoding. Where phase times are not exact (CUDA without `dart_timing`), the
loop observes whole steps, which end in a host read, as s(n) alone (D = 0): the rule learns on every device. The batch
loop keeps both sides measured: one step in 32 drafts
while the rule says plain decoding, and is plain decoding while it says draft.
"""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

from .cost import nearest_size


class BatchTimes:
    """What batched steps measured, per candidate budget of `policy` (the `dart_hf.core.budget.BudgetPolicy` that
    owns it; imported by it): verify time / the curve's (and over all budgets), and per-row drafting seconds (steady
    steps, and any drafting step)."""

    def __init__(self, policy):
        self.policy = policy
        k, trees = policy.knobs, policy.candidates[1:]
        self.scale = {b: deque(maxlen=k.batch_window) for b in policy.candidates}
        self.scale_all: deque = deque(maxlen=k.batch_window)
        self.draft = {b: deque(maxlen=k.window) for b in trees}  # steady drafting steps
        self.draft_any = {b: deque(maxlen=k.window) for b in trees}  # any drafting step

    def observe(self, rows: int, budget: int, tokens: int, verify_seconds: float, draft_seconds: float = 0.0,
                steady: bool = True) -> None:
        """A batched step of `rows` rows at `budget` nodes per row verified `tokens` tokens (rows x padded tree
        size) in `verify_seconds` and spent `draft_seconds` on all rows' head forwards and tree searches.
        steady: a tree right after a tree (the first tree after plain steps has its head catch up on every position
        since: dearer). Acceptance is observed per row through `BudgetPolicy.observe`."""
        curve = self.policy.curve
        n = min(self.policy.candidates, key=lambda b: abs(b - budget))
        if curve is not None and verify_seconds > 0 and tokens > 0:
            ratio = verify_seconds / max(float(curve(tokens)), 1e-9)
            self.scale[n].append(ratio)
            self.scale_all.append(ratio)
        if n > 0 and rows > 0:
            self.draft_any[n].append(draft_seconds / rows)
            if steady:
                self.draft[n].append(draft_seconds / rows)

    def step_seconds(self, rows: int) -> np.ndarray:
        """T(rows, n) per candidate n: s(n) from the recent verifies at n (a tree size without its own: the nearest
        measured tree size's, else all sizes'; 1 before any), D(n) the median per-row drafting of recent steady
        steps at the nearest measured n (without any steady step: of any drafting step, catch-up included: dearer,
        never cheaper; 0 before any). n = 0: no drafting."""
        cands = self.policy.candidates
        overall = statistics.median(self.scale_all) if self.scale_all else 1.0
        measured = {b: statistics.median(s) for b, s in self.scale.items() if s}
        trees = [a for a in measured if a > 0]
        scale = np.array([measured[b] if b in measured else measured[nearest_size(trees, b)] if b and trees else overall
                          for b in cands])
        verify = scale * np.asarray(self.policy.curve(rows * (np.asarray(cands, dtype=float) + 1)), dtype=float)
        seen = ({b: statistics.median(d) for b, d in self.draft.items() if d}
                or {b: statistics.median(d) for b, d in self.draft_any.items() if d})
        draft = np.array([seen[nearest_size(seen, b)] if b > 0 and seen else 0.0 for b in cands])
        return verify + rows * draft


def batch_budget(policy, rows: int, drafting_only: bool = False) -> int:
    """The node budget per row of a batched step of `rows` rows: the candidate n with the most expected tokens per
    second, rows * (1 + E[accepted | n]) / T(rows, n) (module docstring). As the batch grows, each row's tree
    shrinks, down to plain decoding (n = 0) where drafting no longer pays; a tree must promise `batch_margin` (10%)
    more than plain decoding, as the model's times and E are each off by up to ~15%. Before any acceptance is
    known, and without a curve: the policy's largest tree. drafting_only: the best n > 0."""
    if policy.curve is None:
        return policy.largest
    expected = policy.expected_accepted()
    if np.isnan(expected[1:]).any():
        return policy.largest  # one step at the largest tree informs every smaller one
    tps = rows * (1.0 + expected) / np.maximum(policy.batch_times.step_seconds(rows), 1e-9)
    if drafting_only:
        tps[0] = -np.inf
    best = int(np.argmax(tps))
    if best > 0 and tps[best] < (1.0 + policy.knobs.batch_margin) * tps[0]:
        return 0
    return int(policy.candidates[best])


__all__ = ["BatchTimes", "batch_budget"]
