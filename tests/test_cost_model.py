"""Cost-aware node budget: counterfactual acceptance, the chooser, the cost cache, and lossless auto decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

import dart_hf
from conftest import make_head, make_target, prompts
from dart_hf.core import budget as cost_model
from dart_hf.core.acceptance import accept_greedy
from dart_hf.core.budget import BudgetController, VerifyCost, accepted_for_budgets, path_ranks
from dart_hf.core.loop import _first_stop
from dart_hf.core.tree import TreeSearchParams, build_tree
from dart_hf.core.verify import compact_cache, verify_tree


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cost_model, "_MEMO", {})


def plain(target, ids, n):
    return target.generate(ids, do_sample=False, max_new_tokens=n)


def head_with_ngram(target, seed_prompts, **overrides):
    """A random head with wide beams plus an n-gram of the target's own text: multi-token acceptance happens,
    so the counterfactual is not trivially zero."""
    head = make_head(target, **{"tree_top_k": 96, "beam_width": 32, **overrides})
    seqs = [plain(target, p, 64)[0].tolist() for p in seed_prompts]
    head.ngram = dart_hf.NGramModel.build(seqs, order=3, vocab_size=target.config.vocab_size, progress=False)
    return head


# ---------------------------------------------------------------------------------------------------- counterfactual
def test_counterfactual_acceptance_equals_rebuilding_smaller_trees():
    """For every budget B' <= B, #{accepted path ranks < B'} equals the accepted length of the tree really rebuilt
    with budget B', verified by the target and accepted on (greedy). Draft logits: a noisy oracle of the target's
    own continuation, so accepted paths of many lengths (and cut-offs at every depth) occur."""
    target = make_target("llama")
    texts = prompts(3, seed=7)
    head = head_with_ngram(target, texts, tree_top_k=16, beam_width=6, draft_length=5)
    params = lambda b: TreeSearchParams.from_config(head.config, node_budget=b)
    budget, lengths, cut = 48, [], 0
    g = torch.Generator().manual_seed(0)
    for ids in texts:
        full = plain(target, ids, 80)[0]
        cache = DynamicCache(config=target.config)
        out = target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        seq = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        for _ in range(6):
            past, n = cache.get_seq_length(), seq.shape[1]
            draft = 2.0 * torch.randn(head.config.num_predictions, target.config.vocab_size, generator=g)
            depth = torch.arange(head.config.num_predictions)
            draft[depth, full[n + depth]] += 3.0  # row d predicts the token d + 1 places after the root
            kw = dict(root_token=seq[0, -1], context=seq[0, -8:], ngram=head.ngram)
            actual = []
            for b in range(1, budget + 1):  # each smaller tree really rebuilt, verified, accepted on
                small = build_tree(draft, params=params(b), **kw)
                small.check_closed()
                actual.append(accept_greedy(small, verify_tree(target, small, cache, past)).path.numel() - 1)
                cache.crop(past - cache.get_seq_length())
            tree = build_tree(draft, params=params(budget), **kw)
            acc = accept_greedy(tree, verify_tree(target, tree, cache, past))
            predicted = accepted_for_budgets(path_ranks(tree, acc.path).tolist(), range(1, budget + 1))
            assert predicted.tolist() == actual
            assert actual[-1] == acc.path.numel() - 1
            lengths.append(actual[-1])
            cut += actual[0] < actual[-1]
            compact_cache(cache, past, acc.path)
            seq = torch.cat([seq, acc.tokens.view(1, -1)], dim=1)
        assert torch.equal(seq[0], full[: seq.shape[1]])  # the steps decoded the target's own greedy text
    assert len(set(lengths)) >= 3 and max(lengths) >= 3 and cut >= 3, (lengths, cut)


# ---------------------------------------------------------------------------------------------------- chooser
def feed(controller: BudgetController, increments: np.ndarray, cost, overhead: float, steps: int = 200):
    """Deterministic (stratified) observations at the largest budget: rank r is on the path in a fraction
    increments[r] of the steps, so E[accepted | B] = sum(increments[:B])."""
    b = controller.max_budget
    for i in range(steps):
        ranks = np.nonzero((i + 0.5) / steps < increments[:b])[0]
        controller.observe(ranks, b, step_seconds=overhead + float(cost(b + 1)))


def analytic_best(candidates, increments, cost, overhead):
    tps = [(1 + increments[:b].sum()) / (overhead + float(cost(b + 1))) for b in candidates]
    return candidates[int(np.argmax(tps))]


@pytest.mark.parametrize(
    "name, seconds, expect",
    [
        # CPU-like (SmolLM2-135M fp32 measured curve): verify grows fast, small trees pay
        ("cpu", [0.086, 0.095, 0.115, 0.135, 0.162, 0.185, 0.211, 0.245, 0.281, 0.36], "small"),
        # GPU-like: flat until ~64 tokens, then a knee
        ("gpu", [0.020, 0.020, 0.020, 0.0201, 0.0202, 0.0203, 0.0205, 0.021, 0.0215, 0.032], "large"),
    ],
)
def test_chooser_picks_the_best_budget_on_synthetic_curves(name, seconds, expect):
    cost = VerifyCost(sizes=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96], seconds=seconds)
    increments = 0.75 * 0.93 ** np.arange(95)  # E[accepted | B] saturating around 10.7
    controller = BudgetController(cost, half_life=1e12)  # no discounting: the stratified feed is exact
    assert controller.candidates.tolist() == [1, 3, 7, 15, 23, 31, 47, 63, 95]
    feed(controller, increments, cost, overhead=0.004)
    expected = analytic_best(controller.candidates.tolist(), increments, cost, 0.004)
    assert controller.best() == expected
    assert np.allclose(controller.expected_accepted(), [increments[:b].sum() for b in controller.candidates], atol=0.02)
    assert controller.overhead == pytest.approx(0.004, rel=1e-6)
    assert (expected <= 31) if expect == "small" else (expected >= 47)


def test_controller_explores_then_exploits_and_revisits_twice_its_choice():
    cost = VerifyCost(sizes=[1, 8, 64], seconds=[0.1, 0.12, 0.3])
    controller = BudgetController(cost, candidates=[4, 16, 40, 63], explore_steps=3, revisit_every=8)
    chosen = []
    for _ in range(40):
        b = controller.next_budget()
        chosen.append(b)
        controller.observe([0], b, step_seconds=0.01 + float(cost(b + 1)))  # only the best node is ever accepted
    assert chosen[:3] == [63, 63, 63]
    assert controller.best() == 4
    rest = chosen[3:]
    assert rest.count(4) > 25 and 63 not in rest and 40 not in rest  # revisits 16 = smallest >= 2 * 4 + 1
    gaps = np.diff([i for i, b in enumerate(chosen) if b > 4])
    assert gaps.max() <= 8 and 16 in rest


def test_statistics_from_mixed_budgets_stay_monotone():
    cost = VerifyCost(sizes=[1, 32, 96], seconds=[0.01, 0.011, 0.02])
    controller = BudgetController(cost, candidates=[8, 31, 95])
    controller.observe([0, 9, 40], 95)
    controller.observe([0, 3], 8)
    controller.observe([], 31)
    e = controller.expected_accepted()
    assert np.all(np.diff(e) >= 0)
    # rank 0: 2 of the 3 steps; rank 3: 1 of the 3 steps that saw budget >= 4; rank 9: 1 of the 2 steps that saw
    # budget >= 10; rank 40: 1 of 1 (up to the discount of older steps)
    assert e == pytest.approx([2 / 3 + 1 / 3, 2 / 3 + 1 / 3 + 1 / 2, 2 / 3 + 1 / 3 + 1 / 2 + 1], rel=1e-2)


# ---------------------------------------------------------------------------------------------------- cost cache
def test_cost_cache_is_written_once_and_reused(tmp_path, monkeypatch):
    target = make_target("llama")
    calls = []
    real = cost_model.measure_verify_cost

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sizes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_model, "measure_verify_cost", counting)
    first = cost_model.verify_cost(target, sizes=(1, 4, 8), repeats=1, verbose=False)
    files = list((tmp_path / "cache" / "cost").glob("*.json"))
    assert len(calls) == 1 and len(files) == 1 and first.path == str(files[0])
    data = json.loads(files[0].read_text())
    assert data["sizes"] == [1, 4, 8] and len(data["seconds"]) == 3 and all(s > 0 for s in data["seconds"])
    assert data["key"]["device"] == "cpu" and data["key"]["dtype"] == "float32"
    assert data["key"]["attn_implementation"] == "sdpa" and data["key"]["hidden_size"] == 64
    mtime = files[0].stat().st_mtime_ns

    monkeypatch.setattr(cost_model, "_MEMO", {})  # a new process: only the disk cache is left
    again = cost_model.verify_cost(target, sizes=(1, 4, 8), repeats=1, verbose=False)
    assert len(calls) == 1 and again.seconds == first.seconds and files[0].stat().st_mtime_ns == mtime
    assert cost_model.verify_cost(make_target("llama", seed=3), sizes=(1, 4, 8), verbose=False) is again

    # another attention implementation is another device configuration: measured and cached separately
    cost_model.verify_cost(make_target("llama", attn="eager"), sizes=(1, 4, 8), repeats=1, verbose=False)
    assert len(calls) == 2 and len(list((tmp_path / "cache" / "cost").glob("*.json"))) == 2


def test_cost_curve_interpolates_and_extrapolates():
    cost = VerifyCost(sizes=[1, 4, 16], seconds=[1.0, 1.3, 2.5])
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.1) and cost(10) == pytest.approx(1.9)
    assert cost(28) == pytest.approx(3.7)  # last segment's slope (0.1 per token)
    assert np.allclose(cost(np.array([4, 16])), [1.3, 2.5])


# ---------------------------------------------------------------------------------------------------- decoding
def test_auto_budget_decoding_is_lossless_and_reports_budgets():
    target = make_target("llama")
    texts = prompts(4, seed=7)
    head = head_with_ngram(target, texts, node_budget=None)
    chosen = []
    for i, ids in enumerate(texts):
        n = [40, 25, 60, 9][i]
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=n)
        assert torch.equal(out, plain(target, ids, n)), f"prompt {i}: auto budget changed the output"
        stats = head.stats
        assert stats["budget_mode"] == "auto" and len(stats["node_budgets"]) == stats["steps"]
        chosen += stats["node_budgets"]
    controller = cost_model.budget_controller(head, target)
    assert chosen[:4] == [controller.max_budget] * 4  # exploration first
    assert set(chosen) <= set(controller.candidates.tolist()) and len(set(chosen)) > 1
    assert head.stats["node_budget"] == controller.best() == head.node_budget_for(target)
    # "auto" on a head with a fixed budget, and the fixed budget still reported as before
    fixed = make_head(target, node_budget=12)
    ids = texts[0]
    assert torch.equal(target.generate(ids, assistant_model=fixed, do_sample=False, max_new_tokens=20,
                                       dart_node_budget="auto"), plain(target, ids, 20))
    assert fixed.stats["budget_mode"] == "auto"
    target.generate(ids, assistant_model=fixed, do_sample=False, max_new_tokens=5)
    assert fixed.stats["node_budget"] == 12 and fixed.stats["node_budgets"] == [12] * fixed.stats["steps"]
    with pytest.raises(ValueError, match="auto"):
        target.generate(ids, assistant_model=fixed, do_sample=False, max_new_tokens=5, dart_node_budget="big")


def test_auto_budget_chain_mode_and_sampling_are_lossless():
    target = make_target("qwen3")
    head = make_head(target, node_budget=None)
    ids = prompts(1, seed=2)[0]
    out = target.generate(ids, assistant_model=head, dart_mode="chain", do_sample=False, max_new_tokens=20)
    assert torch.equal(out, plain(target, ids, 20))
    torch.manual_seed(0)
    ref = target.generate(ids, do_sample=True, max_new_tokens=1)  # sampling runs; exactness is test_sampling's job
    out = target.generate(ids, assistant_model=head, do_sample=True, max_new_tokens=30)
    assert out.shape[1] <= ids.shape[1] + 30 and ref.shape[1] == ids.shape[1] + 1


# ---------------------------------------------------------------------------------------------------- hot path
@pytest.mark.parametrize("max_length", [9, 11, 14, 40])
def test_first_stop_fast_path_matches_token_by_token_check(max_length):
    g = torch.Generator().manual_seed(max_length)
    for _ in range(30):
        ids = torch.randint(0, 12, (1, 10), generator=g)
        criteria = StoppingCriteriaList([MaxLengthCriteria(max_length), EosTokenCriteria([3, 7])])
        n_new = int(torch.randint(1, 6, (1,), generator=g))
        slow = next((j for j in range(n_new) if criteria(ids[:, : 10 - n_new + j + 1], None).any()), None)
        assert _first_stop(ids, n_new, criteria, None) == slow
