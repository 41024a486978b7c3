"""Tree verification: one target forward over all tree nodes, and the KV-cache compaction that follows.

Node i sits at position past_len + depth[i] and attends to the whole past plus its own ancestors. In a sliding-window
layer (window w: a token sees itself and the w - 1 positions before it) it sees only those of them inside the window
counted from its own position, and the layer holds only the last w - 1 committed tokens; a target whose layers differ
(full and sliding, as Gemma 2/3, gpt-oss, Cohere2, OLMo3) gets one mask per layer type, as a dict keyed by its config's
`layer_types`, which is how those models take prepared masks. The mask is built for the target's attention
implementation:
- "flex_attention": a FlexAttention BlockMask whose mask_mod reads the ancestor table (GPU default);
- "sdpa": a dense boolean [1, 1, N, past + N] mask;
- "eager" (and anything else that adds the mask to the scores): the same mask as 0 / -inf floats.
transformers passes a 4D mask or a BlockMask through to the attention layers unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from .target import aux_request, aux_states, cache_kwargs
from .tree import DraftTree

def tree_attention_mask(
    tree: DraftTree, past_len: int, attn_implementation: str, dtype: torch.dtype, window: int | None = None
):
    """The verify mask for `tree` after `past_len` committed tokens, in the form the attention backend takes.

    window: the layer's sliding window (None: full attention). Such a layer's keys are its last
    kept = min(past_len, window - 1) committed tokens, then the tree; node i (position past_len + depth_i) sees committed
    key j (position past_len - kept + j) when j > kept + depth_i - window, and tree node k when k is an ancestor of i
    with depth_i - depth_k < window: exactly the keys the same token sees in plain decoding of its path."""
    n = tree.size
    anc, depths = tree.ancestor_mask, tree.depths
    kept = past_len if window is None else min(past_len, window - 1)
    committed = torch.ones(n, kept, dtype=torch.bool, device=anc.device)
    in_tree = anc
    if window is not None:
        j = torch.arange(kept, device=anc.device)
        committed = j[None, :] > (kept - window + depths)[:, None]
        in_tree = anc & (depths[:, None] - depths[None, :] < window)
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        if window is None:

            def tree_mask_mod(b, h, q_idx, kv_idx):
                in_tree = kv_idx >= kept
                tree_kv = (kv_idx - kept).clamp(min=0)
                return ~in_tree | (in_tree & anc[q_idx, tree_kv])

        else:  # a table: a mask_mod computing the window from `depths` did not compile in torch 2.13's CPU flex kernel
            table = torch.cat([committed, in_tree], dim=1)

            def tree_mask_mod(b, h, q_idx, kv_idx):
                return table[q_idx, kv_idx]

        return create_block_mask(tree_mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=kept + n, device=anc.device)
    visible = torch.cat([committed, in_tree], dim=1)[None, None]
    if attn_implementation == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, torch.finfo(dtype).min
    )


def layer_window(layer) -> int | None:
    """The sliding window of a cache layer (None: full attention). Raises for a layer tree verification cannot
    compact (recurrent / linear-attention state, sparse-attention indexer, quantised), which
    `dart_hf.core.support.check_tree_target` refuses before any work."""
    kind = type(layer).__name__
    if kind == "DynamicLayer":
        return None
    if getattr(layer, "is_sliding", False) and kind == "DynamicSlidingWindowLayer":
        return int(layer.sliding_window)
    raise NotImplementedError(
        f"DART tree verification cannot roll back a {kind} cache layer (tree entries are dropped after each step); "
        'use dart_mode="chain"'
    )


def verify_masks(tree: DraftTree, cache: DynamicCache, past_len: int, config, attn_implementation: str, dtype):
    """The `attention_mask` argument of the verify forward: one 4D mask (or BlockMask) when every layer has the same
    window, else {layer type: mask} for a target whose config names `layer_types` (Gemma 2/3, gpt-oss, ...)."""
    windows = [layer_window(layer) for layer in cache.layers]
    masks = {w: tree_attention_mask(tree, past_len, attn_implementation, dtype, w) for w in dict.fromkeys(windows)}
    if len(masks) == 1:
        return next(iter(masks.values()))
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    if layer_types is None or len(layer_types) != len(windows):
        raise NotImplementedError(
            f"{config.model_type} mixes cache layers of windows {sorted(set(windows), key=str)} without `layer_types` "
            'in its config; DART tree verification cannot tell which mask each layer takes; use dart_mode="chain"'
        )
    by_type: dict[str, int | None] = {}
    for kind, w in zip(layer_types, windows):
        if by_type.setdefault(kind, w) != w:
            raise NotImplementedError(
                f"{config.model_type} has {kind!r} layers of different windows; DART tree verification passes one "
                'mask per layer type; use dart_mode="chain"'
            )
    return {kind: masks[w] for kind, w in by_type.items()}


@torch.no_grad()
def tree_forward(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int,
                 aux_layer_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the target once over the tree: (float logits [N, vocab], node i predicting its next token; the inputs of
    the layers `aux_layer_ids` at every node [1, N, 3 * hidden], which the head reads for the accepted path, or None
    when no layers are asked for).

    Sliding-window layers keep every tree entry until `compact_cache` (their `record_past`), so that the accepted
    path can be moved in place of the dropped nodes."""
    mask = verify_masks(
        tree, cache, past_len, target.config, target.config._attn_implementation or "eager", target.dtype
    )
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.record_past = True
    out = target(
        input_ids=tree.tokens.unsqueeze(0),
        attention_mask=mask,
        position_ids=(tree.depths + past_len).unsqueeze(0),
        use_cache=True,
        **cache_kwargs(target, cache),
        **(aux_request(aux_layer_ids) if aux_layer_ids else {}),
        logits_to_keep=0,
    )
    return out.logits[0].float(), aux_states(out, aux_layer_ids) if aux_layer_ids else None


def verify_tree(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int) -> torch.Tensor:
    """The float logits [N, vocab] of one target forward over the tree (what `dart-hf calibrate` times)."""
    return tree_forward(target, tree, cache, past_len)[0]


def compact_cache(cache: DynamicCache, past_len: int, path: torch.Tensor) -> None:
    """Keep the cache entries of the accepted `path` (tree node indices, root first), moved to contiguous
    positions right after the committed entries, and drop every other tree entry.

    Done in place per layer: gather the path rows, write them right after the past, crop the rest. When only the
    root was accepted (the most common step for a weak head) its entry is already in place: crop only. A
    sliding-window layer then keeps its last window - 1 entries and counts past_len + len(path) tokens, as if the
    path had been decoded one token at a time.
    """
    new_len = past_len + path.numel()
    move = path.numel() > 1  # the root is node 0, already first among the tree entries
    for layer in cache.layers:
        window = layer_window(layer)
        if not layer.is_initialized:
            continue
        # committed entries this layer holds: all of them, or (sliding) what is left before the tree entries
        start = past_len if window is None else layer.keys.shape[-2] - (layer.cumulative_length - past_len)
        end = start + path.numel()
        keep = start + path
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if move:
                t[..., start:end, :] = t[..., keep, :]
            t = t[..., :end, :]
            if window is not None:
                t = t[..., -(window - 1) :, :] if window > 1 else t[..., :0, :]
            setattr(layer, name, t)
        if window is not None:
            layer.cumulative_length = new_len
            layer.record_past = False


@torch.no_grad()
def verify_batch(target: PreTrainedModel, trees, ragged, aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target once over every row's tree (`trees`: a `TreeBatch`, `ragged`: the batch's `RaggedCache`);
    returns (float logits [rows, N, vocab], the inputs of the layers `aux_layer_ids` [rows, N, 3 * hidden]).
    Full-attention layers only (a batch over sliding-window layers is refused before any work: their cache keeps only
    a window of slots, which holes would shift)."""
    impl = target.config._attn_implementation or "eager"
    out = target(
        input_ids=trees.tokens,
        attention_mask=ragged.verify_mask(trees, impl, target.dtype),
        position_ids=ragged.positions(trees),
        use_cache=True,
        **cache_kwargs(target, ragged.cache),
        **aux_request(aux_layer_ids),
        logits_to_keep=0,
    )
    return out.logits.float(), aux_states(out, aux_layer_ids)
