"""Batch-size buckets of the static step (`drafter.batch_bucket`): a batch is held at the next power of two rows (the
extra rows masked copies of the first), so batches of nearby sizes run one compiled graph, and every real row still
equals plain batched `generate`."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import dart_hf
from conftest import compile_config, left_padded, make_head, make_target
from dart_hf.core.drafter import batch_bucket


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]


@pytest.fixture(scope="module")
def qwen3():
    target = make_target("qwen3")
    return target, make_head(target)


def test_batches_of_three_and_four_share_one_graph_and_equal_plain(qwen3):
    target, head = qwen3
    kw = dict(do_sample=False, max_new_tokens=20)
    dart = dict(assistant_model=head, dart_node_budget=4, cache_implementation="static",
                compile_config=compile_config())
    stats = dart_hf.DartStats()
    ids, mask = left_padded((7, 3, 12, 5), seed=70)
    target.generate(ids, attention_mask=mask, dart_stats=stats, **kw, **dart)
    assert stats.compiled and stats.static
    graphs = counters["stats"]["unique_graphs"]
    for lengths, seed in (((7, 3, 12), 71), ((4, 9, 6), 72), ((2, 8, 5, 6), 73)):
        ids, mask = left_padded(lengths, seed=seed)
        out = target.generate(ids, attention_mask=mask, dart_stats=stats, **kw, **dart)
        assert torch.equal(out, target.generate(ids, attention_mask=mask, **kw)), lengths
    assert counters["stats"]["unique_graphs"] == graphs, "a batch of 3 was captured apart from the batch of 4"


def test_a_sampled_batch_of_three_draws_what_eager_plain_decoding_draws(qwen3):
    """The bucket's extra row takes no seed of its own from the call: the three rows' texts are the budget-0 (plain
    decoding, eager) texts of the seed."""
    target, head = qwen3
    ids, mask = left_padded((5, 9, 3), seed=74)
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=24)
    torch.manual_seed(5)
    ref = target.generate(ids, assistant_model=head, dart_node_budget=0, **kw)
    torch.manual_seed(5)
    stats = dart_hf.DartStats()
    out = target.generate(ids, assistant_model=head, dart_node_budget=4, cache_implementation="static",
                          disable_compile=True, dart_stats=stats, **kw)
    assert stats.static and stats.acceptance == "device"
    assert torch.equal(out, ref)
