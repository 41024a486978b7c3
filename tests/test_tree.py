"""Beam search and tree encoding, checked against a plain-Python reading of the spec."""

from __future__ import annotations

import math

import pytest
import torch

from dart_hf import DartConfig, NGramModel
from conftest import check_closed
from dart_hf.core.tree import LOG_EPS, TreeSearchParams, ancestor_mask, build_tree


def reference_pool(logits, root, context, p: TreeSearchParams, ngram=None, eos=(), lookup=()):
    """docs/DART_SPEC.md §3, one candidate at a time: returns {path tuple: score} of every scored node, in pool
    order. `lookup`: the prompt-lookup continuation (a list of tokens), offered to the beam that holds its first d
    tokens. (tests/test_reference_fidelity.py holds build_tree against a port of the reference code itself.)"""
    k = min(p.top_k, logits.shape[1])
    beams = [((), 0.0)]
    pool = {}
    for d in range(logits.shape[0]):
        top, ids = logits[d].topk(k)
        logp = torch.log(torch.softmax(top, -1) + LOG_EPS)
        cands = []
        for path, score in beams:
            proposals = {}
            for j in range(k):
                x = int(ids[j])
                proposals[x] = p.logit_decay**d * float(logp[j])
                if ngram is not None and d > 0:
                    text = list(context) + list(path)
                    pr = float(ngram.prob(torch.tensor([text[-(ngram.order - 1) :]]), torch.tensor([[x]]))[0, 0])
                    proposals[x] += p.ngram_weight * math.log(pr + LOG_EPS)
            if d < len(lookup) and list(path) == list(lookup[:d]):  # lookup proposal: no n-gram term
                x = lookup[d]
                proposals[x] = max(proposals.get(x, -math.inf), p.logit_decay**d * p.lookup_logp)
            for x, incr in proposals.items():
                incr = (d + 1) ** -p.level_decay * incr
                pool[path + (x,)] = score + incr
                cands.append((path + (x,), score + incr))
        ranked = sorted(cands, key=lambda c: (c[0][-1] in eos, -c[1]))  # drafts ending in EOS after all others
        beams = ranked[: p.beam_width]
    return pool


def tree_paths(tree) -> dict[tuple, float]:
    out = {}
    for i in range(1, tree.size):
        nodes = tree.ancestor_mask[i].nonzero().squeeze(1).tolist()
        out[tuple(tree.tokens[nodes[1:]].tolist())] = float(tree.scores[i])
    return out


def test_lookup_candidates_follow_the_reference_beam_search():
    torch.manual_seed(4)
    logits = torch.randn(4, 30) * 3
    context = [5, 6, 7]
    ngram = NGramModel.build([torch.randint(0, 30, (200,)).tolist()], order=3, vocab_size=30, progress=False)
    top1 = int(logits[1].argmax())
    # a continuation whose second token is the head's own favourite there (merged, not duplicated) and whose other
    # tokens the head ranks low; valid for 3 of 4 depths
    outside = [int(t) for t in logits[0].argsort()[:1]] + [top1] + [int(t) for t in logits[2].argsort()[:1]]
    tokens, valid = torch.tensor(outside + [0]), torch.tensor([True, True, True, False])
    for logp in (-0.1, -3.0):
        p = TreeSearchParams(top_k=6, beam_width=3, node_budget=9, lookup_logp=logp)
        tree = build_tree(logits, torch.tensor(7), torch.tensor(context), p, ngram=ngram, lookup=(tokens, valid))
        pool = reference_pool(logits, 7, context, p, ngram, lookup=outside)
        best = dict(sorted(pool.items(), key=lambda kv: -kv[1])[: p.node_budget])
        got = tree_paths(tree)
        assert got.keys() == best.keys()
        assert all(abs(score - best[path]) < 1e-4 for path, score in got.items())
        siblings = list(zip(tree.parents[1:].tolist(), tree.tokens[1:].tolist()))
        assert len(siblings) == len(set(siblings)), "a token proposed by head and lookup must appear once"
        check_closed(tree)
        assert (tuple(outside) in got) == (logp == -0.1)  # a confident lookup chain makes the tree, whole
    no_match = build_tree(logits, torch.tensor(7), torch.tensor(context), p, ngram=ngram,
                          lookup=(tokens, torch.zeros(4, dtype=torch.bool)))
    plain = build_tree(logits, torch.tensor(7), torch.tensor(context), p, ngram=ngram)
    assert torch.equal(no_match.tokens, plain.tokens) and torch.equal(no_match.parents, plain.parents)


def test_tree_is_the_best_nodes_of_the_reference_beam_search():
    torch.manual_seed(0)
    logits = torch.randn(4, 30) * 3
    context = [5, 6, 7]
    seqs = [torch.randint(0, 30, (200,)).tolist()]
    ngram = NGramModel.build(seqs, order=3, vocab_size=30, progress=False)
    p = TreeSearchParams(top_k=6, beam_width=3, node_budget=12)
    tree = build_tree(logits, torch.tensor(7), torch.tensor(context), p, ngram=ngram)
    pool = reference_pool(logits, 7, context, p, ngram)
    best = dict(sorted(pool.items(), key=lambda kv: -kv[1])[: p.node_budget])
    got = tree_paths(tree)
    assert got.keys() == best.keys()
    for path, score in got.items():
        assert abs(score - best[path]) < 1e-4
    check_closed(tree)


def test_a_small_budget_tree_is_the_top_of_the_full_search():
    """build_tree narrows beams and depth to the budget (not top-k); the tree must still be exactly the best B nodes
    of the unnarrowed search (the cost model's counterfactual acceptance relies on it)."""
    torch.manual_seed(3)
    logits = torch.randn(8, 40) * 2
    logits[:, 20] = -100.0
    logits[:, 20] = logits.topk(9, dim=1).values[:, -1] - 0.01  # the head ranks 20 tenth, last of its top-10...
    # ... but in the corpus 20 follows every other token, so rescoring promotes it above the head's picks (every
    # token must occur in the corpus: a context never seen gives probability 0, there is no unigram level)
    corpus = torch.stack([torch.randint(0, 40, (2000,)), torch.full((2000,), 20)], 1).view(-1).tolist()
    ngram = NGramModel.build([corpus], order=3, vocab_size=40, progress=False)
    wide = TreeSearchParams(top_k=10, beam_width=8, node_budget=12)
    pool = reference_pool(logits, 7, [5, 7], wide, ngram)
    for budget in (1, 2, 3, 5, 8):
        p = TreeSearchParams(top_k=10, beam_width=8, node_budget=budget)
        tree = build_tree(logits, torch.tensor(7), torch.tensor([5, 7]), p, ngram=ngram)
        best = dict(sorted(pool.items(), key=lambda kv: -kv[1])[:budget])
        assert tree.size == budget + 1 and tree_paths(tree).keys() == best.keys()
        check_closed(tree)
    assert any(path[-1] == 20 for path in best)  # the promoted token made it into the small trees


def test_ngram_rescoring_promotes_the_continuation_the_corpus_knows():
    logits = torch.zeros(3, 10)
    logits[:, 3] = 2.0  # the head prefers token 3 at every depth
    logits[1, 8] = 1.0  # ... and 8 second at depth 2
    ngram = NGramModel.build([[1, 3, 8, 3, 8, 3, 8] * 20], order=3, vocab_size=10, progress=False)
    p = TreeSearchParams(top_k=4, beam_width=2, node_budget=3)
    without = tree_paths(build_tree(logits, torch.tensor(1), torch.tensor([1]), p))
    with_ngram = tree_paths(build_tree(logits, torch.tensor(1), torch.tensor([1]), p, ngram=ngram))
    assert (3, 3) in without and (3, 8) not in without
    assert (3, 8) in with_ngram  # "1 3 -> 8" is what the corpus says


def test_depth_one_uses_logits_only():
    logits = torch.randn(2, 12)
    ngram = NGramModel.build([[0, 1, 2, 3] * 10], order=2, vocab_size=12, progress=False)
    p = TreeSearchParams(top_k=5, beam_width=5, node_budget=5)
    a = build_tree(logits[:1], torch.tensor(0), torch.tensor([0]), p)
    b = build_tree(logits[:1], torch.tensor(0), torch.tensor([0]), p, ngram=ngram)
    assert torch.equal(a.tokens, b.tokens) and torch.allclose(a.scores, b.scores)


def test_eos_drafts_are_leaves():
    torch.manual_seed(1)
    logits = torch.randn(4, 20)
    logits[0, 9] = 10.0  # EOS is the head's favourite first token
    tree = build_tree(logits, torch.tensor(0), torch.tensor([0]), TreeSearchParams(top_k=5, beam_width=3, node_budget=30),
                      eos_token_ids=torch.tensor([9]))
    eos_nodes = (tree.tokens == 9).nonzero().squeeze(1)
    eos_nodes = eos_nodes[eos_nodes > 0]
    assert eos_nodes.numel() > 0
    assert not torch.isin(tree.parents[1:], eos_nodes).any()


def test_budget_depth_cap_and_encoding():
    torch.manual_seed(2)
    logits = torch.randn(6, 50)
    tree = build_tree(logits, torch.tensor(4), torch.tensor([4]), TreeSearchParams(node_budget=20), max_depth=3)
    assert tree.size == 21 and int(tree.depths.max()) <= 3 and tree.tokens[0] == 4
    check_closed(tree)
    # ancestor mask agrees with walking the parents
    for i in range(tree.size):
        chain, j = {i}, i
        while j != 0:
            j = int(tree.parents[j])
            chain.add(j)
        assert set(tree.ancestor_mask[i].nonzero().squeeze(1).tolist()) == chain


def test_ancestor_mask_small():
    parents = torch.tensor([0, 0, 0, 1, 3])
    m = ancestor_mask(parents, 3)
    assert m[4].nonzero().squeeze(1).tolist() == [0, 1, 3, 4]
    assert m[2].nonzero().squeeze(1).tolist() == [0, 2]


def test_draft_to_target_mapping_is_applied():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    d2t = torch.tensor([10, 20, 30])
    tree = build_tree(logits, torch.tensor(0), torch.tensor([0]), TreeSearchParams(top_k=3, node_budget=3),
                      draft_to_target=d2t)
    assert tree.tokens.tolist() == [0, 20, 30, 10]


def all_paths_best_first(logits, context, top_k, ngram=None, ngram_weight=0.5, lookup=(), lookup_logp=-0.1):
    """Every draft of length 1..D over the head's top-k tokens per depth (plus the lookup chain), scored by the sum
    of log full-softmax probabilities and the weighted n-gram terms (lookup tokens: `lookup_logp`): brute force,
    no beams, no pruning."""
    logp = torch.log_softmax(logits, -1)
    top = [set(logits[d].topk(top_k).indices.tolist()) for d in range(logits.shape[0])]
    scores, frontier = {}, [((), 0.0)]
    for d in range(logits.shape[0]):
        nxt = []
        for path, score in frontier:
            options = {x: float(logp[d, x]) for x in top[d]}
            if ngram is not None and d > 0:
                for x in options:
                    hist = (list(context) + list(path))[-(ngram.order - 1) :]
                    pr = float(ngram.prob(torch.tensor([hist]), torch.tensor([[x]]))[0, 0])
                    options[x] += ngram_weight * math.log(pr + LOG_EPS)
            if d < len(lookup) and list(path) == list(lookup[:d]):
                options[lookup[d]] = max(options.get(lookup[d], -math.inf), lookup_logp)
            for x, term in options.items():
                scores[path + (x,)] = score + term
                nxt.append((path + (x,), score + term))
        frontier = nxt
    return scores


def test_best_first_tree_is_the_best_drafts_over_all_paths():
    """search="best_first" must equal the top-B of an exhaustive enumeration (no beam pruning loses a draft), with
    the n-gram and lookup terms in the same ranking, at every budget."""
    torch.manual_seed(5)
    logits = torch.randn(4, 12) * 2
    context = [3, 4]
    ngram = NGramModel.build([torch.randint(0, 12, (300,)).tolist()], order=3, vocab_size=12, progress=False)
    lookup = [int(logits[0].argmin()), int(logits[1].argmin()), 2]  # a chain the head itself ranks last
    tokens, valid = torch.tensor(lookup + [0]), torch.tensor([True, True, True, False])
    brute = all_paths_best_first(logits, context, 4, ngram, lookup=lookup)
    ranked = sorted(brute.items(), key=lambda kv: -kv[1])
    for budget in (1, 3, 10, 40):
        p = TreeSearchParams(search="best_first", top_k=4, beam_width=1, node_budget=budget)
        tree = build_tree(logits, torch.tensor(4), torch.tensor(context), p, ngram=ngram, lookup=(tokens, valid))
        got = tree_paths(tree)
        assert got.keys() == dict(ranked[:budget]).keys(), budget
        assert all(abs(score - brute[path]) < 1e-4 for path, score in got.items())
        check_closed(tree)
    assert tuple(lookup) in got  # the confident lookup chain outranks most head drafts
    reference = tree_paths(build_tree(logits, torch.tensor(4), torch.tensor(context),
                                      TreeSearchParams(top_k=4, beam_width=1, node_budget=40), ngram=ngram))
    assert reference.keys() != got.keys()  # a one-beam reference search keeps one path per depth


def test_tree_search_is_validated_and_read_from_the_config():
    with pytest.raises(ValueError, match="tree_search"):
        DartConfig(tree_search="greedy")
    assert TreeSearchParams.from_config(DartConfig(tree_search="best_first")).search == "best_first"


@pytest.mark.parametrize("search", ["beam", "best_first"])
def test_batched_search_gives_each_row_the_tree_it_gets_alone(search):
    """build_trees over several rows (own roots, contexts, lookups, depth limits; the head's logits) equals
    build_tree row by row, node for node, padding aside."""
    from dart_hf.core.prompt_lookup import lookup_continuation
    from dart_hf.core.tree import build_trees

    g = torch.Generator().manual_seed(9)
    vocab, rows, depth = 40, 5, 6
    ngram = NGramModel.build([torch.randint(0, vocab, (400,), generator=g).tolist()], order=3, vocab_size=vocab,
                             progress=False)
    logits = torch.randn(rows, depth, vocab, generator=g) * 3
    texts = [torch.randint(0, vocab, (int(n),), generator=g) for n in (1, 7, 12, 30, 9)]
    texts[3][-4:] = texts[3][10:14]  # a text that repeats itself: a lookup continuation to offer
    max_depths = [6, 2, 0, 6, 4]
    params = TreeSearchParams(search=search, top_k=6, beam_width=3, node_budget=9)
    eos = torch.tensor([3])
    lookups = [lookup_continuation(t, depth) for t in texts]
    contexts = torch.stack([torch.cat([torch.full((2,), -1), t])[-2:] for t in texts])
    batched = build_trees(logits, torch.stack([t[-1] for t in texts]), contexts, params, ngram=ngram,
                          eos_token_ids=eos, max_depths=torch.tensor(max_depths),
                          lookup=(torch.stack([lk[0] for lk in lookups]), torch.stack([lk[1] for lk in lookups])))
    assert bool(lookups[3][1].any())
    for r, text in enumerate(texts):
        alone = build_tree(logits[r], text[-1], text, params, ngram=ngram, eos_token_ids=eos,
                           max_depth=max_depths[r], lookup=lookups[r])
        mine = batched.row(r)
        assert mine.size == alone.size
        for field in ("tokens", "parents", "depths", "ancestor_mask", "scores"):
            assert torch.equal(getattr(mine, field), getattr(alone, field)), (r, field)
        n = batched.tokens.shape[1]  # padding: parent 0, depth 0, its own ancestor only
        pad = torch.arange(alone.size, n)
        assert not batched.parents[r, pad].any() and not batched.depths[r, pad].any()
        assert torch.equal(batched.ancestor_mask[r, pad][:, pad], torch.eye(len(pad), dtype=torch.bool))
    assert batched.sizes[2] == 1  # depth limit 0: the root alone
