"""Everything the head needs from the target: its shape, its decoder layers, and their captured inputs.

The checks here are the contract that a head never drafts for a target it was not built for: a
mismatched hidden size or vocab would otherwise fail deep inside a matmul, or worse, run and draft
garbage from the wrong layers.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration import DartConfig, default_aux_layer_ids


def text_config(target: PreTrainedModel):
    return target.config.get_text_config()


def decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    """The target's decoder layers (`model.layers` in Llama/Qwen2/Qwen3/Mistral/Gemma layouts)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(target).__name__} has no decoder `layers` ModuleList; DART supports decoder-only "
            "causal LMs laid out like Llama / Qwen / Mistral / Gemma"
        )
    return layers


def _rope_parameters(cfg) -> dict:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3): the head attends globally
        rope = dict(rope["full_attention"])
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    return rope


def dart_config_for_target(
    target: PreTrainedModel, draft_length: int = 7, draft_vocab_size: int | None = None, **overrides
) -> DartConfig:
    """A DartConfig whose layer has the target's width, heads and RoPE (EAGLE-3 / DART sizing)."""
    if target.config.is_encoder_decoder:
        raise ValueError("DART drafts for decoder-only targets; got an encoder-decoder model")
    cfg = text_config(target)
    n_layers = cfg.num_hidden_layers
    fields = dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(cfg),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 8192),
        vocab_size=cfg.vocab_size,
        draft_vocab_size=draft_vocab_size,
        draft_length=draft_length,
        target_hidden_size=cfg.hidden_size,
        target_num_layers=n_layers,
        target_model_type=cfg.model_type,
        aux_layer_ids=default_aux_layer_ids(n_layers),
    )
    fields.update(overrides)
    return DartConfig(**fields)


def check_head_matches_target(head, target: PreTrainedModel) -> None:
    """Raise a ValueError naming the first field where the head and the target disagree."""
    if target.config.is_encoder_decoder:
        raise ValueError("DART drafts for decoder-only targets; got an encoder-decoder model")
    hc, tc = head.config, text_config(target)
    checks = [
        ("hidden size", hc.target_hidden_size, tc.hidden_size),
        ("vocab size", hc.vocab_size, tc.vocab_size),
        ("number of layers", hc.target_num_layers, tc.num_hidden_layers),
    ]
    if hc.target_model_type is not None:
        checks.append(("model type", hc.target_model_type, tc.model_type))
    for what, built_for, got in checks:
        if built_for != got:
            override = " (set head.config.target_model_type = None to override)" if what == "model type" else ""
            raise ValueError(
                f"DART head was built for a target with {what} {built_for!r}, but this target has {got!r}{override}"
            )
    n_layers = len(decoder_layers(target))
    if any(not 0 <= i < n_layers for i in hc.aux_layer_ids):
        raise ValueError(f"aux_layer_ids {hc.aux_layer_ids} do not exist in a target with {n_layers} layers")
    if hc.uses_target_lm_head:
        out = target.get_output_embeddings()
        if out is None or out.weight.shape[0] != hc.vocab_size:
            raise ValueError("a head tied to the target lm_head needs a target lm_head over the full vocab")


class AuxHiddenCapture:
    """Forward pre-hooks that keep the INPUTS of the target layers `layer_ids` from the latest forward.

    Hooks avoid asking the target for all hidden states (memory, and not every model returns them the same
    way). Use as a context manager so the hooks never outlive the decoding call.
    """

    def __init__(self, target: PreTrainedModel, layer_ids: list[int], keep_all: bool = False):
        self._captured: list[torch.Tensor | None] = [None] * len(layer_ids)
        self.keep_all = keep_all  # record every forward (training data), not only the latest (decoding)
        self.history: list[torch.Tensor] = []
        layers = decoder_layers(target)
        self._handles = [
            layers[i].register_forward_pre_hook(partial(self._record, slot), with_kwargs=True)
            for slot, i in enumerate(layer_ids)
        ]

    def _record(self, slot: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._captured[slot] = args[0] if args else kwargs["hidden_states"]
        if self.keep_all and all(t is not None for t in self._captured):
            self.history.append(self.take())

    def take(self, device: torch.device | None = None) -> torch.Tensor:
        """[B, S, 3 * hidden] for the latest forward's S positions (moved to `device`), then forget them."""
        if any(t is None for t in self._captured):
            raise RuntimeError("no target forward was captured since the last take()")
        device = device or self._captured[0].device
        out = torch.cat([t.to(device) for t in self._captured], dim=-1)
        self._captured = [None] * len(self._captured)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "AuxHiddenCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


# ---------------------------------------------------------------------------------------------- placement
# Putting a loaded head where its target can use it: the target's floating dtype, beside its last decoder layer.
# 
# Why the last decoder layer: with `device_map="auto"` a target is split over devices, and `target.device` only
# names where its first parameters live. The head's logits feed the tree that the target verifies, and the
# captured hidden states are moved to the head anyway (`AuxHiddenCapture.take`), so the head belongs where the
# target's final states are computed. Why the embedding's dtype: quantised targets (bitsandbytes) keep int8 / 4-bit
# linear weights, but their embeddings and hidden states stay in the floating dtype the head must match.
def module_device(module: nn.Module) -> torch.device:
    """Where `module` computes: accelerate's execution device when it is offloaded, else its parameters' device."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return next(module.parameters()).device


def head_placement(target: PreTrainedModel) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) a head should have to draft for `target`."""
    return module_device(decoder_layers(target)[-1]), target.get_input_embeddings().weight.dtype


def prepare_head(head: nn.Module, target: PreTrainedModel) -> nn.Module:
    """Move and cast `head` (in place, as `nn.Module.to` does) for `target`; integer buffers keep their dtype."""
    device, dtype = head_placement(target)
    return head.to(device=device, dtype=dtype)
