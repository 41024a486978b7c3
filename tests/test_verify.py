"""Tree verification is exact: every node's logits equal a plain forward over prefix + its path."""

from __future__ import annotations

import pytest
import torch

from conftest import compact_cache, make_head, make_target, prefilled, prompts, scripted_budgets
from dart_hf.core.step import RowSlots, StepSpec, verify_mask, verify_tree
from dart_hf.core.tree import DraftTrees, TreeSearchParams, build_tree


def random_tree(vocab: int, seed: int = 0, budget: int = 14):
    torch.manual_seed(seed)
    return build_tree(torch.randn(4, vocab) * 2, torch.tensor(5), torch.tensor([5]),
                      TreeSearchParams(top_k=4, beam_width=3, node_budget=budget))


@torch.no_grad()
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_logits_equal_per_path_forwards(attn):
    target = make_target("qwen3", attn=attn)
    prefix = torch.randint(3, 96, (1, 9))
    tree = random_tree(96)
    cache = prefilled(target, prefix)
    logits = verify_tree(target, tree, cache, past_len=9)
    for i in range(tree.size):
        path = tree.ancestor_mask[i].nonzero().squeeze(1)
        seq = torch.cat([prefix, tree.tokens[path].unsqueeze(0)], dim=1)
        ref = target(input_ids=seq).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)


def test_flex_attention_block_mask_matches_dense_mask():
    dense_target = make_target("llama", attn="sdpa")
    flex_target = make_target("llama", attn="flex_attention")
    prefix = torch.randint(3, 96, (1, 7))
    tree = random_tree(96, seed=3)
    dense = verify_tree(dense_target, tree, prefilled(dense_target, prefix), past_len=7)
    flex = verify_tree(flex_target, tree, prefilled(flex_target, prefix), past_len=7)
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    trees = DraftTrees.stack([tree])
    mask = verify_mask(StepSpec.of(flex_target, [0]), trees, RowSlots.of([0], 64, "cpu"), torch.tensor([7]), 7,
                       7 + trees.width, 7 + trees.depths, torch.float32)
    assert type(mask).__name__ == "BlockMask"


@torch.no_grad()
def test_compaction_leaves_the_cache_of_prefix_plus_path():
    target = make_target("llama")
    prefix = torch.randint(3, 96, (1, 6))
    tree = random_tree(96, seed=4)
    cache = prefilled(target, prefix)
    verify_tree(target, tree, cache, past_len=6)
    deepest = int(tree.depths.argmax())
    path = tree.ancestor_mask[deepest].nonzero().squeeze(1)
    compact_cache(target, cache, 6, path)
    ref = prefilled(target, torch.cat([prefix, tree.tokens[path].unsqueeze(0)], dim=1))
    assert cache.get_seq_length() == 6 + path.numel()
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
    # and decoding continues exactly from the compacted cache
    nxt = torch.tensor([[17]])
    a = target(input_ids=nxt, cache=cache, use_cache=True).logits
    b = target(input_ids=nxt, cache=ref, use_cache=True).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_plain_step_of_one_row_runs_plain_decodings_forward(do_sample):
    """A step at node budget 0 (the cost-aware rule's plain decoding) of one unpadded row passes the target no mask,
    as plain `generate` does (a 4D mask made that step ~3% slower than plain decoding's on a 2-core CPU); a tree
    step passes its 4D tree mask; greedy tokens are plain `generate`'s."""
    target = make_target("llama")
    head = make_head(target)
    masks = []
    hook = target.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        for ids in prompts(3):
            gen = dict(max_new_tokens=12, do_sample=do_sample, eos_token_id=None, attention_mask=torch.ones_like(ids))
            torch.manual_seed(0)
            plain = target.generate(ids, **gen)
            assert all(m is None for m in masks[1:])  # plain decoding's steps
            masks.clear()
            state, _ = scripted_budgets(target, head, [3, 0, 0])
            out = target.generate(ids, assistant_model=head, dart_node_budget="auto", dart_budget_state=state, **gen)
            if not do_sample:
                assert torch.equal(out, plain)
            steps = masks[1:]  # after the prefill
            masks.clear()
            budgets = head.stats["node_budgets"]  # (a tree after plain steps runs twice: `CallBudget`)
            assert len(steps) == len(budgets) >= 6 and 0 in budgets and 3 in budgets
            # (the last step may have one position left: its tree is the root alone, a plain forward)
            assert all((m is not None and m.dim() == 4) if b else m is None for m, b in zip(steps[:-1], budgets))
    finally:
        hook.remove()
