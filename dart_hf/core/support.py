"""Which targets DART's tree verification runs exactly, decided from the config before any work.

Tree verification runs the target once over every drafted node and then drops the cache entries of the rejected
ones (`step.commit`). That is sound for attention layers, full or sliding-window: a node's keys and values
depend only on its own path, and an entry can be dropped. It is not sound for a layer that carries a recurrent state
(state-space / Mamba, linear attention, short convolutions, RG-LRU): its state after the tree is a mix of every node,
and no entry can be dropped from it. Such targets, and the few other layouts verification cannot compact, are refused
with one `NotImplementedError` naming the model type, the reason and the alternative: `dart_mode="chain"`, which runs
transformers' own assisted-decoding loop (chains roll back through the cache's `crop`) with the same head.

`tree_refusal(config)` is the rule; `dart_hf.tools.targets` lists what it gives for every decoder-only model type
transformers ships, and `tests/test_target_matrix.py` checks that list against real tiny targets.
"""

from __future__ import annotations

from .target import decoder_layers

# Families whose layers carry a recurrent state (some without any sign of it in `layer_types` or in the cache
# classes transformers builds for them). Model types not named here are caught by the fields and cache layers below.
RECURRENT_MODEL_TYPES = frozenset({
    "bamba", "bailing_hybrid", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear", "lfm2",
    "lfm2_moe", "lfm3", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid", "qwen3_5_moe_text",
    "qwen3_5_text", "qwen3_next", "recurrent_gemma", "rwkv", "xlstm", "zamba", "zamba2",
})
# Config fields that only state-space / linear-attention / recurrent layers have.
RECURRENT_FIELDS = (
    "mamba_d_state", "mamba_n_heads", "mamba_expand", "ssm_state_size", "state_size", "lru_width",
    "linear_num_value_heads", "linear_key_head_dim", "conv_L_cache", "layers_block_type", "block_types",
    "hybrid_override_pattern", "attn_layer_period",
)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
CACHE_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")

RECURRENT = (
    "it has state-space / linear-attention / recurrent layers, whose state tree verification cannot roll back by "
    "dropping cache entries"
)


def tree_refusal(config) -> str | None:
    """Why DART's tree verification cannot run a target with this config exactly (None: it can)."""
    cfg = config.get_text_config(decoder=True)
    if cfg.model_type in RECURRENT_MODEL_TYPES or any(getattr(cfg, f, None) is not None for f in RECURRENT_FIELDS):
        return RECURRENT
    kinds = set(getattr(cfg, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES)
    if "chunked_attention" in kinds:
        return "it has chunked-attention layers, whose mask tree verification does not build"
    if kinds & {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"}:
        return RECURRENT
    if getattr(cfg, "attention_chunk_size", None) is not None:
        return "it has chunked-attention layers, whose mask tree verification does not build"
    if getattr(cfg, "kv_sharing_modes", None) is not None or getattr(cfg, "num_kv_shared_layers", 0):
        return "its layers share KV caches, which tree verification does not compact"
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=config).layers
    except Exception as err:  # a config transformers cannot build a cache for: say so instead of guessing
        return f"transformers cannot build a DynamicCache for it ({type(err).__name__}: {err})"
    odd = sorted({type(layer).__name__ for layer in layers} - set(CACHE_LAYERS))
    if any("Linear" in name for name in odd):
        return RECURRENT
    if odd:
        return f"its cache has {', '.join(odd)} layers, which tree verification does not compact"
    return None


# Model types on which transformers' own assisted decoding (what chain mode runs) fails, as measured on 5.25.
CHAIN_REFUSALS = {
    "minimax": "transformers' assisted decoding cannot crop its cache",
    "recurrent_gemma": "transformers' assisted decoding fails on its outputs (no cache in CausalLMOutput)",
}


def chain_refusal(config) -> str | None:
    """Why chain mode (transformers' assisted decoding with the head) cannot run a target with this config."""
    return CHAIN_REFUSALS.get(config.get_text_config(decoder=True).model_type)


def check_tree_target(target) -> None:
    """Raise NotImplementedError before any work when tree verification cannot run `target` exactly (and first the
    TypeError of a layout DART cannot read at all, in either mode, so tree mode never points to a chain mode that
    would refuse it too)."""
    reason = tree_refusal(target.config)
    if reason is not None:
        decoder_layers(target)
        model_type = target.config.get_text_config(decoder=True).model_type
        chain = chain_refusal(target.config)
        alternative = (
            f"Chain mode cannot run it either: {chain}" if chain else
            'Use dart_mode="chain" (transformers\' assisted decoding with the same head), which stays exact'
        )
        raise NotImplementedError(
            f"DART tree verification does not support {model_type!r} targets: {reason}. {alternative}."
        )


def check_chain_target(target) -> None:
    """Raise NotImplementedError before any work when chain mode cannot run `target`."""
    reason = chain_refusal(target.config)
    if reason is not None:
        model_type = target.config.get_text_config(decoder=True).model_type
        raise NotImplementedError(f'DART dart_mode="chain" does not support {model_type!r} targets: {reason}.')
