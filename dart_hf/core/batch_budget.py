"""The node budget of a batched step (`dart_hf.core.loop`, more than one active row): the single-row policy's E[accepted | n] per row
(`dart_hf.core.budget`), over a step time modelled rather than timed per (rows, n),

    T(R, n) = s(n) * curve(R * (n + 1)) + R * D(n)

the verify of R rows x (n + 1) tokens priced as one row of as many tokens (measured within ~15-30% on a 2-core CPU,
`dart-hf calibrate --batch`, the error growing with R), s(n) the recent batched verifies' measured / predicted time
at n and this batch size R (the load now, and the curve's own error there; another batch size's where R was not
measured), D(n) each row's head forward + tree search as recent batched steps measured it. A tree
must promise `batch_margin` more than plain decoding. Without a curve (`dart-hf calibrate` not run) the curve is flat,
so s(n) is the measured verify time at n itself. Where phase times are not exact (CUDA without `dart_timing`), the
loop observes whole steps, which end in a host read, as s(n) alone (D = 0): the rule learns on every device.

Probes keep both sides measured: a drafting step while the rule says plain decoding (the acceptance is otherwise
never seen again), a plain step while it says draft. As for one row, a probe waits until `probe_share` of the
batched time since the last probe exceeds the probe's expected loss (at E alone: a batched step observes every
row's acceptance, so E firms up R times as fast as for one row); a drafting probe follows plain steps, so its
head catches up on every position since, and it is priced with that catch-up cost (so a large batch where drafting
does not pay probes rarely).

A call held at one tree size for all its steps (the static step, one compiled graph per size) is decided per call by
what such calls measured, not by this model (`held_budget`).
"""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

from .cost import nearest_size


class BatchTimes:
    """What batched steps measured, per candidate budget of `policy` (the `dart_hf.core.budget.BudgetPolicy` that
    owns it; imported by it): verify time / the curve's (and over all budgets), per-row drafting seconds (steady
    steps, and any drafting step), and the probes' pacing. Guarded by `policy.lock`."""

    def __init__(self, policy):
        self.policy = policy
        k, trees = policy.knobs, policy.candidates[1:]
        self.scale: dict[tuple[int, int], deque] = {}  # (rows, n): measured / curve verify times
        self.draft = {b: deque(maxlen=k.window) for b in trees}  # steady drafting steps
        self.draft_any = {b: deque(maxlen=k.window) for b in trees}  # any drafting step
        self.since_probe = 0.0  # seconds of batched steps at the rule's choice since the last probe
        self.probing = False

    def curve(self, tokens) -> np.ndarray:
        """The verify curve at `tokens`, or 1 without a curve (s(n) is then the measured time itself)."""
        curve = self.policy.curve
        return np.ones_like(np.asarray(tokens, dtype=float)) if curve is None else np.asarray(curve(tokens), float)

    def observe(self, rows: int, budget: int, tokens: int, verify_seconds: float, draft_seconds: float = 0.0,
                steady: bool = True) -> None:
        """A batched step of `rows` rows at `budget` nodes per row verified `tokens` tokens (rows x padded tree
        size) in `verify_seconds` and spent `draft_seconds` on all rows' head forwards and tree searches.
        steady: a tree right after a tree (the first tree after plain steps has its head catch up on every position
        since: dearer). Acceptance is observed per row through `BudgetPolicy.observe`."""
        n = min(self.policy.candidates, key=lambda b: abs(b - budget))
        if verify_seconds > 0 and tokens > 0:
            ratio = verify_seconds / max(float(self.curve(tokens)), 1e-9)
            self.scale.setdefault((rows, n), deque(maxlen=self.policy.knobs.batch_window)).append(ratio)
        if n > 0 and rows > 0:
            self.draft_any[n].append(draft_seconds / rows)
            if steady:
                self.draft[n].append(draft_seconds / rows)
        if not self.probing:
            self.since_probe += verify_seconds + draft_seconds

    def step_seconds(self, rows: int, catch_up: bool = False) -> np.ndarray:
        """T(rows, n) per candidate n: s(n) from the recent verifies of `rows` rows at n (of the nearest measured batch
        size where `rows` has none; a tree size without its own: the nearest measured tree size's, else all sizes';
        1 before any), D(n) the median per-row drafting of recent steady steps at the nearest measured n (without any
        steady step, or with `catch_up`: of any drafting step, catch-up included: dearer, never cheaper; 0 before
        any). n = 0: no drafting."""
        cands = self.policy.candidates
        sizes = {r for r, _ in self.scale}
        near = min(sizes, key=lambda r: abs(np.log(r / rows))) if sizes else None
        measured = {b: statistics.median(s) for (r, b), s in self.scale.items() if r == near}
        overall = statistics.median([x for (r, _), s in self.scale.items() if r == near for x in s]) if sizes else 1.0
        trees = [a for a in measured if a > 0]
        scale = np.array([measured[b] if b in measured else measured[nearest_size(trees, b)] if b and trees else overall
                          for b in cands])
        verify = scale * self.curve(rows * (np.asarray(cands, dtype=float) + 1))
        steady = {} if catch_up else {b: statistics.median(d) for b, d in self.draft.items() if d}
        seen = steady or {b: statistics.median(d) for b, d in self.draft_any.items() if d}
        draft = np.array([seen[nearest_size(seen, b)] if b > 0 and seen else 0.0 for b in cands])
        return verify + rows * draft


def batch_budget(policy, rows: int, drafting_only: bool = False) -> int:
    """The node budget per row of a batched step of `rows` rows: the candidate n with the most expected tokens per
    second, rows * (1 + E[accepted | n]) / T(rows, n) (module docstring). As the batch grows, each row's tree
    shrinks, down to plain decoding (n = 0) where drafting no longer pays; a tree must promise `batch_margin` (10%)
    more than plain decoding, as the model's times and E are each off by up to ~15%. Before any acceptance is known:
    `first_tree`. drafting_only: the best n > 0."""
    expected = _expected(policy)
    if expected is None:
        return first_tree(policy, rows)
    return _best(policy, rows * (1.0 + expected) / np.maximum(policy.batch_times.step_seconds(rows), 1e-9),
                 drafting_only)


def next_batch_budget(policy, rows: int, call=None) -> int:
    """This batched step's budget: `batch_budget`'s choice, or a probe of the other side (module docstring), by the
    `call`'s acceptance (`budget.CallAcceptance`). Call under `policy.lock`."""
    expected = _expected(policy, call)
    if expected is None:
        return first_tree(policy, rows)
    times, cands = policy.batch_times, policy.candidates
    seconds = times.step_seconds(rows)
    tps = rows * (1.0 + expected) / np.maximum(seconds, 1e-9)
    choice = _best(policy, tps)
    other = _best(policy, tps, drafting_only=True) if choice == 0 else 0
    i, j = cands.index(choice), cands.index(other)
    if other > 0:  # a drafting probe follows plain steps: priced with its head's catch-up
        seconds = times.step_seconds(rows, catch_up=True)
    at_choice = seconds[i] / (1.0 + expected[i])  # seconds per token per row at the choice
    loss = max(seconds[j] - (1.0 + expected[j]) * at_choice, policy.knobs.batch_margin * seconds[i])
    times.probing = times.since_probe * policy.knobs.probe_share > loss
    if times.probing:
        times.since_probe = 0.0
        return other
    return choice


class HeldTimes:
    """What calls held at one size measured, per row count (guarded by `policy.lock`): the step seconds of each held
    tree (each call's steps after its first, which may compile) and of plain decoding (transformers' own loop on the
    static cache, its steps after the first, one mean per call), the held calls since the last probe, and the row
    counts done trying sizes."""

    def __init__(self, window: int):
        self.window = window
        self.seconds: dict[tuple[int, int], deque] = {}  # (rows, size; 0: plain decoding) -> step seconds
        self.since_probe: dict[int, int] = {}
        self.settled: set[int] = set()  # row counts whose calls are done trying sizes (`held_settled`)

    def observe(self, rows: int, size: int, seconds: float) -> None:
        self.seconds.setdefault((rows, size), deque(maxlen=self.window)).append(seconds)

    def median(self, rows: int, size: int) -> float | None:
        measured = self.seconds.get((rows, size))
        return statistics.median(measured) if measured else None

    def trees(self, rows: int) -> list[int]:
        """The tree sizes timed at `rows` rows."""
        return sorted(size for r, size in self.seconds if r == rows and size > 0)


# the tree sizes a held call tries besides its first: each is a compiled graph, so a few, about 1.5x apart
HELD_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def held_budget(policy, rows: int) -> int:
    """The one tree size of a call of `rows` rows held at one size (the static step: each size is a compiled graph of
    its own), or 0: plain decoding for the whole call. Step times of compiled graphs are not the eager steps' the
    other rules model, so this rule goes by what held calls of as many rows measured (`HeldTimes`):
    1. the first tree (`_first_held`) until its steps are timed, then plain decoding once;
    2. the best timed tree, by tokens per second per row, (1 + E[accepted | n]) / step seconds (the size held so far
       unless another promises `batch_margin` more);
    3. a call at each of its neighbours on `HELD_LADDER` (above first: a larger tree's acceptance informs the smaller
       ones), once each (a compile each), so the held size moves to a faster one wherever a neighbour measured
       faster, and stops where both neighbours measured slower: a device's own kernels, not a model of them, pick
       the size (on one 2-core CPU a 4-node step took 93 ms where a 3-node one took 107); then no new size is tried
       for as many rows (`held_settled`);
    4. then that tree or plain decoding, whichever is faster (`_plain_or_tree`). Call under `policy.lock`."""
    times = policy.held_times
    if not times.trees(rows):
        return _first_held(policy, rows)
    if times.median(rows, 0) is None:
        return 0
    best, gain = _best_held(policy, rows)
    policy.held_sizes[rows] = best
    untried = [] if rows in times.settled else _untried(policy, rows, best)
    if not untried:
        times.settled.add(rows)
    return untried[0] if untried else _plain_or_tree(policy, rows, best, gain)


def held_settled(policy, rows: int) -> bool:
    """Whether held calls of `rows` rows are done trying sizes: their first tree, plain decoding and the best tree's
    neighbours are timed. Once they are, no new size is tried for as many rows (a new process compiles its sizes in
    its first calls, never in a later one; the choice stays among the timed sizes and plain decoding). Call under
    `policy.lock` (or with no call running)."""
    times = policy.held_times
    if rows not in times.settled and times.trees(rows) and times.median(rows, 0) is not None:
        if not _untried(policy, rows, _best_held(policy, rows)[0]):
            times.settled.add(rows)
    return rows in times.settled


def _best_held(policy, rows: int) -> tuple[int, float]:
    """The timed tree of held calls of `rows` rows with the most tokens per second per row, (1 + E[accepted | n]) /
    step seconds, and its gain over plain decoding's 1 / step seconds. The size held so far stays unless another
    promises `batch_margin` more: sizes within the step times' noise of each other would otherwise trade places from
    call to call, and each move tries the new size's untimed neighbours (a compile each)."""
    times = policy.held_times
    trees, plain = times.trees(rows), times.median(rows, 0)
    gains = {n: (1.0 + e) * plain / times.median(rows, n) for n, e in zip(trees, _expected_at(policy, trees))}
    best, held = max(gains, key=gains.get), policy.held_sizes.get(rows)
    if held in gains and gains[best] < (1.0 + policy.knobs.batch_margin) * gains[held]:
        best = held
    return best, gains[best]


def _untried(policy, rows: int, tree: int) -> list[int]:
    """The neighbours of `tree` (`held_neighbours`) no held call of `rows` rows has timed."""
    timed = policy.held_times.trees(rows)
    return [n for n in held_neighbours(tree, policy.knobs.max_budget) if n not in timed]


def _first_held(policy, rows: int) -> int:
    """The first tree of held calls of `rows` rows: the one with the most expected tokens per second by the batch
    rule's model (one row is a batch of one), kept from the policy's previous held call of as many rows unless the
    new one promises `batch_margin` more. Before any acceptance is known: `first_tree`."""
    expected, previous = _expected(policy), policy.held_sizes.get(rows)
    if expected is None:
        choice = first_tree(policy, rows) if previous is None else previous
    else:
        cands = policy.candidates
        tps = rows * (1.0 + expected) / np.maximum(policy.batch_times.step_seconds(rows), 1e-9)
        choice = _best(policy, tps, drafting_only=True)
        if previous is not None and tps[cands.index(choice)] < (1.0 + policy.knobs.batch_margin) * tps[
                cands.index(previous)]:
            choice = previous
    policy.held_sizes[rows] = choice
    return choice


def held_neighbours(size: int, largest: int) -> list[int]:
    """The sizes of `HELD_LADDER` next to `size`, above first, each at least 1.25x apart from it (a 32-node tree
    is not worth a compile next to a 31-node one)."""
    above = [n for n in HELD_LADDER if 1.25 * size <= n <= largest][:1]
    below = [n for n in HELD_LADDER if 1.25 * n <= size][-1:]
    return above + below


def _plain_or_tree(policy, rows: int, tree: int, gain: float) -> int:
    """Plain decoding (0) or the held `tree`, whose measured tokens per second are `gain` times plain decoding's: the
    tree where it promises `batch_margin` more, as for a batch. The other side is probed now and then, as the one-row
    rule's probes are paced: a probe that loses a share L of a call runs once every L / `probe_share` calls (L at
    least `batch_margin`), so probes cost about `probe_share` of the time and acceptance keeps being observed while
    plain decoding is chosen."""
    times, knobs = policy.held_times, policy.knobs
    choice, other = (tree, 0) if gain >= 1.0 + knobs.batch_margin else (0, tree)
    loss = max((gain if choice else 1.0 / gain) - 1.0, knobs.batch_margin)
    calls = times.since_probe.get(rows, 0) + 1
    probe = calls * knobs.probe_share >= loss
    times.since_probe[rows] = 0 if probe else calls
    return other if probe else choice


def _best(policy, tps: np.ndarray, drafting_only: bool = False) -> int:
    """The candidate of the most tokens per second `tps` (a tree only where it beats plain decoding by
    `batch_margin`; drafting_only: the best tree)."""
    if drafting_only:
        tps = tps.copy()
        tps[0] = -np.inf
    best = int(np.argmax(tps))
    if best > 0 and tps[best] < (1.0 + policy.knobs.batch_margin) * tps[0]:
        return 0
    return int(policy.candidates[best])


def first_tree(policy, rows: int) -> int:
    """The tree of a batched step before any acceptance is known: the largest candidate whose batched verify is no
    wider than the single-row rule's first tree (the largest), so that a large batch does not pay rows x 96 tokens
    to learn what a smaller tree accepts (its acceptance informs every smaller one)."""
    fits = [b for b in policy.candidates[1:] if rows * (b + 1) <= policy.largest + 1]
    return fits[-1] if fits else policy.candidates[1]


def _expected(policy, call=None) -> np.ndarray | None:
    """E[accepted | n] per candidate (`_lower_bounds`), for `call`; None before any tree was observed."""
    expected = policy.expected_accepted(call)
    return None if np.isnan(expected[1:]).all() else _lower_bounds(expected)


def _expected_at(policy, sizes) -> np.ndarray:
    """E[accepted | n] at ascending `sizes` (`_lower_bounds`)."""
    return _lower_bounds(policy.expected_at(sizes))


def _lower_bounds(expected: np.ndarray) -> np.ndarray:
    """`expected` (at ascending sizes) with a tree larger than any observed taking the largest observed one's (a
    lower bound: a larger tree holds the smaller one); nan below every observed size."""
    known = ~np.isnan(expected)
    last = np.maximum.accumulate(np.where(known, np.arange(len(expected)), -1))
    return np.where(last >= 0, expected[np.maximum(last, 0)], np.nan)


__all__ = ["BatchTimes", "HELD_LADDER", "HeldTimes", "batch_budget", "first_tree", "held_budget", "held_neighbours",
           "held_settled", "next_batch_budget"]
