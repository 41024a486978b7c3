"""Sliding-window targets in tree mode: Mistral (every layer sliding), Gemma 2 / Gemma 3 / gpt-oss (sliding and full
layers mixed), with windows much shorter than prompt + output, so the window cuts in every step.

- every tree node's verify logits equal a plain forward over prefix + its path, also for nodes deeper than the window
  (their oldest ancestors fall out of it), in SDPA (plain and DART's grouped CPU SDPA), eager and FlexAttention;
- compaction leaves the cache that decoding prefix + path would have left, and decoding continues from it exactly;
- greedy DART equals plain `generate` token for token with an oracle drafter that gets 1-11 tokens accepted per step
  (deeper than the window) past rejected siblings;
- sampling: the first two tokens follow the exact distribution.
With the heads' own drafts, greedy and seeded sampling on these targets are cases of tests/test_lossless.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import dart_hf
from conftest import SLIDING, SLIDING_WINDOW, compact_cache, prefilled, sliding_target
from dart_hf.core.drafter import DartDrafter
from dart_hf.core.tree import DraftTree, ancestor_mask
from dart_hf.core.tree import DraftTrees
from dart_hf.core.step import verify_tree
from dart_hf.tools.targets import tiny_config

WINDOW = SLIDING_WINDOW


def chain_tree(root: int, truth: list[int], wrong: list[int]) -> DraftTree:
    """Root, then at each depth a wrong sibling FIRST and the true token second (so the accepted path is not a
    prefix of the node order and the commit must move entries), the true node carrying the next level."""
    tokens, parents, depths, parent = [root], [0], [0], 0
    for d, (good, bad) in enumerate(zip(truth, wrong), start=1):
        tokens += [bad, good]
        parents += [parent, parent]
        depths += [d, d]
        parent = len(tokens) - 1
    parents_t = torch.tensor(parents)
    return DraftTree(torch.tensor(tokens), parents_t, torch.tensor(depths),
                     ancestor_mask(parents_t, max(depths)), torch.zeros(len(tokens)))


# ------------------------------------------------------------------------------------------------ verify + compaction
@torch.no_grad()
@pytest.mark.parametrize(
    "model_type, attn",
    [(m, a) for m in ("mistral", "gemma2", "gemma3_text") for a in ("sdpa", "eager")]
    + [("gemma3_text", "flex_attention")],  # sliding and full layers: two BlockMasks of different lengths
)
def test_tree_logits_equal_per_path_forwards_across_the_window(model_type, attn):
    target = sliding_target(model_type, attn)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 64, (1, 11), generator=g)
    truth, wrong = torch.randint(3, 64, (2, 7), generator=g).tolist()  # 7 deep: ancestors leave the window of 4
    tree = chain_tree(int(prefix[0, -1]), truth, wrong)
    past = prefix[:, :-1]
    cache = prefilled(target, past)
    logits = verify_tree(target, tree, cache, past_len=past.shape[1])
    for i in range(tree.size):
        path = tree.ancestor_mask[i].nonzero().squeeze(1)
        seq = torch.cat([past, tree.tokens[path].unsqueeze(0)], dim=1)
        ref = target(input_ids=seq).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4, msg=f"node {i} (depth {tree.depths[i]})")


@torch.no_grad()
@pytest.mark.parametrize("model_type", SLIDING)
@pytest.mark.parametrize("depth", [0, 2, 6])
def test_compaction_leaves_the_cache_of_prefix_plus_path(model_type, depth):
    target = sliding_target(model_type)
    g = torch.Generator().manual_seed(4)
    past = torch.randint(3, 64, (1, 9), generator=g)
    root = torch.randint(3, 64, (1, 1), generator=g)
    truth, wrong = torch.randint(3, 64, (2, 6), generator=g).tolist()
    tree = chain_tree(int(root), truth, wrong)
    cache = prefilled(target, past)
    verify_tree(target, tree, cache, past_len=9)
    path = torch.tensor([0] + [2 * d for d in range(1, depth + 1)])  # root, then each level's true node
    compact_cache(target, cache, 9, path)
    ref = prefilled(target, torch.cat([past, tree.tokens[path].unsqueeze(0)], dim=1))
    assert cache.get_seq_length() == ref.get_seq_length() == 9 + path.numel()  # every position kept (full layers)
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
    nxt = torch.tensor([[17, 18, 19]])  # and decoding continues exactly from the compacted cache
    a = target(input_ids=nxt, cache=cache, use_cache=True).logits
    b = target(input_ids=nxt, cache=ref, use_cache=True).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ end to end
def oracle(monkeypatch, plain: torch.Tensor, vocab: int) -> list[int]:
    """Make the drafter propose the plain continuation (1, 2, ... 11 tokens deep, in turn) with a wrong sibling at
    every depth; returns the list the accepted lengths of the run are appended to."""
    original = DartDrafter.propose
    depths = iter(list(range(1, 12)) * 10)

    def propose(self, max_new, timer, node_budget=None):
        texts = [self.texts(b) for b in range(len(max_new))]
        original(self, max_new, timer, node_budget)  # keeps the drafter's own state machine as it is
        (text,), (limit,) = texts, max_new
        n = text.numel()
        truth = plain[0, n : n + min(next(depths), limit)].tolist()
        wrong = [(t + 1 + i) % vocab for i, t in enumerate(truth)]
        return DraftTrees.stack([chain_tree(int(text[-1]), truth, wrong).to(text.device)])

    monkeypatch.setattr(DartDrafter, "propose", propose)


@pytest.mark.parametrize("model_type", SLIDING)
def test_greedy_equals_plain_generate_with_deep_acceptance(model_type, monkeypatch):
    target = sliding_target(model_type)
    head = dart_hf.DartHead.from_target(target, draft_length=3, node_budget=8).eval()
    g = torch.Generator().manual_seed(5)
    for length in (21, 26):
        ids = torch.randint(3, 64, (1, length), generator=g)
        plain = target.generate(ids, do_sample=False, max_new_tokens=40, min_new_tokens=40)
        with monkeypatch.context() as m:
            oracle(m, plain, 64)
            dart = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=40, min_new_tokens=40)
        assert torch.equal(dart, plain), f"{model_type}: DART diverged from plain generate"
        assert max(head.stats["accepted_lengths"]) > WINDOW + 1  # accepted paths deeper than the window


CHI2_999_7 = 24.32  # 99.9% quantile, 7 degrees of freedom


@pytest.mark.parametrize("model_type", ["gemma2"])  # sliding and full layers
def test_sampling_matches_the_exact_distribution_past_the_window(model_type):
    """p(x1) and p(x2) = sum_x1 p(x1) p(x2 | x1) straight from the target, with a 3-token window behind a 6-token
    prompt; DART's sampled first and second tokens (chi-square, as tests/test_sampling.py)."""
    torch.manual_seed(0)
    target = sliding_target(model_type, window=3, vocab=8, layers=2, eos_token_id=None, pad_token_id=None)
    with torch.no_grad():
        target.get_output_embeddings().weight.div_(8.0)  # a soft distribution: many distinct outcomes
    head = dart_hf.DartHead.from_target(target, draft_length=3, tree_top_k=8, beam_width=4, node_budget=12).eval()
    ids = torch.tensor([[3, 5, 7, 4, 6, 5]])
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1] / 0.9, -1)
        seqs = torch.cat([ids.expand(8, -1), torch.arange(8).unsqueeze(1)], dim=1)
        p2 = p1 @ torch.softmax(target(seqs).logits[:, -1] / 0.9, -1)
    c1, c2 = torch.zeros(8), torch.zeros(8)
    torch.manual_seed(0)
    for _ in range(600):
        out = target.generate(ids, assistant_model=head, do_sample=True, temperature=0.9, top_k=0, max_new_tokens=2)
        c1[out[0, 6]] += 1
        c2[out[0, 7]] += 1
    for counts, probs in ((c1, p1), (c2, p2)):
        expected = probs * counts.sum()
        assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_999_7


def test_a_callers_cache_of_either_layout_decodes_like_plain_generate():
    """The caller's empty cache (the target's own layout with sliding layers, or full layers only) is the one that gets
    filled; DART keeps every position in it (full layers: the window is applied by the verify masks)."""
    target = sliding_target("mistral")
    head = dart_hf.DartHead.from_target(target, draft_length=3).eval()
    ids = torch.randint(3, 64, (1, 11), generator=torch.Generator().manual_seed(6))
    want = target.generate(ids, do_sample=False, max_new_tokens=12)
    for cache in (DynamicCache(config=target.config),
                  DynamicCache(config=tiny_config("mistral", sliding_window=None, num_hidden_layers=4))):
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=12, cache=cache,
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, want) and out.cache is cache and cache.get_seq_length() >= 11 + 11
