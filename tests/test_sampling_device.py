"""Sampling on the device (`acceptance.accept_depthwise`, and `acceptance.accept_nodes` for processors that read the
scores alone on trees no wider than their depth): exact, fixed-shape, one host read per step, captured whole by the
static step.

Exactness is measured, not argued: thousands of rows, each with its own seed, walk the same tree over the same logits
in ONE call, and the tokens they draw are compared with the target's processed distributions by a chi-square test
whose threshold the test derives (the 99.9% quantile for the cells' degrees of freedom). The draws are deterministic
(seeded), so the test cannot flake; and two deliberately wrong rules (one draw shared between depths, a wrong
temperature) must fail the same check, which shows the test can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import (LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import dart_hf
from conftest import compile_config, left_padded, make_head, make_target, prompts, step_host_reads
from dart_hf.core import acceptance, step
from dart_hf.core.tree import DraftTrees, ancestor_mask

Z_999 = 3.090  # the standard normal's 99.9% quantile


def chi2_threshold(dof: int) -> float:
    """The chi-square distribution's 99.9% quantile (Wilson-Hilferty: accurate to a few tenths of a percent)."""
    return dof * (1 - 2 / (9 * dof) + Z_999 * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, its 99.9% threshold) of `counts` against `probs`; a count where the probability is 0 fails."""
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum() > 0:
        return math.inf, 0.0
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, chi2_threshold(int(keep.sum()) - 1)


# root (token 1) with children 2, 0, 5; node 1 (token 2) has children 3, 4
TOKENS, PARENTS = [1, 2, 0, 5, 3, 4], [0, 0, 0, 0, 1, 1]


def tree_rows(rows: int) -> DraftTrees:
    parents = torch.tensor(PARENTS)
    one = DraftTrees(torch.tensor([TOKENS]), parents[None], torch.tensor([[0, 1, 1, 1, 2, 2]]),
                     ancestor_mask(parents, 2)[None], torch.zeros(1, 6), torch.tensor([6]), depth=2)
    return DraftTrees(*(t.expand(rows, *t.shape[1:]) for t in (one.tokens, one.parents, one.depths,
                                                                one.ancestor_mask, one.scores, one.sizes)), depth=2)


SETTINGS = {
    "temperature": [TemperatureLogitsWarper(0.7)],
    "top_k": [TemperatureLogitsWarper(1.3), TopKLogitsWarper(4)],
    "top_p": [TemperatureLogitsWarper(0.9), TopPLogitsWarper(0.8)],
    "min_p": [MinPLogitsWarper(0.1)],
}


def walk(kind: str, trees, logits, m, processors, seeds, positions, keep_scores=False):
    """The device acceptance `kind`: "depthwise" (one pass per depth) or "nodes" (every node at once)."""
    if kind == "nodes":
        return acceptance.accept_nodes(trees, logits, m, processors, seeds, positions, keep_scores)
    return acceptance.accept_depthwise(trees, logits, m, processors, None, seeds, positions, keep_scores)


WALKS = ["depthwise", "nodes"]


def walk_counts(processors: LogitsProcessorList, rows: int = 20000, vocab: int = 8, kind: str = "depthwise"):
    """Counts of the first token, and of the second after the likely child 2, over `rows` seeded rows."""
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    logits[0, 2] += 1.5  # the first child is likely, so second tokens are drawn often
    step = walk(kind, tree_rows(rows), logits.expand(rows, -1, -1), 3, processors, torch.arange(rows),
                torch.full((rows,), 17))
    first = torch.bincount(step.tokens[:, 0], minlength=vocab).float()
    after_2 = step.tokens[(step.tokens[:, 0] == 2), 1]
    second = torch.bincount(after_2, minlength=vocab).float()
    exact = lambda node: torch.softmax(processors(torch.zeros(1, 0, dtype=torch.long), logits[node : node + 1]), -1)[0]
    return (first, exact(0)), (second, exact(1)), step


@pytest.mark.parametrize("kind", WALKS)
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_the_device_walk_draws_the_targets_distribution_at_every_depth(setting, kind):
    processors = LogitsProcessorList(SETTINGS[setting])
    for counts, probs in walk_counts(processors, kind=kind)[:2]:
        stat, limit = chi2(counts, probs)
        assert stat < limit, (setting, stat, limit)


@pytest.mark.parametrize("kind", WALKS)
@pytest.mark.parametrize("wrong", ["one draw shared between depths", "a wrong temperature"])
def test_a_wrong_sampling_rule_fails_the_same_check(monkeypatch, wrong, kind):
    right = acceptance.next_tokens
    if wrong == "one draw shared between depths":  # every depth drawn at the root's position
        rule = lambda processed, seeds, positions: right(processed, seeds, torch.full_like(positions, 17))
    else:
        rule = lambda processed, seeds, positions: right(processed * 1.25, seeds, positions)
    monkeypatch.setattr(acceptance, "next_tokens", rule)
    checks = walk_counts(LogitsProcessorList(SETTINGS["temperature"]), kind=kind)[:2]
    assert any(stat > limit for stat, limit in (chi2(c, p) for c, p in checks)), wrong


def uniforms_correlation(uniform, seeds: torch.Tensor, positions: range) -> float:
    """The root mean square of the correlations between the uniforms of every pair of `positions` over `seeds`."""
    u = torch.stack([uniform(seeds, torch.full_like(seeds, p)) for p in positions])
    corr = torch.corrcoef(u.double())
    return float(corr[~torch.eye(len(positions), dtype=torch.bool)].pow(2).mean().sqrt())


@pytest.mark.parametrize("seeds", ["drawn", "consecutive"])
def test_the_uniforms_of_a_rows_positions_are_independent(seeds):
    """A row's text is exact only if the draws at its positions are independent: over 400k seeds, the correlations of
    32 positions' uniforms must be as small as independent ones' (rms 1 / sqrt(n), within 30%), for seeds as
    `StepAcceptance.start` draws them and for consecutive ones. One round of mixing over (seed ^ position), a
    weaker hash, fails the same check."""
    n = 400_000
    given = (torch.randint(0, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(5)) if seeds == "drawn"
             else torch.arange(n))
    limit = 1.3 / math.sqrt(n)
    assert uniforms_correlation(acceptance.sampling_uniform, given, range(96, 128)) < limit
    one_round = lambda s, p: acceptance.sampling_uniform(s ^ p, torch.zeros_like(p))  # one round over s ^ p ^ const
    assert uniforms_correlation(one_round, given, range(96, 128)) > limit


@pytest.mark.parametrize("kind", WALKS)
def test_paths_follow_the_drawn_tokens_and_repeat_their_last_node(kind):
    step = walk_counts(LogitsProcessorList(SETTINGS["top_k"]), rows=512, kind=kind)[2]
    tokens, paths = torch.tensor(TOKENS), step.paths
    for r in range(512):
        n = int(step.lengths[r])
        assert paths[r, 0] == 0 and (paths[r, n:] == paths[r, n - 1]).all()
        # every node after the root carries the token drawn at its parent; the last draw left the tree
        assert torch.equal(tokens[paths[r, 1:n]], step.tokens[r, : n - 1])
        children = [j for j, p in enumerate(PARENTS) if j and p == int(paths[r, n - 1])]
        assert int(step.tokens[r, n - 1]) not in tokens[children].tolist()


def exact_marginals(target, ids: torch.Tensor, processors: LogitsProcessorList):
    """p(x1), p(x2) and p(x3) of plain ancestral sampling with `processors` (context-free), straight from the target."""
    proc = lambda logits: torch.softmax(processors(torch.zeros(logits.shape[0], 0, dtype=torch.long), logits), -1)
    with torch.no_grad():
        p1 = proc(target(ids).logits[:, -1])[0]
        vocab = p1.numel()
        two = torch.cat([ids.expand(vocab, -1), torch.arange(vocab).unsqueeze(1)], dim=1)
        p2_given = proc(target(two).logits[:, -1])
        three = torch.cat([two.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab).unsqueeze(1)], dim=1)
        p3_given = proc(target(three).logits[:, -1]).view(vocab, vocab, vocab)
    joint12 = p1.unsqueeze(1) * p2_given
    return p1, joint12.sum(0), torch.einsum("ab,abc->c", joint12, p3_given)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_sampled_batch_of_one_prompt_per_seed_follows_the_target(static):
    """400 rows of one prompt in ONE generate call (each row its own seed): the 2nd and 3rd tokens, drawn through the
    tree, follow plain ancestral sampling's marginals at temperature 0.9 / top-k 6."""
    target = make_target("llama", vocab_size=8, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.lm_head.weight.div_(4.0)  # a soft distribution: many outcomes
    head = make_head(target, tree_top_k=8, beam_width=4, node_budget=12)
    ids, rows = torch.tensor([[3, 5, 7, 1]]), 400
    marginals = exact_marginals(target, ids, LogitsProcessorList([TemperatureLogitsWarper(0.9),
                                                                   TopKLogitsWarper(6)]))
    torch.manual_seed(0)
    stats = dart_hf.DartStats()
    kw = dict(cache_implementation="static", disable_compile=True) if static else {}
    out = target.generate(ids.expand(rows, -1), assistant_model=head, do_sample=True, temperature=0.9, top_k=6,
                          max_new_tokens=3, dart_node_budget=12, dart_stats=stats, **kw)
    assert stats.acceptance == "device" and stats.static == static and stats.mean_accepted_length > rows
    for t in (1, 2):
        stat, limit = chi2(torch.bincount(out[:, 4 + t], minlength=8).float(), marginals[t])
        assert stat < limit, (t, stat, limit)


@pytest.mark.parametrize("penalty", [1.3, None], ids=["repetition_penalty", "scores_only"])
def test_every_budget_and_backend_draws_the_same_text_for_a_seed(penalty, monkeypatch):
    """The draw at a position does not depend on the tree: budgets 0 (plain decoding), 3, 12 and the static step at 3
    and 12, for a batch with min-p and a repetition penalty (the depthwise walk at every budget), or without it (the
    trees of 1 and 4 nodes drawn at every node at once, `accept_nodes`; those of 13, wider than their depth, walked
    depthwise: both kinds in play)."""
    target = make_target("llama", pad_token_id=0)
    head = make_head(target)
    ids, mask = left_padded((6, 9), seed=3)
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.8, repetition_penalty=penalty, min_p=0.05,
              max_new_tokens=24)
    widths = {"nodes": set(), "depthwise": set()}
    for kind in widths:
        def spy(trees, *args, _run=getattr(acceptance, f"accept_{kind}"), _kind=kind, **kwargs):
            widths[_kind].add(trees.width)
            return _run(trees, *args, **kwargs)
        monkeypatch.setattr(acceptance, f"accept_{kind}", spy)
    outs, stats = [], dart_hf.DartStats()
    static = dict(cache_implementation="static", disable_compile=True)
    for budget, extra in ((0, {}), (3, {}), (12, {}), (3, static), (12, static)):
        torch.manual_seed(7)
        outs.append(target.generate(ids, assistant_model=head, dart_node_budget=budget, dart_stats=stats, **kw,
                                    **extra))
        assert stats.acceptance == "device"
    assert stats.static
    assert all(torch.equal(o, outs[0]) for o in outs)
    if penalty:
        assert not widths["nodes"] and {1, 4, 13} <= widths["depthwise"], widths
    else:
        assert widths["nodes"] >= {1, 4} and 13 in widths["depthwise"] and max(widths["nodes"]) < 13, widths
    torch.manual_seed(8)
    assert not torch.equal(target.generate(ids, assistant_model=head, dart_node_budget=3, **kw), outs[0])


@pytest.fixture(scope="module")
def qwen3():
    target = make_target("qwen3")
    return target, make_head(target)


QWEN3_SAMPLING = dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)


def test_a_sampled_eager_step_reads_back_once(qwen3, monkeypatch):
    target, head = qwen3
    reads, _ = step_host_reads(monkeypatch, step.DartStep)
    stats = dart_hf.DartStats()
    torch.manual_seed(0)  # the rows' seeds: a text of 30 tokens (no early EOS), at most 7 a step
    target.generate(prompts(1, seed=60)[0], assistant_model=head, max_new_tokens=30, dart_node_budget=6,
                    repetition_penalty=1.1, dart_stats=stats, **QWEN3_SAMPLING)
    assert stats.acceptance == "device" and len(reads) >= 5
    assert all(r == ["tolist"] for r in reads), reads[:3]


def test_the_sampled_static_step_is_captured_whole_reads_back_once_and_is_not_recaptured(qwen3, monkeypatch):
    """Qwen3's default sampling settings on a left-padded batch: fullgraph=True, no new graph over 20+ steps of
    calls in one bucket, one host read per step, and the compiled text is the eager budget-0 text of the seed."""
    target, head = qwen3
    config = compile_config()
    kw = dict(dart_node_budget=4, cache_implementation="static", compile_config=config, **QWEN3_SAMPLING)
    ids, mask = left_padded((7, 3, 12, 5), seed=61)
    stats = dart_hf.DartStats()
    target.generate(ids, attention_mask=mask, assistant_model=head, max_new_tokens=8, dart_stats=stats, **kw)
    assert stats.compiled and stats.static and stats.static_reason is None
    graphs, steps = counters["stats"]["unique_graphs"], 0
    for seed, new in ((62, 30), (63, 36)):
        ids, mask = left_padded((7, 3, 12, 5), seed=seed)
        torch.manual_seed(seed)
        ref = target.generate(ids, attention_mask=mask, assistant_model=head, max_new_tokens=new,
                              dart_node_budget=0, **QWEN3_SAMPLING)
        torch.manual_seed(seed)
        out = target.generate(ids, attention_mask=mask, assistant_model=head, max_new_tokens=new, dart_stats=stats,
                              **kw)
        assert torch.equal(out, ref)
        steps += stats.steps
    assert steps >= 20
    assert counters["stats"]["unique_graphs"] == graphs, "a step was captured again (recompilation)"
    reads, _ = step_host_reads(monkeypatch, step.DartStep)
    target.generate(ids, attention_mask=mask, assistant_model=head, max_new_tokens=20, **kw)
    assert len(reads) >= 3 and all(r == ["tolist"] for r in reads), reads[:3]


def test_processors_off_the_device_walk_the_tree_per_row_and_draw_the_same_text(qwen3):
    """A custom processor takes the host walk ("walk"); the same scores as a built-in one give the same text."""
    from transformers import LogitsProcessor

    class Temperature(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores / 0.6

    target, head = qwen3
    ids, stats, outs = prompts(1, seed=64)[0], dart_hf.DartStats(), []
    for kw in (dict(temperature=0.6), dict(logits_processor=LogitsProcessorList([Temperature()]))):
        torch.manual_seed(3)
        outs.append(target.generate(ids, assistant_model=head, do_sample=True, top_k=0, max_new_tokens=24,
                                    dart_node_budget=6, dart_stats=stats, **kw))
    assert stats.acceptance == "walk" and torch.equal(outs[0], outs[1])


def test_a_repetition_penalty_counts_each_nodes_own_path():
    """Greedy with a repetition penalty (acceptance "device") equals plain greedy `generate` token for token: each
    depth's pass sees the row's text plus that node's path, left padding ignored as `generate` ignores it."""
    target = make_target("llama", pad_token_id=0)
    head = make_head(target)
    ids, mask = left_padded((5, 9), seed=5)
    stats = dart_hf.DartStats()
    for penalty in (1.5, 0.7):
        kw = dict(attention_mask=mask, do_sample=False, repetition_penalty=penalty, max_new_tokens=30)
        out = target.generate(ids, assistant_model=head, dart_node_budget=12, dart_stats=stats, **kw)
        assert stats.acceptance == "device"
        assert torch.equal(out, target.generate(ids, **kw))


def test_a_sampled_call_returns_the_cache_of_its_text():
    """The eager step keeps no slot past a step's longest path: a sampled one-row call returns the cache its text
    gives (budget 0: plain decoding, same seed, same text), not one with a hole per unused pass."""
    target = make_target("llama")
    head = make_head(target)
    ids = prompts(1, seed=9)[0]
    kw = dict(do_sample=True, temperature=0.9, max_new_tokens=30, return_dict_in_generate=True)
    outs = []
    for budget in (0, 12):
        torch.manual_seed(4)
        outs.append(target.generate(ids, assistant_model=head, dart_node_budget=budget, **kw))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    ref, got = outs[0].past_key_values, outs[1].past_key_values
    assert got.get_seq_length() == ref.get_seq_length() == outs[0].sequences.shape[1] - 1
    for a, b in zip(ref.layers, got.layers):
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)
