"""A cost-aware call held at one tree size (the static step: each size is a compiled graph of its own): its size comes
from the batch rule's model at the call's rows, stays from call to call unless another size is clearly better, and
its steps feed the policy their acceptance (score ranks read with the step's result), as the eager step's do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import informed_policy, left_padded, make_head, make_target
from dart_hf.core.batch_budget import batch_budget, first_tree
from dart_hf.core.budget import BudgetPolicy, BudgetState
from dart_hf.core.cost import VerifyCost, load_curve
from dart_hf import DartStats
from test_budget import write_curve

pytestmark = pytest.mark.usefixtures("private_cache")


def test_a_held_call_takes_the_batch_rules_best_tree_for_its_rows_and_keeps_it_unless_another_is_clearly_better():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    curve = VerifyCost(sizes, [0.050 + 0.001 * n for n in sizes])  # CPU-like: each token adds 1 ms
    fresh = BudgetPolicy(curve, device_type="cpu")
    assert fresh.call_budget(1) == fresh.largest  # nothing known: the one-row rule's warm-up tree
    assert fresh.call_budget(8) == first_tree(fresh, 8) < fresh.largest  # ... a batch's no wider in all
    policy = informed_policy(curve)
    held = {rows: policy.call_budget(rows) for rows in (1, 4, 8, 32)}
    assert held == {rows: batch_budget(policy, rows, drafting_only=True) for rows in held}
    assert all(b > 0 for b in held.values()), held  # never plain decoding: the held step has no such graph
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

    def next_budget(self, rows: int = 1) -> int:
        return self.script

    def observe(self, budget, ranks=()) -> None:
        self.seen.append((budget, [list(ranks)]))
        super().observe(budget, ranks)

    def observe_rows(self, budget, ranks) -> None:
        self.seen.append((budget, [list(r) for r in ranks]))
        super().observe_rows(budget, ranks)


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
