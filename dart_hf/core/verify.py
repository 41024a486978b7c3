"""Tree verification on the eager step's cache: one target forward over every row's draft tree (`RaggedCache`).

Node i of row r sits at position next_pos[r] + depth[i] and attends to the row's committed tokens plus its own
ancestors (within the window, in a sliding-window layer): the mask (`RaggedCache.verify_mask`) goes in as the
forward's own `attention_mask` (a 4D mask, a BlockMask for FlexAttention, or one per layer type), which transformers
passes to the attention layers unchanged; the forward itself is `target.target_forward`, the static step's too.
Nothing in transformers or in the target is changed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from .ragged import RaggedCache
from .target import target_forward
from .tree import DraftTree, DraftTrees


@torch.no_grad()
def verify_batch(target: PreTrainedModel, trees: DraftTrees, ragged: RaggedCache,
                 aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target once over every row's tree; returns (float logits [rows, N, vocab], node i predicting its next
    token; the inputs of the layers `aux_layer_ids` at every node [rows, N, 3 * hidden]). The tree entries stay in
    the cache until `RaggedCache.commit`."""
    mask = ragged.verify_mask(trees, target.config._attn_implementation or "eager", target.dtype)
    return target_forward(target, trees.tokens, mask, ragged.positions(trees), ragged.cache, aux_layer_ids)


def verify_tree(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int) -> torch.Tensor:
    """The float logits [N, vocab] of one row's tree after `past_len` committed tokens in `cache` (a
    `ragged.decode_cache`); what `dart-hf calibrate` times (with the embeddings as the layer states asked for: the
    verify forward of a step asks for some). The tree's entries stay in the cache (crop them off)."""
    valid = torch.ones(1, past_len, dtype=torch.bool, device=tree.tokens.device)
    return verify_batch(target, DraftTrees.stack([tree]), RaggedCache(cache, valid, target.config), [0])[0][0]
