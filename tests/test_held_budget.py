"""A cost-aware static call (the fixed-shape step: each tree size is a compiled graph of its own): its shape takes the
size rule's choice at the shape's first call and keeps it for every later call, its steps choosing among that size
and its ladder neighbours (`ladder_around`: no later call compiles a graph), and its steps feed the rule their
acceptance (score ranks read with the step's result), as the dynamic step's do. Where the rule's choice for the
shape is plain decoding, the whole call is plain `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from conftest import left_padded, make_head, make_target
from dart_hf import DartStats
from dart_hf.core.budget import START, BudgetPolicy, BudgetState, ladder_around

pytestmark = pytest.mark.usefixtures("fresh_compiler_per_test")


class Recording(BudgetPolicy):
    """The policy of a `BudgetState` that records every acceptance it is fed (per step: budget, each row's ranks)
    and, when scripted, runs every eager step at one budget."""

    def __init__(self, script: int | None = None):
        super().__init__()
        self.script, self.seen = script, []

    def next_budget(self, rows: int = 1, call=None) -> int:
        return self.script

    def observe(self, rows, budget, ranks, seconds, call=None, priced=True) -> None:
        self.seen.append((budget, [list(r) for r in ranks]))
        super().observe(rows, budget, ranks, seconds, call, priced)


class OnePolicy(BudgetState):
    """A `BudgetState` whose every policy (a static shape's ladder too) is one `Recording`."""

    def __init__(self, policy: Recording):
        super().__init__()
        self.recording = policy

    def policy(self, target, prompt_lookup, sampled=False, ladder=None) -> BudgetPolicy:
        return self.recording


def recording_state(target, head, script: int | None = None, sampled: bool = False) -> tuple[BudgetState, Recording]:
    policy = Recording(script)
    return OnePolicy(policy), policy


@pytest.mark.parametrize("lengths", [[7], [5, 11, 3]])
def test_the_static_step_feeds_the_policy_the_acceptance_the_eager_step_would(lengths):
    """A cost-aware static call (uncompiled here: the same function the compiler captures) runs its shape's size
    (nothing known yet: `START`), equals plain `generate`, and feeds the rule the same score ranks per step and row as
    the eager step at that size."""
    target = make_target("llama")
    head = make_head(target, node_budget=None, tree_top_k=96, beam_width=32)
    ids, mask = left_padded(lengths, seed=3)
    gen = dict(attention_mask=mask, do_sample=False, max_new_tokens=24)
    state, static = recording_state(target, head, script=START)  # its ladder's steps: at START, as the eager ones
    stats = DartStats()
    out = target.generate(ids, assistant_model=head, cache_implementation="static", dart_budget_state=state,
                          dart_stats=stats, **gen)
    assert torch.equal(out, target.generate(ids, **gen))
    assert stats["static"] and stats["budget_mode"] == "auto" and stats["node_budget"] == START
    assert len(static.seen) == stats["steps"] and {b for b, _ in static.seen} == {START}
    assert all(1 <= len(rows) <= len(lengths) for _, rows in static.seen)  # (finished rows leave the count)

    eager_state, eager = recording_state(target, head, script=START)
    assert torch.equal(target.generate(ids, assistant_model=head, dart_budget_state=eager_state, **gen), out)
    # the last steps may differ: the eager trees stop at max_new_tokens, the static ones at the last position
    assert static.seen[:-2] == eager.seen[: len(static.seen) - 2] and len(static.seen) > 3


def test_a_static_shape_keeps_its_first_calls_size_while_the_rule_learns():
    """Through `generate`: a static call's shape (rows bucket, length bucket) takes the rule's one-row choice at its
    first call (its steps: that size's ladder); eager calls then teach the rule another choice; the same shape keeps
    its ladder (its graphs exist), a new length bucket takes the new choice."""
    target = make_target("llama")
    head = make_head(target, node_budget=None)
    ids, mask = left_padded([6], seed=2)
    state = BudgetState()
    policy = state.policy(target, head.config.prompt_lookup, False)
    gen = dict(attention_mask=mask, do_sample=False, max_new_tokens=10, dart_budget_state=state)
    stats = DartStats()
    target.generate(ids, assistant_model=head, cache_implementation="static", dart_stats=stats, **gen)
    ladder = set(ladder_around(START))
    assert set(stats.node_budgets) <= ladder and stats.static
    policy.buckets.clear()
    policy.observe(1, 0, [()], 0.01)  # plain decoding timed, the first tree dearer: the rule's choice is 0
    policy.observe(1, 3, [[]], 0.05)
    assert policy.next_budget(1) == 0 and policy.choice == 0
    target.generate(ids, assistant_model=head, cache_implementation="static", dart_stats=stats, **gen)
    assert set(stats.node_budgets) <= ladder and stats.static
    target.generate(ids, assistant_model=head, cache_implementation="static", dart_stats=stats,
                    **{**gen, "max_new_tokens": 300})  # another length bucket: a graph of its own, the new choice
    assert stats.node_budget == 0 and stats.static_reason.startswith("plain decoding for the call")


def test_a_static_calls_steps_move_on_its_ladder_by_their_own_times():
    """The ladder's policy times the fixed-shape steps (a fake clock: every step one second whatever its size, as on
    a GPU whose verify costs about the same up to dozens of tokens): within one call the steps take more than one of
    the ladder's sizes (its probes), never another size, never plain decoding, and the text is plain `generate`'s."""
    import itertools

    target = make_target("llama")
    head = make_head(target, node_budget=None)
    ticks = itertools.count()
    state = BudgetState(clock=lambda: float(next(ticks)))
    ids, mask = left_padded([6, 9], seed=4)
    gen = dict(attention_mask=mask, do_sample=False, max_new_tokens=40, eos_token_id=None)
    stats = DartStats()
    out = target.generate(ids, assistant_model=head, cache_implementation="static", disable_compile=True,
                          dart_budget_state=state, dart_stats=stats, **gen)
    assert torch.equal(out, target.generate(ids, **gen))
    assert stats.static and stats.budget_mode == "auto"
    assert set(stats.node_budgets) <= set(ladder_around(START)) and len(set(stats.node_budgets)) >= 2, \
        stats.node_budgets


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
    """Where the rule's choice for a static call's shape is plain decoding, the call is transformers' own loop: plain
    `generate`'s tokens, stream and, sampled, its text for the seed and the RNG after it; the stats say so."""
    target = make_target("llama")
    head = make_head(target, node_budget=None)
    ids, mask = left_padded(lengths, seed=5)
    gen = dict(attention_mask=mask, do_sample=do_sample, max_new_tokens=16, eos_token_id=None)
    state = BudgetState()
    policy = state.policy(target, head.config.prompt_lookup, do_sample)
    for rows in {1, len(lengths)}:  # plain decoding timed, a tree far dearer: the choice is plain decoding
        bucket = 1 if rows == 1 else 4
        policy.observe(bucket, 0, [()] * bucket, 0.01)
        policy.observe(bucket, 3, [[]] * bucket, 0.05)
        assert policy.next_budget(bucket) == 0
    stats, stream, plain_stream = DartStats(), Collect(), Collect()
    torch.manual_seed(1)
    out = target.generate(ids, assistant_model=head, cache_implementation="static", dart_budget_state=state,
                          dart_stats=stats, streamer=stream, **gen)
    rng = torch.get_rng_state()
    torch.manual_seed(1)
    plain = target.generate(ids, streamer=plain_stream, **gen)
    assert torch.equal(out, plain)
    assert stream.chunks == plain_stream.chunks and torch.equal(rng, torch.get_rng_state())
    assert stats.static_reason.startswith("plain decoding for the call") and stats.budget_mode == "auto"
    assert stats.new_tokens == 16 and stats.steps == 15 and set(stats.node_budgets) == {0}


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
