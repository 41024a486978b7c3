"""Tree verification: one target forward over all tree nodes, and the KV-cache compaction that follows.

Node i sits at position past_len + depth[i] and attends to the whole past plus its own ancestors. The mask
is built for the target's attention implementation:
- "flex_attention": a FlexAttention BlockMask whose mask_mod reads the ancestor table (GPU default);
- "sdpa": a dense boolean [1, 1, N, past + N] mask;
- "eager" (and anything else that adds the mask to the scores): the same mask as 0 / -inf floats.
transformers passes a 4D mask or a BlockMask through to the attention layers unchanged.

On CPU, an "sdpa" target verifies through `grouped_sdpa_attention_forward`: transformers' SDPA repeats grouped
key/value heads once per query head whenever a mask is given, which copies the whole KV cache in every layer at every
step, while PyTorch's CPU flash kernel takes grouped heads and a mask directly (`enable_gqa`). It is selected by
`dart_hf.core.runtime.verify_attention` for the whole DART call (registered as "dart_grouped_sdpa" while a call
runs); this module changes nothing in transformers or in the target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .target import cache_kwargs
from .tree import DraftTree

GROUPED_SDPA = "dart_grouped_sdpa"


def grouped_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a masked call on CPU keeps grouped K/V heads grouped."""
    plain = (
        attention_mask is None
        or query.device.type != "cpu"
        or query.shape[1] == key.shape[1]
        or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "sinks", "s_aux"))
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


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
    if attn_implementation in ("sdpa", GROUPED_SDPA):
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


@torch.no_grad()
def verify_tree(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int) -> torch.Tensor:
    """Run the target once over the tree; returns float logits [N, vocab] (node i predicts its next token).

    Uses the attention the target has now: inside `dart_runtime` / `verify_runtime` the grouped CPU SDPA."""
    mask = tree_attention_mask(tree, past_len, target.config._attn_implementation or "eager", target.dtype)
    out = target(
        input_ids=tree.tokens.unsqueeze(0),
        attention_mask=mask,
        position_ids=(tree.depths + past_len).unsqueeze(0),
        use_cache=True,
        **cache_kwargs(target, cache),
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
