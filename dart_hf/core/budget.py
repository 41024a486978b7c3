"""Cost-aware node budget: per step, the budget B with the most expected tokens per second,
(1 + E[accepted | B]) / T(B), over {0} + {calibrated tree sizes - 1}; B = 0 is plain decoding (no head, no search).
Knobs: `BudgetKnobs`; the rule: `BudgetPolicy`; batched steps: `dart_hf.core.batch_budget`.

E[accepted | B], counterfactually: the budget-B' tree (B' < B) is the best B' nodes by score of the budget-B tree,
closed under ancestors, so it would have accepted #{path score ranks < B'} draft tokens (exact for greedy, an
estimate under sampling). Counts decay (`half_life` steps). A call leans on its own counts as they come
(`CallAcceptance`): acceptance depends on the text, so a chat call after a run of code calls must not draft on by
code's acceptance.

T(B): the median of this run's whole-step times at B in the last `window` steps (a load shows as it happens); for a
B that ran fewer than `probe_window` of them (run only as a probe), of its last `probe_window` times within `max_age`
steps (a time measured under another load expires): probes come one every few dozen steps, so a window of 9 would
price it for ~100 steps by the load it last ran under (a slow spell kept a 4-node tree priced 10% dear, and plain
decoding chosen, for ~50 steps). Which B is the choice does not change its price (`_recent`). An
untimed tree size is priced from the nearest timed one A through the verify curve (`dart_hf.core.cost`) at the
cheaper of T(A) + c(B + 1) - c(A + 1) and T(A) * c(B + 1) / c(A + 1): a load may add to every step or scale it,
and a price too cheap gets timed and corrected, while one too dear is never timed again. Plain decoding is timed,
never priced (its last times stand until a probe replaces them), and when no tree has recent times the older ones
stand.

Steps that are not the choice: the first `warmup_steps` run the largest candidate (it informs every smaller one);
plain decoding runs once; then probes, in turn the candidate above the choice, the runner-up tree and plain decoding
(the best tree when plain is the choice). A probe waits until `probe_share` of the time at the choice since the last
probe exceeds its expected loss, so close alternatives are probed often and clearly worse ones rarely. The loss is
priced optimistically, at E[accepted] plus `explore` standard errors: priced at E alone, a tree 10% ahead of plain
decoding whose first steps accepted little was probed so rarely that 7 of 20 simulated runs kept plain decoding to
the end (2 of 20 with the optimism; `test_budget.close_race`). Plain decoding
here is exactly the step plain `generate` runs (one token, the target's stock kernels), so the rule never prices
trees against a slower baseline.

One policy may serve several calls at once (threads sharing a head): its statistics are guarded by a lock, and each
thread times its own step.

Without a curve (`dart-hf calibrate` not run for this target, device, dtype and versions) the candidates are plain
decoding and one tree, `no_curve_budget` (CPU) or `no_curve_budget_gpu`, with a one-line hint (a `UserWarning` at the
user's own line, which Python's default filter shows once per line: no flag of ours).
A call held at one size (the static step) goes by its own measured times instead (`batch_budget.held_budget`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import transformers
from transformers import LogitsProcessor

from .batch_budget import BatchTimes, HeldTimes, held_budget, next_batch_budget
from .cost import VerifyCost, cost_file, cost_key, load_curve, nearest_size
from .distributed import shared_budget, tensor_parallel_group
from .stats import PhaseTimer
from .tree import DraftTrees


@dataclass
class BudgetKnobs:
    max_budget: int = 95  # largest candidate tree (nodes besides the root)
    warmup_steps: int = 3  # first steps of a policy, at the largest candidate
    probe_share: float = 0.01  # a probe's expected loss, as a share of the time since the last probe
    explore: float = 0.5  # a probe's loss is priced at E[accepted] + explore standard errors
    window: int = 9  # the last steps whose times price a budget (median)
    probe_window: int = 3  # ... or its last times, where fewer of those steps ran it (median)
    max_age: int = 64  # steps after which a step time expires
    half_life: float = 256.0  # steps; discount of the acceptance counts
    call_prior: float = 8.0  # a call's own tree steps (per row) that weigh as much as the shared counts
    no_curve_budget: int = 3  # the tree size without a calibrated curve, CPU
    no_curve_budget_gpu: int = 31  # ... on other devices (a verify costs about the same up to ~64 tokens)
    batch_window: int = 8  # recent batched steps whose verify time sets the curve's scale (median)
    batch_margin: float = 0.1  # a batch drafts only when a tree promises this much more than plain decoding


class CallAcceptance:
    """One call's own acceptance counts, beside its policy's shared ones: inc[b] / obs[b] as in `BudgetPolicy`, over
    the call's rows' tree steps, undiscounted. E[accepted | B] for the call blends the two per score rank, the shared
    rate weighing as `call_prior` of the call's steps (or as its own count, where that is smaller): before the call's
    first tree it is the shared estimate, after `call_prior` trees half the call's own. Why: acceptance depends on the
    text. On an Intel Xeon VM (family 6 model 167, 2 threads), sampled at T 0.7, a 3-node tree step took 1.8x a plain
    step and paid on HumanEval prompts but not on ShareGPT ones (0.55 draft tokens accepted); the shared counts, which
    every call feeds, change by half in 256 steps, so ShareGPT calls after HumanEval calls kept drafting by
    HumanEval's acceptance (0.87x plain decoding's speed against 0.98x for the same calls on a fresh policy)."""

    def __init__(self, size: int):
        self.inc, self.obs = np.zeros(size), np.zeros(size)


def path_ranks(ranks: torch.Tensor, lengths: Sequence[int]) -> list[list[int]]:
    """Per row, the score rank (0 = best non-root node) of every accepted draft node (the path without its root), in
    path order: `ranks` [rows, M - 1] (`DraftTrees.ranks` of paths whose first lengths[r] nodes are row r's) cut to
    each row's path. One host read for every row."""
    return [r[: n - 1] for r, n in zip(ranks.tolist(), lengths)]


class BudgetPolicy:
    """Chooses each step's node budget (see the module docstring). `clock`: seconds, for the step times."""

    def __init__(self, curve: VerifyCost | None, knobs: BudgetKnobs | None = None, device_type: str = "cpu",
                 clock: Callable[[], float] = time.perf_counter):
        self.curve, self.knobs, self.clock = curve, knobs or BudgetKnobs(), clock
        k = self.knobs
        if curve is None:
            trees = [k.no_curve_budget if device_type == "cpu" else k.no_curve_budget_gpu]
        else:
            trees = [n - 1 for n in curve.sizes if 2 <= n <= k.max_budget + 1] or [k.no_curve_budget]
        self.candidates = [0, *sorted(set(trees))]
        self.largest = self.candidates[-1]
        self.decay = 0.5 ** (1.0 / k.half_life)
        self._verify = {} if curve is None else dict(zip(self.candidates, curve(np.add(self.candidates, 1.0))))
        # every size up to max_budget: a held call may try sizes besides the candidates (`batch_budget.held_budget`)
        self.inc = np.zeros(k.max_budget + 1)  # inc[b]: (discounted) steps whose path held the node of rank b - 1
        self.obs = np.zeros(k.max_budget + 1)  # obs[b]: (discounted) steps whose budget was >= b
        self.times = {b: deque(maxlen=k.window) for b in self.candidates}
        self.batch_times = BatchTimes(self)  # what batched steps measured (`batch_budget`)
        self.steps = 0
        self.choice = self.largest
        self.lock = threading.RLock()  # calls in several threads may share this policy
        self._step = threading.local()  # each thread's step start (`start`)
        self._since_probe = 0.0  # seconds of steps at the choice since the last probe
        self._probing = False
        self._probe_turn = 0  # which probe comes next: above the choice, the runner-up, plain decoding
        self.held_sizes: dict[int, int] = {}  # rows -> the tree calls held at one size hold now (`held_budget`)
        self.held_times = HeldTimes(k.window)  # what calls held at one size measured (`batch_budget.held_budget`)

    # -- observing
    def start(self) -> None:
        """This thread's step begins (its time runs until this thread's `observe`)."""
        self._step.started = self.clock()

    def observe(self, budget: int, ranks: Sequence[int] = (), call: CallAcceptance | None = None) -> None:
        """The step at `budget` ended; `ranks`: its accepted path's score ranks (`path_ranks`; none at budget 0),
        counted for the policy and for the `call`."""
        started = getattr(self._step, "started", None)
        seconds = self.clock() - started if started is not None else None
        self._step.started = None
        with self.lock:
            self._record(budget, [ranks], seconds, call)

    def observe_batch(self, rows: int, budget: int, tokens: int, verify_seconds: float, draft_seconds: float,
                      steady: bool, ranks: Sequence[Sequence[int]], call: CallAcceptance | None = None) -> None:
        """A batched step ended: what it measured for the batch rule (`BatchTimes.observe`) and each row's acceptance
        (`observe_rows`)."""
        with self.lock:
            self.batch_times.observe(rows, budget, tokens, verify_seconds, draft_seconds, steady=steady)
        self.observe_rows(budget, ranks, call)

    def observe_rows(self, budget: int, ranks: Sequence[Sequence[int]], call: CallAcceptance | None = None) -> None:
        """A batched step at `budget` ended: every row's accepted path's score ranks (none at budget 0). Each row is an
        acceptance observation; the step counts once for the ages of the step times, and gives none (a batched step
        is not a single-row step time: `batch_budget` keeps what it measured)."""
        with self.lock:
            self._record(budget, ranks, None, call)

    def _record(self, budget: int, rows_ranks: Sequence[Sequence[int]], seconds: float | None,
                call: CallAcceptance | None = None) -> None:
        self.steps += 1
        if budget > 0:
            b = min(int(budget), len(self.obs) - 1)
            for ranks in rows_ranks:
                ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
                self.inc *= self.decay
                self.obs *= self.decay
                for counts in (self, call) if call is not None else (self,):
                    np.add.at(counts.inc, ranks[ranks < b] + 1, 1.0)
                    counts.obs[1 : b + 1] += 1.0
        if seconds is not None and budget in self.times:
            self.times[budget].append((self.steps, seconds))
            self._since_probe += 0.0 if self._probing else seconds

    def observe_held(self, rows: int, size: int, seconds: float) -> None:
        """A step of a call of `rows` rows held at `size` (0: plain decoding, a call's mean step) took `seconds`."""
        with self.lock:
            self.held_times.observe(rows, size, seconds)

    # -- estimates
    def expected_accepted(self, call: CallAcceptance | None = None) -> np.ndarray:
        """E[accepted draft tokens | B] per candidate (0 for plain decoding; nan where never observed), for `call`."""
        return self.expected_at(self.candidates, call)

    def expected_at(self, sizes: Sequence[int], call: CallAcceptance | None = None) -> np.ndarray:
        """E[accepted draft tokens | B] at each of `sizes` (0 for plain decoding; nan where never observed), blended
        with the `call`'s own counts (`CallAcceptance`)."""
        inc, obs = self.inc, self.obs
        if call is not None:
            prior = np.minimum(self.knobs.call_prior, obs) / np.maximum(obs, 1e-12)  # the shared counts, scaled
            inc, obs = prior * inc + call.inc, prior * obs + call.obs
        rate = np.divide(inc, obs, out=np.zeros_like(inc), where=obs > 0)
        sizes = np.asarray(sizes, dtype=np.int64)
        return np.where((obs[sizes] > 0) | (sizes == 0), np.cumsum(rate)[sizes], np.nan)

    def step_seconds(self) -> np.ndarray:
        """T(B) per candidate, as the module docstring says (nan: nothing to go by)."""
        fresh = {b: [(i, s) for i, s in self.times[b] if self.steps - i < self.knobs.max_age] for b in self.candidates}
        if not any(fresh[b] for b in self.candidates[1:]):  # no recent tree: older times stand
            fresh.update({b: list(self.times[b]) for b in self.candidates[1:]})
        if not fresh[0]:  # plain decoding's last times stand until a probe replaces them (it is never priced)
            fresh[0] = list(self.times[0])
        timed = {b: statistics.median(self._recent(t)) for b, t in fresh.items() if t}
        out = np.full(len(self.candidates), np.nan)
        for i, b in enumerate(self.candidates):
            if b in timed:
                out[i] = timed[b]
                continue
            trees = [a for a in timed if a > 0]
            if b > 0 and self.curve is not None and trees:
                a = nearest_size(trees, b)
                va, vb = self._verify[a], self._verify[b]
                out[i] = max(min(timed[a] + vb - va, timed[a] * vb / va if va > 0 else np.inf), 1e-6)
        return out

    def _recent(self, times: list[tuple[int, float]]) -> list[float]:
        """The times a budget is priced by: those of the last `window` steps, or where fewer than `probe_window` of
        its steps ran in them (a budget run only as a probe), its last `probe_window`. What the data holds decides,
        not which budget is the choice: priced by its last 9 times as the choice and by its last 3 otherwise, a
        budget's price changed with the choice itself, and on a 2-core CPU (sampling, the tree ~10% behind plain
        decoding) the choice flipped between plain decoding and a 3-node tree at every step for runs of 10 steps."""
        recent = [s for i, s in times if self.steps - i < self.knobs.window]
        return recent if len(recent) >= self.knobs.probe_window else [s for _, s in times[-self.knobs.probe_window:]]

    def tokens_per_second(self) -> np.ndarray:
        return (1.0 + self.expected_accepted()) / self.step_seconds()

    def best(self, tps: np.ndarray | None = None, drafting_only: bool = False) -> int:
        """The candidate with the most expected tokens per second (the largest before anything is known)."""
        tps = self.tokens_per_second() if tps is None else tps.copy()
        if drafting_only:
            tps[0] = np.nan
        return self.largest if np.all(np.isnan(tps)) else self.candidates[int(np.nanargmax(tps))]

    # -- choosing
    def next_budget(self, rows: int = 1, call: CallAcceptance | None = None) -> int:
        """The next step's budget, for one row (this rule) or a batch of `rows` (`batch_budget.next_batch_budget`), by
        the `call`'s acceptance (`CallAcceptance`)."""
        with self.lock:
            if rows > 1:
                return next_batch_budget(self, rows, call)
            if self.steps < self.knobs.warmup_steps:
                return self.largest
            e = self.expected_accepted(call)
            t = self.step_seconds()
            if np.isnan(t[0]):  # plain decoding is timed once before anything is chosen
                return 0
            tps = (1.0 + e) / t
            self.choice = self.best(tps)
            probe = self._probe(tps)
            i = self.candidates.index(probe)
            loss = t[i] - (1.0 + self._hope(probe, e[i])) / tps[self.candidates.index(self.choice)]  # beyond the choice
            self._probing = self._since_probe * self.knobs.probe_share > (float(loss) if np.isfinite(loss) else 0.0)
            if self._probing:
                self._since_probe = 0.0
                self._probe_turn += 1
                return probe
            return self.choice

    def call_budget(self, rows: int) -> int:
        """The tree size of a whole call of `rows` rows that cannot change it per step (the static step), or 0: plain
        decoding for the call (`batch_budget.held_budget`)."""
        with self.lock:
            return held_budget(self, rows)

    def _hope(self, budget: int, expected: float) -> float:
        """E[accepted | budget] plus `explore` standard errors, sqrt((1 + E) / n) over its n (discounted) observations
        (an accepted length's spread grows with its mean): an unlucky start must not space a tree's probes out. Plain
        decoding's 0 is exact; a tree never observed stays nan (probed at once)."""
        n = self.obs[budget]
        if budget == 0 or n <= 0:
            return expected
        return expected + self.knobs.explore * float(np.sqrt((1.0 + expected) / n))

    def _probe(self, tps: np.ndarray) -> int:
        """The budget of the next probe, in turn: the candidate above the choice (its acceptance shows only in trees
        at least as large), the runner-up tree (a curve measured under another load can be off by more than the
        candidates differ) and plain decoding (or the best tree)."""
        above = [b for b in self.candidates if b > self.choice]
        turns = [above[0]] if above and self.choice else []
        rest = tps.copy()
        rest[[0, self.candidates.index(self.choice)]] = np.nan
        runner_up = self.best(rest) if self.choice and not np.all(np.isnan(rest)) else None
        if runner_up is not None and runner_up not in above[:1]:
            turns.append(runner_up)
        turns.append(0 if self.choice else self.best(tps, drafting_only=True))
        return turns[self._probe_turn % len(turns)]


class CallBudget:
    """The node budget of one call's steps as the loop sees it: `next` before a step, `observe` after it, one call
    each. A fixed budget stays fixed. The cost-aware one is the policy's: one active row times whole steps
    (`BudgetPolicy.start` / `observe`); a batch feeds the batch rule its verify time and per-row drafting (CPU phase
    times are exact; where they are launch times, CUDA without `dart_timing`, the whole step up to its host read is
    the verify time and drafting 0, so the rule learns on every device). A call held at one tree size (`hold`: the
    static step) feeds the rules its acceptance, and its step times to the held-size rule only (compiled steps are not
    the eager steps the other rules price): each step after the call's first, which may compile, timed whole (it ends
    in the static step's one host read); a call handed to plain decoding reports its mean step (`observe_plain`). Each
    step's budget follows this call's own acceptance as it comes (`CallAcceptance`). A tensor-parallel target takes
    the first rank's choice on every rank."""

    def __init__(self, policy: BudgetPolicy | None, fixed: int, target, timer: PhaseTimer):
        self.policy, self.fixed, self.timer, self.target = policy, fixed, timer, target
        self.group = tensor_parallel_group(target) if policy is not None else None
        self.held = policy is None
        self.rows, self.started, self.drafted, self.drafted_before = 0, 0.0, 0.0, False
        self.call_rows, self.held_steps = 0, 0
        self.accepted = None if policy is None else CallAcceptance(len(policy.obs))  # this call's own counts

    @property
    def mode(self) -> str:
        return "fixed" if self.policy is None else "auto"

    def latest(self, budget: int) -> int:
        """The tree size in force at the end of the call (`DartStats.node_budget`): the one-row rule's choice, else
        the last step's budget."""
        return self.policy.choice if not self.held and self.rows == 1 else budget

    def call_budget(self, rows: int) -> int:
        """The one tree size of a call of `rows` rows that cannot change it per step: the fixed one, or the policy's
        (`BudgetPolicy.call_budget`; a tensor-parallel target's every rank takes the first rank's)."""
        self.call_rows = rows
        return self.fixed if self.policy is None else shared_budget(self.group, self.policy.call_budget(rows),
                                                                    self.target)

    def hold(self, budget: int) -> None:
        """Every step of the call runs `budget` (the static step's one tree size)."""
        self.fixed, self.held = budget, True

    def next(self, rows: int) -> int:
        """This step's node budget per row, for `rows` active rows."""
        if self.held:
            self.started = self.policy.clock() if self.policy is not None else 0.0
            return self.fixed
        self.rows = rows
        budget = shared_budget(self.group, self.policy.next_budget(rows, self.accepted), self.target)
        self.started, self.drafted = self.policy.clock(), self._drafting()
        if rows == 1:
            self.policy.start()
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
            self.policy.observe_rows(budget, ranks)  # (the held-size rule decides per call: no call counts)
            if self.held_steps:
                self.policy.observe_held(self.call_rows, budget, self.policy.clock() - self.started)
            self.held_steps += 1
        elif self.rows == 1:
            self.policy.observe(budget, ranks[0], self.accepted)
        elif self.timer.exact:
            self.policy.observe_batch(self.rows, budget, trees.tokens.numel(), self.timer.last["verify"],
                                      self._drafting() - self.drafted, self.drafted_before, ranks, self.accepted)
        else:
            self.policy.observe_batch(self.rows, budget, trees.tokens.numel(), self.policy.clock() - self.started,
                                      0.0, self.drafted_before, ranks, self.accepted)
        self.drafted_before = budget > 0

    @property
    def clock(self) -> Callable[[], float]:
        """The policy's clock (seconds), or `time.perf_counter` for a fixed budget."""
        return time.perf_counter if self.policy is None else self.policy.clock

    def observe_plain(self, clock: "PlainStepClock") -> None:
        """The call ran plain decoding (transformers' own loop): its mean step time, for the held-size rule."""
        seconds = clock.step_seconds()
        if self.policy is not None and seconds is not None:
            self.policy.observe_held(self.call_rows, 0, seconds)

    def _drafting(self) -> float:
        """Seconds spent so far on head forwards and tree searches (the drafter times its phases into `timer`)."""
        return self.timer.totals.get("draft", 0.0) + self.timer.totals.get("tree", 0.0)


class PlainStepClock(LogitsProcessor):
    """Times plain decoding's steps inside transformers' own loop, for the held-size rule (a call handed to plain
    decoding: `loop._plain_call`): a logits processor that returns the scores unchanged and notes each call, one per
    step after its forward. The clock starts at the second call, after the first decoding step (which may compile;
    the first call is the prefill's); on an accelerator that call and the end synchronise, once each, so the steps
    between are timed whole."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.calls, self.started, self.device = clock, 0, 0.0, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            self.device = scores.device
            _synchronize(self.device)
            self.started = self.clock()
        return scores

    def step_seconds(self) -> float | None:
        """Mean seconds of the steps after the second (None: fewer than two of them)."""
        if self.calls < 4:
            return None
        _synchronize(self.device)
        return (self.clock() - self.started) / (self.calls - 2)


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class BudgetState:
    """The policies' memory across `generate` calls, one per (target configuration, prompt lookup on/off, sampling
    or greedy: sampling accepts less and its steps cost more, so each learns from its own calls): a fresh policy pays
    its warm-up at the largest tree again. `head.budget_state`; `reset()` forgets."""

    def __init__(self, knobs: BudgetKnobs | None = None, clock: Callable[[], float] = time.perf_counter):
        self.knobs, self.clock = knobs, clock
        self.policies: dict[tuple[str, bool, bool], BudgetPolicy] = {}
        self._lock = threading.Lock()

    def policy(self, target, prompt_lookup: bool, sampled: bool = False) -> BudgetPolicy:
        key = cost_key(target)
        name = (str(cost_file(key)), bool(prompt_lookup), bool(sampled))
        with self._lock:
            if name not in self.policies:
                curve = load_curve(target)
                if curve is None:
                    _warn_no_curve(key, target.device.type)
                self.policies[name] = BudgetPolicy(curve, self.knobs, target.device.type, self.clock)
            return self.policies[name]

    def reset(self) -> None:
        self.policies.clear()

    def __len__(self) -> int:
        return len(self.policies)


_state_lock = threading.Lock()  # one `head.budget_state` however many calls start at once


def _warn_no_curve(key: dict, device_type: str) -> None:
    """The one-line hint that no verify-cost curve exists, raised where a policy is made (a head's first call per
    target) and pointing at the user's own call (the first frame outside dart_hf, transformers, torch and
    contextlib), so Python's default filter shows it once per line of the user's code, and at an action that exists
    where this code runs (inside a head's `custom_generate/` copy there is no `dart-hf` command)."""
    fixed = BudgetKnobs.no_curve_budget if device_type == "cpu" else BudgetKnobs.no_curve_budget_gpu
    where, command = key["device_name"], "dart-hf calibrate <target folder or name>"
    if device_type == "cpu":  # a CPU curve serves one thread count (`cost_key`)
        where += " (a CPU curve serves one torch thread count)"
        command += f" --threads {torch.get_num_threads()}"
    fit = "to fit the tree size to this device" + (" and thread count" if device_type == "cpu" else "")
    action = (f"run `{command}` once {fit}" if (__package__ or "").startswith("dart_hf") else
              f"with dart_hf installed, `{command}` fits the tree size to this device")
    warnings.warn(f"dart_hf: no verify-cost curve for {key['name']} on {where}, so the node budget chooses between "
                  f"plain decoding and a tree of {fixed} nodes (a static-cache call also times its neighbouring "
                  f"sizes); {action}, or pass dart_node_budget=<n> for a fixed tree", stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel (1: `_warn_no_curve`) of the first frame outside this package, transformers,
    torch and contextlib: the user's own `generate` or pipeline call."""
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(here) if (__package__ or "").startswith("dart_hf") else here
    skip = (package, os.path.dirname(transformers.__file__), os.path.dirname(torch.__file__), contextlib.__file__)
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def budget_policy(head, target, prompt_lookup: bool | None = None, state: BudgetState | None = None,
                  sampled: bool = False) -> BudgetPolicy:
    """The policy of (target, prompt lookup, sampling) in `state` (default: `head.budget_state`, attached on first
    use)."""
    if state is None:
        with _state_lock:
            if head.budget_state is None:
                head.budget_state = BudgetState()
            state = head.budget_state
    if not isinstance(state, BudgetState):
        raise TypeError(f"the budget state must be a dart_hf.core.budget.BudgetState, got {type(state).__name__}")
    return state.policy(target, head.config.prompt_lookup if prompt_lookup is None else prompt_lookup, sampled)


__all__ = ["BudgetKnobs", "BudgetPolicy", "BudgetState", "CallAcceptance", "CallBudget", "PlainStepClock",
           "budget_policy", "path_ranks"]
