"""Tree verification: one target forward over every row's draft tree, on the call's `RaggedCache`.

Node i of row r sits at position next_pos[r] + depth[i] and attends to the row's committed tokens plus its own
ancestors (within the window, in a sliding-window layer): the mask (`RaggedCache.verify_mask`) goes in as the
forward's own `attention_mask` (a 4D mask, a BlockMask for FlexAttention, or one per layer type), which transformers
passes to the attention layers unchanged, and the inputs of the layers the head reads come back from the same forward
(`target.aux_request`). Nothing in transformers or in the target is changed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from .ragged import RaggedCache
from .target import aux_request, aux_states, cache_kwargs
from .tree import DraftTree, DraftTrees


@torch.no_grad()
def verify_batch(target: PreTrainedModel, trees: DraftTrees, ragged: RaggedCache,
                 aux_layer_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the target once over every row's tree; returns (float logits [rows, N, vocab], node i predicting its next
    token; the inputs of the layers `aux_layer_ids` at every node [rows, N, 3 * hidden], or None when none are asked
    for). The tree entries stay in the cache until `RaggedCache.commit`."""
    impl = target.config._attn_implementation or "eager"
    out = target(
        input_ids=trees.tokens,
        attention_mask=ragged.verify_mask(trees, impl, target.dtype),
        position_ids=ragged.positions(trees),
        use_cache=True,
        **cache_kwargs(target, ragged.cache),
        **(aux_request(aux_layer_ids) if aux_layer_ids else {}),
        logits_to_keep=0,
    )
    return out.logits.float(), aux_states(out, aux_layer_ids) if aux_layer_ids else None


def verify_tree(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int) -> torch.Tensor:
    """The float logits [N, vocab] of one row's tree after `past_len` committed tokens in `cache` (a
    `ragged.decode_cache`); what `dart-hf calibrate` times. The tree's entries stay in the cache (crop them off)."""
    valid = torch.ones(1, past_len, dtype=torch.bool, device=tree.tokens.device)
    return verify_batch(target, DraftTrees.stack([tree]), RaggedCache(cache, valid, target.config))[0][0]
