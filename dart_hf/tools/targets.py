"""The target families DART runs: every decoder-only model type of the installed transformers, as tested.

`MATRIX` is the one list: for each model type, what DART does with it. `tests/test_target_matrix.py` builds a tiny
random target of every type (`tiny_config`) and checks the verdict against plain `generate`; the target
table in docs/TARGETS.md is `markdown()` (`python -m dart_hf.tools.targets` prints it; a test checks the doc has it).

Verdicts:
- "tree": tree mode (the default) and chain mode give plain `generate`'s tokens;
- "chain": tree mode is refused before any work (`dart_hf.core.support.tree_refusal`, the reason is in the
  error), chain mode (`dart_mode="chain"`) gives plain `generate`'s tokens;
- "refused": DART refuses the target with a clear error in both modes (its layout is not Llama-like: no decoder
  `layers`, or a config without the fields a head is sized from);
- "untested": the tiny target's own plain `generate` fails here (reason given), so there is nothing to compare to.
"""

from __future__ import annotations

TESTED_WITH = "5.25.0"  # the transformers version MATRIX was measured on

# the fields a tiny target overrides, where its config has them (or an alias of them in `attribute_map`)
TINY = dict(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, mamba_chunk_size=16, chunk_size=16,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
)
_MLA = dict(num_key_value_heads=4)  # multi-head latent attention: as many KV heads as query heads
_HYBRID = dict(layer_types=["linear_attention", "full_attention"])  # one recurrent layer, one attention layer
# per type: what its tiny config needs besides TINY for its own plain `generate` to run
TINY_FIXES = {
    **dict.fromkeys(["axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
                     "minicpm3", "sarvam_mla", "youtu", "longcat_flash"], _MLA),
    **dict.fromkeys(["granitemoehybrid", "qwen3_5_text", "qwen3_5_moe_text"], _HYBRID),
    **dict.fromkeys(["kimi_linear", "bailing_hybrid"], {**_MLA, **_HYBRID}),
    "mamba2": dict(num_heads=8, n_groups=1),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"]),
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "qwen3_next": dict(num_hidden_layers=4),
    "recurrent_gemma": dict(num_hidden_layers=3),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=0),
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
}
SLIDING_WINDOW = 8  # tiny targets with a sliding window get this one: shorter than the test prompts


def decoder_only_model_types() -> list[str]:
    """Model types with a causal-LM class in transformers that are decoder-only language models: not encoder-decoder,
    not an encoder family (masked LM) used as a decoder, not a multimodal composite (their text models are listed
    under their own `*_text` types)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        cls = CONFIG_MAPPING[model_type]
        subs = set(getattr(cls, "sub_configs", None) or ())
        if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES or subs - {"attn_config", "ffn_config"}:
            continue
        if getattr(cls, "is_encoder_decoder", False) is True:
            continue
        out.append(model_type)
    return out


def tiny_config(model_type: str, sliding_window: int = SLIDING_WINDOW, **overrides):
    """A tiny config of `model_type`: 2 layers, hidden 64, vocab 64; a window of `sliding_window` where the type's
    default config has one."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = set(getattr(cls, "__dataclass_fields__", ()))
    aliases = getattr(cls, "attribute_map", None) or {}
    kwargs = {}
    for name, value in {**TINY, **TINY_FIXES.get(model_type, {}), **overrides}.items():
        name = name if name in fields else aliases.get(name)
        if name in fields:
            kwargs[name] = value
    if getattr(cls(), "sliding_window", None) is not None and "sliding_window" in fields:
        kwargs["sliding_window"] = sliding_window
    return cls(**kwargs)


# model type -> (verdict, why): measured by tests/test_target_matrix.py (regenerate with
# `python -m dart_hf.tools.targets --measure`, which prints this dict from a fresh run)
MATRIX: dict[str, tuple[str, str]] = {
    'afmoe': ('tree', ''),
    'apertus': ('tree', ''),
    'apertus1p5_text': ('tree', ''),
    'arcee': ('tree', ''),
    'aria_text': ('tree', ''),
    'axk1': ('tree', ''),
    'axk2': ('chain', 'sparse-attention indexer cache (`DynamicIndexedLayer`)'),
    'bailing_hybrid': ('chain', 'state-space / linear-attention / recurrent layers'),
    'bamba': ('chain', 'state-space / linear-attention / recurrent layers'),
    'beam': ('tree', ''),
    'bert-generation': ('refused', 'no decoder `layers` (not a Llama-like layout)'),
    'biogpt': ('tree', ''),
    'bitnet': ('tree', ''),
    'bloom': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'codegen': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'cohere': ('tree', ''),
    'cohere2': ('tree', ''),
    'cohere2_moe': ('tree', ''),
    'cohere_compass_text': ('untested', 'its plain `generate` fails on a tiny config'),
    'cpmant': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'ctrl': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'cwm': ('tree', ''),
    'dbrx': ('untested', 'its plain `generate` fails on a tiny config'),
    'deepseek_v2': ('tree', ''),
    'deepseek_v3': ('tree', ''),
    'deepseek_v32': ('chain', 'sparse-attention indexer cache (`DynamicIndexedLayer`)'),
    'deepseek_v4': ('refused', 'several hidden-state streams per layer (hyper-connections / AltUp)'),
    'diffllama': ('tree', ''),
    'doge': ('tree', ''),
    'dory': ('untested', 'its plain `generate` fails on a tiny config'),
    'dots1': ('untested', 'its plain `generate` fails on a tiny config'),
    'dots3_note_text': ('untested', 'its plain `generate` fails on a tiny config'),
    'ergo': ('tree', ''),
    'ernie4_5': ('tree', ''),
    'ernie4_5_moe': ('tree', ''),
    'exaone': ('tree', ''),
    'exaone4': ('tree', ''),
    'exaone_moe': ('tree', ''),
    'falcon': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'falcon_h1': ('chain', 'state-space / linear-attention / recurrent layers'),
    'falcon_mamba': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'flex_olmo': ('tree', ''),
    'flint': ('tree', ''),
    'gemma': ('tree', ''),
    'gemma2': ('tree', ''),
    'gemma3_text': ('tree', ''),
    'gemma3n_text': ('refused', 'several hidden-state streams per layer (hyper-connections / AltUp)'),
    'gemma4_text': ('chain', 'layers share KV caches'),
    'gemma4_unified_text': ('chain', 'layers share KV caches'),
    'glm': ('tree', ''),
    'glm4': ('tree', ''),
    'glm4_moe': ('tree', ''),
    'glm4_moe_lite': ('tree', ''),
    'glm_moe_dsa': ('chain', 'sparse-attention indexer cache (`DynamicIndexedLayer`)'),
    'gpt-sw3': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'gpt2': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'gpt_bigcode': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'gpt_neo': ('untested', 'its plain `generate` fails on a tiny config'),
    'gpt_neox': ('tree', ''),
    'gpt_neox_japanese': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'gpt_oss': ('tree', ''),
    'gptj': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'granite': ('tree', ''),
    'granite_swa': ('tree', ''),
    'granitemoe': ('tree', ''),
    'granitemoe_swa': ('tree', ''),
    'granitemoehybrid': ('chain', 'state-space / linear-attention / recurrent layers'),
    'granitemoeshared': ('tree', ''),
    'helium': ('tree', ''),
    'hrm_text': ('refused', 'no decoder `layers` (not a Llama-like layout)'),
    'hunyuan_v1_dense': ('tree', ''),
    'hunyuan_v1_moe': ('tree', ''),
    'hy_v3': ('tree', ''),
    'hy_v4': ('refused', 'several hidden-state streams per layer (hyper-connections / AltUp)'),
    'hyperclovax': ('tree', ''),
    'inkling2_loop_text': ('untested', 'its plain `generate` fails on a tiny config'),
    'inkling2_text': ('untested', 'its plain `generate` fails on a tiny config'),
    'inkling_text': ('chain', 'state-space / linear-attention / recurrent layers'),
    'internlm3': ('tree', ''),
    'iquestcoder': ('tree', ''),
    'jais2': ('tree', ''),
    'jamba': ('chain', 'state-space / linear-attention / recurrent layers'),
    'jetmoe': ('tree', ''),
    'kimi_linear': ('chain', 'state-space / linear-attention / recurrent layers'),
    'kolibri1': ('tree', ''),
    'kolibri1_1': ('untested', 'its plain `generate` fails on a tiny config'),
    'laguna': ('tree', ''),
    'lara_mini': ('chain', 'state-space / linear-attention / recurrent layers'),
    'lfm2': ('chain', 'state-space / linear-attention / recurrent layers'),
    'lfm2_moe': ('untested', 'its plain `generate` fails on a tiny config'),
    'lfm3': ('chain', 'state-space / linear-attention / recurrent layers'),
    'llama': ('tree', ''),
    'llama4_text': ('refused', 'no decoder `layers` (not a Llama-like layout)'),
    'longcat_flash': ('untested', 'its plain `generate` fails on a tiny config'),
    'mamba': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'mamba2': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'mellum': ('tree', ''),
    'mimo_v2_flash': ('tree', ''),
    'minicpm3': ('tree', ''),
    'minicpm5_moe': ('tree', ''),
    'minimax': ('refused', "state-space / linear-attention / recurrent layers; chain mode: transformers' assisted decoding fails on it"),
    'minimax_m2': ('tree', ''),
    'minimax_m3_vl_text': ('tree', ''),
    'ministral': ('tree', ''),
    'ministral3': ('tree', ''),
    'mistral': ('tree', ''),
    'mixtral': ('tree', ''),
    'modernbert-decoder': ('refused', 'no decoder `layers` (not a Llama-like layout)'),
    'mpt': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'nanochat': ('tree', ''),
    'nemotron': ('tree', ''),
    'nemotron_h': ('chain', 'state-space / linear-attention / recurrent layers'),
    'olmo': ('tree', ''),
    'olmo2': ('tree', ''),
    'olmo3': ('tree', ''),
    'olmo_hybrid': ('chain', 'state-space / linear-attention / recurrent layers'),
    'olmoe': ('tree', ''),
    'openai-gpt': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'opt': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'param2moe': ('tree', ''),
    'persimmon': ('tree', ''),
    'phi': ('tree', ''),
    'phi3': ('tree', ''),
    'phimoe': ('tree', ''),
    'qwen2': ('tree', ''),
    'qwen2_moe': ('tree', ''),
    'qwen3': ('tree', ''),
    'qwen3_5_moe_text': ('chain', 'state-space / linear-attention / recurrent layers'),
    'qwen3_5_text': ('chain', 'state-space / linear-attention / recurrent layers'),
    'qwen3_moe': ('tree', ''),
    'qwen3_next': ('chain', 'state-space / linear-attention / recurrent layers'),
    'qwen4_exp_text': ('untested', 'its plain `generate` fails on a tiny config'),
    'recurrent_gemma': ('refused', "state-space / linear-attention / recurrent layers; chain mode: transformers' assisted decoding fails on it"),
    'rwkv': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'sarvam_mla': ('tree', ''),
    'sarvam_moe': ('tree', ''),
    'seed_oss': ('tree', ''),
    'smollm3': ('tree', ''),
    'solar_open': ('tree', ''),
    'stablelm': ('tree', ''),
    'starcoder2': ('tree', ''),
    'trocr': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'vaultgemma': ('tree', ''),
    'xglm': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'xlnet': ('refused', 'config without Llama-style sizes (GPT-2 / Mamba style layout)'),
    'xlstm': ('untested', 'its plain `generate` fails on a tiny config'),
    'youtu': ('tree', ''),
    'zamba': ('untested', 'its plain `generate` fails on a tiny config'),
    'zamba2': ('chain', 'state-space / linear-attention / recurrent layers'),
    'zaya': ('untested', 'its plain `generate` fails on a tiny config'),
}

HEADINGS = {
    "tree": "Tree mode (the default) and chain mode: identical to plain `generate`",
    "chain": 'Tree mode refused before any work; `dart_mode="chain"`: identical to plain `generate`',
    "refused": "Refused in both modes, with a clear error",
    "untested": "Not tested: the tiny target's own plain `generate` fails in transformers",
}


def markdown() -> str:
    """docs/TARGETS.md's table of model types by verdict (and reason), from MATRIX."""
    lines = [
        f"<!-- generated by `python -m dart_hf.tools.targets` from dart_hf/tools/targets.py MATRIX; "
        f"tests/test_target_matrix.py checks every row against tiny targets (transformers {TESTED_WITH}) -->",
        "| what DART does | why | model types |",
        "|---|---|---|",
    ]
    for verdict, heading in HEADINGS.items():
        reasons: dict[str, list[str]] = {}
        for model_type, (v, why) in sorted(MATRIX.items()):
            if v == verdict:
                reasons.setdefault(why, []).append(model_type)
        for why, types in reasons.items():
            lines.append(f"| {heading} | {why or '-'} | {', '.join(types)} |")
    return "\n".join(lines)


def short_reason(verdict: str, detail: str) -> str:
    """The `why` column for a measured (verdict, detail) of tests/test_target_matrix.py."""
    if verdict == "tree":
        return ""
    if verdict == "untested":
        return "its plain `generate` fails on a tiny config"
    for key, why in (
        ("recurrent layers", "state-space / linear-attention / recurrent layers"),
        ("DynamicIndexedLayer", "sparse-attention indexer cache (`DynamicIndexedLayer`)"),
        ("share KV caches", "layers share KV caches"),
        ("chunked-attention", "chunked attention"),
        ("hidden-state streams", "several hidden-state streams per layer (hyper-connections / AltUp)"),
        ("has no decoder `layers`", "no decoder `layers` (not a Llama-like layout)"),
        ("its config has no", "config without Llama-style sizes (GPT-2 / Mamba style layout)"),
    ):
        if key in detail:
            return why + ("; chain mode: transformers' assisted decoding fails on it"
                          if "Chain mode cannot run it either" in detail else "")
    return detail.split(":")[0][:80]


def _measure() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_target_matrix import observe  # noqa: E402 (the test's measurement, run over every type)

    print("MATRIX: dict[str, tuple[str, str]] = {")
    for model_type in decoder_only_model_types():
        try:
            verdict, detail = observe(model_type)
        except Exception as err:  # a silent difference or an unclear error: the test fails on it
            verdict, detail = "FAILS", f"{type(err).__name__}: {err}"
        print(f"    {model_type!r}: ({verdict!r}, {short_reason(verdict, detail)!r}),", flush=True)
    print("}")


if __name__ == "__main__":
    import sys

    if "--measure" in sys.argv:
        _measure()
    else:
        print(markdown())
