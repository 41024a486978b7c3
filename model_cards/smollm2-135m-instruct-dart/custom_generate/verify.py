# Generated from dart_hf/verify.py (dart_hf 0.1.0) by dart_hf.hub.write_custom_generate. Do not edit.
"""Tree verification: one target forward over all tree nodes, and the KV-cache compaction that follows.

Node i sits at position past_len + depth[i] and attends to the whole past plus its own ancestors. The mask
is built for the target's attention implementation:
- "flex_attention": a FlexAttention BlockMask whose mask_mod reads the ancestor table (GPU default);
- "sdpa": a dense boolean [1, 1, N, past + N] mask;
- "eager" (and anything else that adds the mask to the scores): the same mask as 0 / -inf floats.
transformers passes a 4D mask or a BlockMask through to the attention layers unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from .tree import DraftTree


def tree_attention_mask(tree: DraftTree, past_len: int, attn_implementation: str, dtype: torch.dtype):
    """The verify mask for `tree` after `past_len` cached tokens, in the form the attention backend takes."""
    n = tree.size
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        anc = tree.ancestor_mask

        def tree_mask_mod(b, h, q_idx, kv_idx):
            in_tree = kv_idx >= past_len
            tree_kv = (kv_idx - past_len).clamp(min=0)
            return ~in_tree | (in_tree & anc[q_idx, tree_kv])

        return create_block_mask(tree_mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=past_len + n, device=anc.device)
    visible = torch.cat(
        [torch.ones(n, past_len, dtype=torch.bool, device=tree.tokens.device), tree.ancestor_mask], dim=1
    )[None, None]
    if attn_implementation == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


@torch.no_grad()
def verify_tree(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int) -> torch.Tensor:
    """Run the target once over the tree; returns float logits [N, vocab] (node i predicts its next token)."""
    impl = target.config._attn_implementation or "eager"
    mask = tree_attention_mask(tree, past_len, impl, target.dtype)
    out = target(
        input_ids=tree.tokens.unsqueeze(0),
        attention_mask=mask,
        position_ids=(tree.depths + past_len).unsqueeze(0),
        cache=cache,
        use_cache=True,
        logits_to_keep=0,
    )
    return out.logits[0].float()


def compact_cache(cache: DynamicCache, past_len: int, path: torch.Tensor) -> None:
    """Keep the cache entries of the accepted `path` (tree node indices, root first), moved to contiguous
    positions past_len .. past_len + len(path) - 1, and drop every other tree entry.

    Done in place per layer: gather the path rows, write them right after the past, crop the rest. When only the
    root was accepted (the most common step for a weak head) its entry is already in place: crop only.
    """
    keep = past_len + path
    new_len = past_len + path.numel()
    move = path.numel() > 1  # the root is node 0, already at past_len
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise ValueError("DART tree verification does not support sliding-window cache layers yet")
        if not layer.is_initialized:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if move:
                t[..., past_len:new_len, :] = t[..., keep, :]
            setattr(layer, name, t[..., :new_len, :])
