"""Sampling is exact: accepted tokens follow the target's processed distribution, whatever the draft.

A chi-square test against the exact distribution; a biased rule (e.g. accepting a drafted child whenever
the target gives it any mass, or trying children without renormalising) fails these tests by far.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from conftest import make_head, make_target
from dart_hf.core.acceptance import accept_walk
from dart_hf.core.tree import DraftTree, ancestor_mask

CHI2_999 = {4: 18.47, 5: 20.52, 7: 24.32, 11: 31.26, 15: 37.70}  # 99.9% quantiles by degrees of freedom


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_first_and_second_token_distribution_of_the_walk():
    vocab = 6
    # root with children 2, 0, 5; node 1 (token 2) has children 3, 4
    tree = DraftTree(
        tokens=torch.tensor([1, 2, 0, 5, 3, 4]),
        parents=torch.tensor([0, 0, 0, 0, 1, 1]),
        depths=torch.tensor([0, 1, 1, 1, 2, 2]),
        ancestor_mask=ancestor_mask(torch.tensor([0, 0, 0, 0, 1, 1]), 2),
        scores=torch.zeros(6),
    )
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    logits[0, 2] += 1.5  # the first child is likely, so deep walks happen
    procs = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(5)])
    ids = torch.tensor([[1]])
    p_root = torch.softmax(procs(ids, logits[0:1].clone())[0], -1)
    p_after_2 = torch.softmax(procs(torch.tensor([[1, 2]]), logits[1:2].clone())[0], -1)
    first, second_given_2 = torch.zeros(vocab), torch.zeros(vocab)
    n = 6000
    for s in range(n):  # a seed per walk: the noise of (seed, position, token) is uniform across seeds
        acc = accept_walk(tree, logits, ids, procs, seed=torch.tensor([s]), position=ids.shape[1])
        first[acc.tokens[0]] += 1
        if acc.tokens[0] == 2:
            second_given_2[acc.tokens[1]] += 1
    assert chi2(first, p_root) < CHI2_999[4]  # top-k 5 of 6 -> 5 cells
    assert chi2(second_given_2, p_after_2) < CHI2_999[4]


def exact_two_token_marginals(target, ids, temperature):
    """p(x1) and p(x2) = sum_x1 p(x1) p(x2 | x1), straight from the target."""
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1] / temperature, -1)
        vocab = p1.numel()
        seqs = torch.cat([ids.expand(vocab, -1), torch.arange(vocab).unsqueeze(1)], dim=1)
        p2_given = torch.softmax(target(seqs).logits[:, -1] / temperature, -1)
    return p1, p1 @ p2_given


def test_end_to_end_sampling_matches_the_target_distribution():
    target = make_target("llama", vocab_size=8, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.lm_head.weight.div_(4.0)  # a soft distribution: many distinct outcomes
    head = make_head(target, tree_top_k=8, beam_width=4, node_budget=12)
    ids = torch.tensor([[3, 5, 7, 1]])
    p1, p2 = exact_two_token_marginals(target, ids, temperature=0.9)
    c1, c2 = torch.zeros(8), torch.zeros(8)
    torch.manual_seed(0)
    n = 800
    for _ in range(n):
        out = target.generate(ids, assistant_model=head, do_sample=True, temperature=0.9, top_k=0,
                              max_new_tokens=2)
        c1[out[0, 4]] += 1
        c2[out[0, 5]] += 1
    assert chi2(c1, p1) < CHI2_999[7]
    assert chi2(c2, p2) < CHI2_999[7]
