"""The node budget (tree size) of each step: one rule for one row and batches, greedy and sampled, that measures
itself. Per step, the size B of `LADDER` (or 0, plain decoding) with the most expected tokens per second,
(1 + E[accepted | B]) / T(B), for the step's batch bucket (`drafter.batch_bucket` of the active rows):

- E[accepted | B], counterfactually: the budget-B' tree (B' < B) is the best B' nodes by score of the budget-B tree,
  closed under ancestors, so it would have accepted #{path score ranks < B'} draft tokens (exact for greedy, an
  estimate under sampling). Counts decay (`half_life` steps); a call leans on its own counts as they come
  (`CallAcceptance`): acceptance depends on the text.
- T(B): the median of this process's whole-step times at B in this bucket's last `window` steps (of its last 3
  where fewer of those ran it: a load shows as it happens), each step timed from the rule's choice to the step's
  host read (a tree after plain steps is run twice and timed the second time: the first has its head catch up on
  the skipped positions). A size not yet timed is priced on the line through the timed ones (plain decoding
  included: cheap below the smallest tree, as it leaves out the drafting cost); the next size above the largest
  timed tree at that tree's time, the ones beyond along the last segment: no stored curve, no calibration. A price
  that is too cheap gets probed and corrected.

Exploration: the probe is the size with the most tokens per second at an upper bound of E (one standard error; past
the largest size ever drafted, the acceptance rate of its last rank continues). It runs when the credit covers its
loss priced at that bound (at least a tenth of a step at the choice: a probe at most every 5 steps), and what it
then loses or wins, its measured time against its E (this step counted) at the choice's seconds per token, is taken
from the credit. The credit grows by `probe_share` of the time spent at the choice, up to 8 steps: what exploration
loses stays within about `probe_share` of the time, whatever the prices said. So where no tree pays, the rule runs
plain decoding and probes now and then; where a larger tree pays (a GPU, whose verify costs about the same up to
dozens of tokens), it climbs the ladder, each probe that wins paying for the next. The first steps of a bucket:
plain decoding once, then `START` (or another bucket's choice). Measured on scripted CPU and GPU step times
(`tests/test_budget.py`): 0.955-0.99x the best of plain decoding and every fixed size in hindsight, exploration
included.

A compiled call (the static step, a graph per size) takes its shape's size at that shape's first call and keeps it
(`BudgetPolicy.call_budget`; 0: plain decoding for the call); its steps then choose among that size and its
neighbours on the ladder (`ladder_around`), each compiled before the shape's first decode step, by a policy of their
own timed by that shape's steps: a compile never happens inside a later call.

One policy may serve several calls at once (threads sharing a head): its statistics are guarded by a lock; each call
times its own steps (`CallBudget`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np
import torch

from .distributed import shared_budget, tensor_parallel_group
from .drafter import batch_bucket
from .tree import DraftTrees

LADDER = (1, 2, 3, 5, 8, 13, 21, 34, 60)  # the tree sizes (nodes besides the root) a step may take; 0: plain decoding
START = 5  # a bucket's first tree, where no other bucket has a choice yet: it informs the acceptance of every smaller
# size, and the ladder climbs from it where larger trees pay

# the rule's four knobs (private): probe_share, window, half_life, call_prior
_PROBE_SHARE = 0.02  # what probes may lose, as a share of the time spent at the choice
_WINDOW = 9  # the last step times of a size that price it (median)
_HALF_LIFE = 256.0  # steps; discount of the shared acceptance counts
_CALL_PRIOR = 8.0  # a call's own tree steps (per row) that weigh as much as the shared counts


class CallAcceptance:
    """One call's own acceptance counts, beside its policy's shared ones: inc[b] / obs[b] as in `BudgetPolicy`, over
    the call's rows' tree steps, undiscounted. E[accepted | B] for the call blends the two per score rank, the shared
    rate weighing as `_CALL_PRIOR` of the call's steps (or as its own count, where that is smaller). Why: acceptance
    depends on the text. On an Intel Xeon VM (2 threads), sampled at T 0.7, ShareGPT calls after HumanEval calls
    kept drafting by HumanEval's acceptance with shared counts alone (0.87x plain decoding against 0.98x)."""

    def __init__(self, size: int):
        self.inc, self.obs = np.zeros(size), np.zeros(size)


def path_ranks(ranks: torch.Tensor, lengths: Sequence[int]) -> list[list[int]]:
    """Per row, the score rank (0 = best non-root node) of every accepted draft node (the path without its root), in
    path order: `ranks` [rows, M - 1] (`DraftTrees.ranks` of paths whose first lengths[r] nodes are row r's) cut to
    each row's path. One host read for every row."""
    return [r[: n - 1] for r, n in zip(ranks.tolist(), lengths)]


class _Bucket:
    """What steps of one batch bucket measured: step seconds per size, the probes' credit and pacing."""

    def __init__(self):
        self.times: dict[int, deque] = {}  # size -> (step, seconds) of its last `_WINDOW` timed steps
        self.steps = 0  # timed steps of this bucket
        self.choice: int | None = None
        self.credit = 0.0  # seconds a probe may lose (`_PROBE_SHARE` of the time at the choice)
        self.probe: tuple[int, float, int] | None = None  # the probe under way: size, seconds per token at the
        # choice, steps left

    def median(self, size: int) -> float | None:
        """The median of the size's times in the last `_WINDOW` steps, or of its last 3 where fewer of those ran it (a
        size run only as a probe is priced by its last probes, not by a load long gone)."""
        times = self.times.get(size)
        if not times:
            return None
        recent = [t for i, t in times if self.steps - i < _WINDOW]
        return statistics.median(recent if len(recent) >= 3 else [t for _, t in list(times)[-3:]])


class BudgetPolicy:
    """Chooses each step's node budget (see the module docstring). `sizes`: the tree sizes it may take (default
    `LADDER`); `clock`: seconds, for the step times."""

    def __init__(self, sizes: Sequence[int] = LADDER, clock: Callable[[], float] = time.perf_counter,
                 plain: bool = True):
        self.plain = plain  # plain decoding (0) is a candidate (not for a compiled step's ladder: `ladder_around`)
        self.candidates = [0] * plain + sorted(set(int(s) for s in sizes if s > 0))
        self.clock = clock
        self.decay = 0.5 ** (1.0 / _HALF_LIFE)
        largest = self.candidates[-1]
        self.inc = np.zeros(largest + 1)  # inc[b]: (discounted) steps whose path held the node of rank b - 1
        self.obs = np.zeros(largest + 1)  # obs[b]: (discounted) steps whose budget was >= b
        self.buckets: dict[int, _Bucket] = {}
        self.held: dict[tuple, int] = {}  # a held call's shape -> its size (`call_budget`)
        self.steps = 0  # steps observed
        self.lock = threading.RLock()  # calls in several threads may share this policy

    @property
    def choice(self) -> int:
        """The one-row choice so far (`START` before one): a call that takes one size for all its steps uses it."""
        chosen = self.buckets.get(1)
        return START if chosen is None or chosen.choice is None else chosen.choice

    # -- observing
    def observe(self, rows: int, budget: int, ranks: Sequence[Sequence[int]], seconds: float | None,
                call: CallAcceptance | None = None, priced: bool = True) -> None:
        """A step of `rows` active rows at `budget` ended after `seconds` (None: not timed); `ranks`: each row's
        accepted path's score ranks (`path_ranks`; none at budget 0), counted for the policy and for the `call`.
        `priced`: the time prices its size (not a tree's first step after plain steps, whose head caught up)."""
        with self.lock:
            self.steps += 1
            if budget > 0:
                self._count(budget, ranks, call)
            if seconds is None:
                return
            state = self.buckets.setdefault(batch_bucket(rows), _Bucket())
            if priced:
                state.steps += 1
                state.times.setdefault(budget, deque(maxlen=_WINDOW)).append((state.steps, seconds))
            if budget == state.choice and state.probe is None:
                state.credit = min(state.credit + _PROBE_SHARE * seconds, 8 * seconds)
            elif state.probe is not None and state.probe[0] == budget:  # what the probe lost, or won, measured
                size, per_token, steps = state.probe  # (tokens at the size's E with this step counted: one path's
                accepted = float(np.nan_to_num(self.expected_at([size], call)[0]))  # length is too noisy a price)
                state.credit -= seconds - (1.0 + accepted) * per_token
                state.probe = (size, per_token, steps - 1) if steps > 1 else None

    def _count(self, budget: int, rows_ranks: Sequence[Sequence[int]], call: CallAcceptance | None) -> None:
        b = min(int(budget), len(self.obs) - 1)
        for ranks in rows_ranks:
            ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
            self.inc *= self.decay
            self.obs *= self.decay
            for counts in (self, call) if call is not None else (self,):
                np.add.at(counts.inc, ranks[ranks < b] + 1, 1.0)
                counts.obs[1 : b + 1] += 1.0

    # -- estimates
    def expected_at(self, sizes: Sequence[int], call: CallAcceptance | None = None) -> np.ndarray:
        """E[accepted draft tokens | B] at each of `sizes` (0 for plain decoding; nan where never observed), blended
        with the `call`'s own counts (`CallAcceptance`)."""
        return self._estimates(sizes, call)[0]

    def _estimates(self, sizes: Sequence[int], call: CallAcceptance | None) -> tuple[np.ndarray, np.ndarray]:
        """(E[accepted | B], its upper bound) at `sizes`, from one blend of the counts. The bound: E plus one standard
        error, sqrt((1 + E) / n) over the n (discounted) observations of rank B (an accepted length's spread grows
        with its mean); past the largest rank ever drafted, its acceptance rate continues (ranks are in score order,
        so later ones accept no more); nan before any tree; plain decoding's 0 is exact."""
        inc, obs = self._counts(call)
        rate = np.divide(inc, obs, out=np.zeros_like(inc), where=obs > 0)
        total = np.cumsum(rate)
        sizes = np.asarray(sizes, dtype=np.int64)
        expected = np.where((obs[sizes] > 0) | (sizes == 0), total[sizes], np.nan)
        seen = np.flatnonzero(obs > 0)
        if not len(seen):
            return expected, np.where(sizes == 0, 0.0, np.nan)
        last = int(seen[-1])
        at = np.minimum(sizes, last)
        extended = total[at] + rate[last] * (sizes - at)
        spread = np.sqrt((1.0 + extended) / np.maximum(obs[at], 1e-3))
        return expected, np.where(sizes == 0, 0.0, extended + spread)

    @staticmethod
    def _lower_bounds(expected: np.ndarray) -> np.ndarray:
        """`expected` (at ascending sizes) where a size past every observed one takes the largest observed one's (a
        larger tree holds the smaller one); 0 before any tree."""
        known = ~np.isnan(expected)
        last = np.maximum.accumulate(np.where(known, np.arange(len(expected)), 0))
        return np.nan_to_num(expected[last], nan=0.0)

    def _counts(self, call: CallAcceptance | None) -> tuple[np.ndarray, np.ndarray]:
        if call is None:
            return self.inc, self.obs
        prior = np.minimum(_CALL_PRIOR, self.obs) / np.maximum(self.obs, 1e-12)  # the shared counts, scaled
        return prior * self.inc + call.inc, prior * self.obs + call.obs

    def prices(self, rows: int) -> np.ndarray:
        """T(B) per candidate for a step of `rows` rows: measured, or on the line through the measured sizes (module
        docstring); nan where nothing is measured to go by."""
        state = self.buckets.get(batch_bucket(rows))
        timed = {} if state is None else {b: state.median(b) for b in state.times}  # (a size is there once timed)
        points = sorted(timed.items())
        out = np.full(len(self.candidates), np.nan)
        if not any(b > 0 for b, _ in points):
            out[0] = timed.get(0, np.nan) if self.plain else np.nan
            return out
        xs, ys = np.array([b for b, _ in points], float), np.array([t for _, t in points], float)
        sizes = np.asarray(self.candidates, float)
        out = np.interp(sizes, xs, ys)  # past the largest timed tree: its time, for the next size up (to be timed)
        above = [i for i, b in enumerate(self.candidates) if b > xs[-1]]
        if len(above) > 1:  # ... and beyond that along the last segment (between timed trees where two are)
            trees = xs > 0
            last = (xs[trees][-2:], ys[trees][-2:]) if trees.sum() >= 2 else (xs[-2:], ys[-2:])
            slope = max((last[1][-1] - last[1][0]) / (last[0][-1] - last[0][0]), 0.0) if len(last[0]) == 2 else 0.0
            out[above[1:]] = ys[-1] + slope * (sizes[above[1:]] - xs[-1])
        below = [i for i, b in enumerate(self.candidates) if b < xs[0]]
        if below and len(xs) >= 2:  # no plain decoding timed below (a ladder): along the first segment
            slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
            out[below] = np.maximum(ys[0] - slope * (xs[0] - sizes[below]), 0.5 * ys[0])
        if self.plain and 0 not in timed:
            out[0] = np.nan
        return out

    # -- choosing
    def next_budget(self, rows: int = 1, call: CallAcceptance | None = None) -> int:
        """The next step's budget for `rows` active rows, by the `call`'s acceptance (`CallAcceptance`)."""
        with self.lock:
            state = self.buckets.setdefault(batch_bucket(rows), _Bucket())
            if self.plain and state.median(0) is None:  # plain decoding is timed once first
                return 0
            prices = self.prices(rows)
            if np.isnan(prices[1:]).all():
                return self._first_tree()
            observed, bound = self._estimates(self.candidates, call)
            expected = self._lower_bounds(observed)
            tps = (1.0 + expected) / prices
            state.choice = self.candidates[int(np.nanargmax(tps))]
            hope = np.where(np.isnan(bound), expected, bound)
            hoped = (1.0 + hope) / prices
            i = self.candidates.index(state.choice)
            hoped[i] = -np.inf
            if np.all(~np.isfinite(hoped)):
                return state.choice
            j = int(np.nanargmax(np.where(np.isfinite(hoped), hoped, np.nan)))
            per_token = prices[i] / (1.0 + expected[i])  # seconds per token at the choice
            pair = 2 if state.choice == 0 else 1  # a tree probed from plain decoding runs twice (`CallBudget`)
            floor = 5 * _PROBE_SHARE * prices[i]  # a probe at most every 5 steps
            hoped_loss = pair * max(prices[j] - (1.0 + hope[j]) * per_token, floor)
            if state.probe is None and state.credit >= hoped_loss:
                state.probe = (self.candidates[j], float(per_token), pair)
                return self.candidates[j]
            return state.choice

    def _first_tree(self) -> int:
        """A bucket's first tree: another bucket's choice of a tree, else `START`."""
        chosen = [s.choice for s in self.buckets.values() if s.choice]
        return min(chosen or [b for b in self.candidates if b], key=lambda b: abs(b - START))

    def call_budget(self, rows: int, shape: tuple) -> int:
        """The one tree size of every call of `shape` (a compiled graph each: rows, length bucket, compile options)
        that cannot change it per step (the static step): where the call is its shape's first, the choice of its
        rows' bucket (else of one row, else `START`); then the same for every later call of the shape, so no later
        call compiles a graph."""
        with self.lock:
            if shape not in self.held:
                chosen = self.buckets.get(batch_bucket(rows))
                self.held[shape] = chosen.choice if chosen is not None and chosen.choice is not None else self.choice
            return self.held[shape]


def ladder_around(size: int, sizes: Sequence[int] = LADDER) -> tuple[int, ...]:
    """The tree sizes a compiled call of a shape held at `size` may take per step: `size` and its neighbours on
    `sizes` (each a graph, compiled before the shape's first decode step)."""
    trees = sorted(set(int(s) for s in sizes if s > 0) | {int(size)})
    i = trees.index(size)
    return tuple(trees[max(i - 1, 0) : i + 2])


def wants_size_rule(head, requested) -> bool:
    """Whether a call's tree size is the size rule's: `dart_node_budget="auto"`, or none asked for on a head whose
    config has `node_budget=None` (tree and chain mode alike)."""
    return requested == "auto" or (requested is None and head.config.node_budget is None)


class CallBudget:
    """The node budget of one call's steps as the loop sees it: `next` before a step, `observe` after it, one call
    each. A fixed budget stays fixed. The cost-aware one is the policy's, each step timed whole by this call (from
    `next` to the host read of the step's lengths in `observe`), with this call's own acceptance counts
    (`CallAcceptance`). A call held at one tree size (`hold`: a fixed step of one size) feeds the policy its
    acceptance only; a fixed step's ladder of sizes takes its own policy (`use`). A tensor-parallel target takes the
    first rank's choice on every rank."""

    def __init__(self, policy: BudgetPolicy | None, fixed: int, target):
        self.policy, self.fixed, self.target = policy, fixed, target
        self.group = tensor_parallel_group(target) if policy is not None else None
        self.held = policy is None
        self.rows, self.started, self.previous, self.repeat = 0, 0.0, -1, None
        self.accepted = None if policy is None else CallAcceptance(len(policy.obs))  # this call's own counts

    @property
    def mode(self) -> str:
        return "fixed" if self.policy is None else "auto"

    def call_budget(self, rows: int, shape: tuple) -> int:
        """The one tree size of a call that cannot change it per step: the fixed one, or the policy's for the call's
        `shape` (`BudgetPolicy.call_budget`; a tensor-parallel target's every rank takes the first rank's)."""
        if self.policy is None:
            return self.fixed
        return shared_budget(self.group, self.policy.call_budget(rows, shape), self.target)

    def hold(self, budget: int) -> None:
        """Every step of the call runs `budget` (a fixed step of one tree size)."""
        self.fixed, self.held = budget, True

    def use(self, policy: BudgetPolicy) -> None:
        """The call's steps take `policy`'s sizes (a compiled call's ladder: `ladder_around`), by its own times."""
        self.policy, self.held, self.accepted = policy, False, CallAcceptance(len(policy.obs))

    def next(self, rows: int) -> int:
        """This step's node budget per row, for `rows` active rows."""
        if self.held:
            return self.fixed
        self.rows = rows
        if self.repeat is not None:  # a tree after plain steps runs again, timed
            budget, self.repeat = self.repeat, None
        else:
            budget = shared_budget(self.group, self.policy.next_budget(rows, self.accepted), self.target)
        self.started = self.policy.clock()
        return budget

    def observe(self, budget: int, trees: DraftTrees | None, step) -> None:
        """The step at `budget` ended: its trees and its `BatchAccepted` (host lengths, read only here; the accepted
        paths, or the static step's `ranks` read with its result)."""
        if self.policy is None:
            return
        lengths = step.lengths.tolist()
        if budget == 0:
            ranks = [()] * len(lengths)
        else:  # the static step read its ranks with its result; the eager one ranks its paths here
            ranks = path_ranks(trees.ranks(step.paths) if step.ranks is None else step.ranks, lengths)
        if self.held:
            self.policy.observe(len(lengths), budget, ranks, None)
            return
        # a tree after plain steps catches its head up: not timed, rerun (a fixed step's head never waits)
        steady = budget == 0 or self.previous > 0 or not self.policy.plain
        self.policy.observe(self.rows, budget, ranks, self.policy.clock() - self.started, self.accepted, priced=steady)
        self.previous, self.repeat = budget, None if steady else budget


class BudgetState:
    """The policies' memory across `generate` calls, one per (target, its dtype and device, prompt lookup on/off,
    sampling or greedy: sampling accepts less and its steps cost more, so each learns from its own calls).
    `head.budget_state`; `reset()` forgets."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sizes: Sequence[int] = LADDER):
        self.clock, self.sizes = clock, tuple(sizes)
        self.policies: dict[tuple, BudgetPolicy] = {}
        self._lock = threading.Lock()

    def policy(self, target, prompt_lookup: bool, sampled: bool = False, ladder: tuple | None = None) -> BudgetPolicy:
        """ladder: (sizes, shape) of a compiled call's step: a policy of its own over those sizes (no plain
        decoding), timed by that shape's steps."""
        text = target.config.get_text_config(decoder=True)
        shape = tuple(getattr(text, k, None) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
        key = (type(target).__name__, target.config._name_or_path, shape, str(target.dtype), str(target.device),
               bool(prompt_lookup), bool(sampled), ladder)
        with self._lock:
            if key not in self.policies:
                self.policies[key] = (BudgetPolicy(self.sizes, self.clock) if ladder is None else
                                      BudgetPolicy(ladder[0], self.clock, plain=False))
            return self.policies[key]

    def reset(self) -> None:
        self.policies.clear()

    def __len__(self) -> int:
        return len(self.policies)


_state_lock = threading.Lock()  # one `head.budget_state` however many calls start at once


def budget_policy(head, target, prompt_lookup: bool | None = None, state: BudgetState | None = None,
                  sampled: bool = False, ladder: tuple | None = None) -> BudgetPolicy:
    """The policy of (target, prompt lookup, sampling) in `state` (default: `head.budget_state`, attached on first
    use)."""
    if state is None:
        with _state_lock:
            if head.budget_state is None:
                head.budget_state = BudgetState()
            state = head.budget_state
    if not isinstance(state, BudgetState):
        raise TypeError(f"the budget state must be a dart_hf.core.budget.BudgetState, got {type(state).__name__}")
    return state.policy(target, head.config.prompt_lookup if prompt_lookup is None else prompt_lookup, sampled, ladder)

