"""A cost-aware call held at one tree size (the static step: each size is a compiled graph of its own): its size comes
from the batch rule's model at the call's rows, stays from call to call unless another size is clearly better, and
its steps feed the policy their acceptance (score ranks read with the step's result), as the eager step's do. Where
the held calls' own step times show that the tree does not pay, the whole call is plain decoding: plain `generate`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from conftest import informed_policy, left_padded, make_head, make_target
from dart_hf.core.batch_budget import batch_budget, first_tree, held_neighbours, held_settled
from dart_hf.core.budget import BudgetPolicy, BudgetState
from dart_hf.core.cost import VerifyCost, load_curve
from dart_hf import DartStats
from test_budget import write_curve

pytestmark = pytest.mark.usefixtures("private_cache", "fresh_compiler_per_test")


def test_a_held_call_takes_the_batch_rules_best_tree_for_its_rows_and_keeps_it_unless_another_is_clearly_better():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    curve = VerifyCost(sizes, [0.050 + 0.001 * n for n in sizes])  # CPU-like: each token adds 1 ms
    fresh = BudgetPolicy(curve, device_type="cpu")
    assert fresh.call_budget(1) == fresh.largest  # nothing known: the one-row rule's warm-up tree
    assert fresh.call_budget(8) == first_tree(fresh, 8) < fresh.largest  # ... a batch's no wider in all
    policy = informed_policy(curve)
    held = {rows: policy.call_budget(rows) for rows in (1, 4, 8, 32)}
    assert held == {rows: batch_budget(policy, rows, drafting_only=True) for rows in held}
    assert all(b > 0 for b in held.values()), held  # no held call timed yet: a tree (plain decoding: below)
    assert list(held.values()) == sorted(held.values(), reverse=True) and held[1] > held[32], held
    # the previous call's size stays unless the best promises batch_margin (10%) more tokens per second
    tps = 4 * (1 + policy.expected_accepted()) / policy.batch_times.step_seconds(4)
    best = policy.candidates.index(held[4])
    outcomes = set()
    for i, previous in enumerate(policy.candidates[1:], start=1):
        policy.held_sizes[4] = previous
        kept = bool(tps[best] < (1 + policy.knobs.batch_margin) * tps[i])
        assert policy.call_budget(4) == (previous if kept else held[4]), previous
        outcomes.add(kept and previous != held[4])
    assert outcomes == {True, False}  # both a close size kept and a clearly worse one replaced were seen


class Recording(BudgetPolicy):
    """The policy of a `BudgetState` that records every acceptance it is fed (one row's or a batch's) and, when
    scripted, runs every eager step at one budget."""

    def __init__(self, target, script: int | None = None):
        super().__init__(load_curve(target), device_type=target.device.type)
        self.script, self.seen = script, []

    def next_budget(self, rows: int = 1, call=None) -> int:
        return self.script

    def observe(self, budget, ranks=(), call=None) -> None:
        self.seen.append((budget, [list(ranks)]))
        super().observe(budget, ranks, call)

    def observe_rows(self, budget, ranks, call=None) -> None:
        self.seen.append((budget, [list(r) for r in ranks]))
        super().observe_rows(budget, ranks, call)


def recording_state(target, head, script: int | None = None) -> tuple[BudgetState, Recording]:
    state, policy = BudgetState(), Recording(target, script)
    state.policy(target, head.config.prompt_lookup, False)
    state.policies = dict.fromkeys(state.policies, policy)
    return state, policy


@pytest.mark.parametrize("lengths", [[7], [5, 11, 3]])
def test_the_static_step_feeds_the_policy_the_acceptance_the_eager_step_would(lengths):
    """A cost-aware static call (uncompiled here: the same function the compiler captures) runs the held size, equals
    plain `generate`, and feeds the policy the same score ranks per step and row as the eager step at that size."""
    target = make_target("llama")
    write_curve(target)  # candidates 0, 1, 3, 7
    head = make_head(target, node_budget=None, tree_top_k=96, beam_width=32)
    ids, mask = left_padded(lengths, seed=3)
    gen = dict(attention_mask=mask, do_sample=False, max_new_tokens=24)
    state, static = recording_state(target, head)
    stats = DartStats()
    out = target.generate(ids, assistant_model=head, cache_implementation="static", dart_budget_state=state,
                          dart_stats=stats, **gen)
    assert torch.equal(out, target.generate(ids, **gen))
    size = static.held_sizes[len(lengths)]
    assert stats["static"] and stats["budget_mode"] == "auto" and stats["node_budget"] == size
    assert size == (7 if len(lengths) == 1 else 1)  # nothing known yet: `first_tree` (3 rows x 2 nodes <= 8)
    assert len(static.seen) == stats["steps"] and {b for b, _ in static.seen} == {size}
    assert static.steps == stats["steps"] and np.nansum(static.expected_accepted()) > 0

    eager_state, eager = recording_state(target, head, script=size)
    assert torch.equal(target.generate(ids, assistant_model=head, dart_budget_state=eager_state, **gen), out)
    # the last steps may differ: the eager trees stop at max_new_tokens, the static ones at the last position
    assert static.seen[:-2] == eager.seen[: len(static.seen) - 2] and len(static.seen) > 3


# ------------------------------------------------------------------------------------------------ plain decoding
def held_calls(policy, step_seconds: dict[int, float], calls: int, rows: int = 1) -> list[int]:
    """`calls` held calls of `rows` rows, each reporting the step seconds `step_seconds` gives its size."""
    sizes = []
    for _ in range(calls):
        sizes.append(policy.call_budget(rows))
        policy.observe_held(rows, sizes[-1], step_seconds[sizes[-1]])
    return sizes


def test_a_held_call_moves_to_the_neighbouring_size_its_device_runs_faster_and_stops_where_both_are_slower():
    """After the first tree and plain decoding are timed, one call at each untimed neighbour (on `HELD_LADDER`) of
    the best timed tree: the size follows the measured times (here a 4-node step cheaper than a 3-node one, as on a
    2-core CPU), never beyond a neighbour that measured slower, nor to one less than `batch_margin` better, and then
    stays."""
    policy = informed_policy(None)  # no curve: the first tree 3; E[accepted | 3] = 2.0 (and at least that above)
    times = {0: 0.020, 2: 0.040, 3: 0.040, 4: 0.030, 6: 0.045, 8: 0.030}  # 8 is fast, but past a slower 6
    sizes = held_calls(policy, times, 40)
    assert sizes[:4] == [3, 0, 4, 6], sizes  # above first; 4 is faster, so its neighbours: 6 (slower) and 3 (timed)
    assert policy.held_sizes[1] == 4 and set(sizes) == {0, 3, 4, 6}  # 2 (below a slower 3) and 8 never tried
    assert sizes[4:].count(4) > 30, sizes  # 3 tokens per 30 ms against 1 per 20 ms: the tree
    settling = informed_policy(None)
    assert [held_calls(settling, times, 1) and held_settled(settling, 1) for _ in range(5)] == [False] * 3 + [True] * 2
    assert held_settled(policy, 1) and not held_settled(policy, 2)  # the bench's warm-up repeats calls until settled
    for _ in range(policy.knobs.window):
        policy.observe_held(1, 6, 0.010)  # 6 nodes measured fast now: held from then on, and its neighbour 8 ...
    later = held_calls(policy, {**times, 6: 0.010}, 30)
    assert set(later) <= {0, 6} and later.count(6) > 25 and policy.held_sizes[1] == 6, later  # ... never tried
    slower = informed_policy(None)
    assert held_calls(slower, {0: 0.020, 2: 0.040, 3: 0.030, 4: 0.045}, 6) == [3, 0, 4, 2, 3, 3]  # both slower
    assert slower.held_sizes[1] == 3
    close = informed_policy(None)  # 4 nodes 4% faster: within the times' noise, so 3 stays (no walk past 4 to 6)
    assert held_calls(close, {0: 0.020, 2: 0.040, 3: 0.030, 4: 0.0288}, 6) == [3, 0, 4, 2, 3, 3]
    for size, neighbours in {3: [4, 2], 4: [6, 3], 31: [48, 24], 48: [64, 32], 64: [48], 1: [2]}.items():
        assert held_neighbours(size, 95) == neighbours, size


def test_a_held_call_goes_to_plain_decoding_where_its_measured_tree_does_not_pay_and_probes_the_other_side():
    """The held tree until its steps are timed, plain decoding once, its neighbours once, then the side with more
    tokens per second per row by the held calls' own step times (a tree needs `batch_margin` more), the other side
    probed once every loss / probe_share calls."""
    policy = informed_policy(None)  # no curve: candidates 0 and 3; E[accepted | 3] = 2.0, 3 tokens per tree step
    assert policy.candidates == [0, 3] and policy.call_budget(1) == 3  # the tree's steps are not timed yet
    policy.observe_held(1, 3, 0.030)  # 100 tokens/s
    assert policy.call_budget(1) == 0  # plain decoding is timed once
    cases = {0.012: (3, 0.2), 0.0105: (0, 0.1), 0.010: (0, 0.1), 0.060: (3, 5.0), 0.005: (0, 1.0)}
    for plain_step, (choice, loss) in cases.items():
        measured = informed_policy(None)
        calls = held_calls(measured, {0: plain_step, 2: 0.040, 3: 0.030, 4: 0.060}, 404)[4:]
        probes = sum(b != choice for b in calls)
        assert calls.count(choice) > 300 and set(calls) <= {0, 3}, (plain_step, calls[:20])
        assert abs(probes - 400 * measured.knobs.probe_share / loss) <= 1, (plain_step, probes)  # one in loss / share
    assert policy.call_budget(2) == 3  # each row count is measured apart


class Ticks:
    """A clock that advances one second per reading: a held tree step (read at its start and its end) takes 1 s, a
    plain call's steps share the 1 s between the clock's two readings."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.chunks.append("end")


@pytest.mark.parametrize("lengths", [[7], [5, 11, 3]])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_static_auto_call_handed_to_plain_decoding_is_plain_generate(lengths, do_sample):
    """The held rule's flow through `generate`: the first static call drafts (its steps after the first are timed),
    the second runs plain decoding (transformers' own loop: plain `generate`'s tokens, stream and, sampled, its text
    for the seed and the RNG after it), the next two the best tree's untried neighbours (4 nodes, then 6 or 2 as 4 or 3
    accepted more per equal step), then plain decoding, which the scripted clock makes the cheaper side."""
    target = make_target("llama")
    head = make_head(target, node_budget=None)
    ids, mask = left_padded(lengths, seed=5)
    gen = dict(attention_mask=mask, do_sample=do_sample, max_new_tokens=16, eos_token_id=None)
    state = BudgetState(clock=Ticks())
    policy = state.policy(target, head.config.prompt_lookup, do_sample)
    rows = len(lengths)
    budgets = []
    for call in range(6):
        stats, stream, plain_stream = DartStats(), Collect(), Collect()
        torch.manual_seed(call)
        out = target.generate(ids, assistant_model=head, cache_implementation="static", dart_budget_state=state,
                              dart_stats=stats, streamer=stream, **gen)
        rng = torch.get_rng_state()
        torch.manual_seed(call)
        plain = target.generate(ids, streamer=plain_stream, **gen)
        if not do_sample or stats.node_budget == 0:  # a drafting call samples with DART's own draws (README)
            assert torch.equal(out, plain), call
        if stats.node_budget == 0:
            assert stream.chunks == plain_stream.chunks and torch.equal(rng, torch.get_rng_state())
            assert stats.static_reason.startswith("plain decoding for the call") and stats.budget_mode == "auto"
            assert stats.new_tokens == 16 and stats.steps == 15 and set(stats.node_budgets) == {0}
        budgets.append(stats.node_budget)
        timed = {size: len(policy.held_times.seconds.get((rows, size), ())) for size in (budgets[0], 0)}
        if call == 0:
            assert timed == {budgets[0]: min(stats.steps - 1, policy.knobs.window), 0: 0}, timed  # not the first
    assert budgets[:3] == [3, 0, 4] and budgets[3] in (2, 6) and budgets[4:] == [0, 0], budgets
    assert policy.held_times.trees(rows) == sorted(budgets[:4])[1:] and timed[0] == 3 and policy.held_times.median(rows, 0) == pytest.approx(1.0 / 14)


def test_a_static_call_at_budget_zero_is_plain_generate():
    """Asked for, budget 0 on a static cache is plain static `generate` itself: tokens, scores, sampled text."""
    target = make_target("llama")
    head = make_head(target)
    ids, mask = left_padded([6, 9], seed=8)
    gen = dict(attention_mask=mask, do_sample=True, max_new_tokens=12)
    stats = DartStats()
    torch.manual_seed(3)
    out = target.generate(ids, assistant_model=head, cache_implementation="static", dart_node_budget=0,
                          dart_stats=stats, return_dict_in_generate=True, output_scores=True, **gen)
    torch.manual_seed(3)
    plain = target.generate(ids, cache_implementation="static", return_dict_in_generate=True, output_scores=True, **gen)
    assert torch.equal(out.sequences, plain.sequences) and len(out.scores) == len(plain.scores)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, plain.scores))
    assert stats.node_budget == 0 and stats.budget_mode == "fixed" and "node budget 0" in stats.static_reason
