# Generated from dart_hf/placement.py (dart_hf 0.1.0) by dart_hf.hub.write_custom_generate. Do not edit.
"""Putting a loaded head where its target can use it: the target's floating dtype, beside its last decoder layer.

Why the last decoder layer: with `device_map="auto"` a target is split over devices, and `target.device` only
names where its first parameters live. The head's logits feed the tree that the target verifies, and the
captured hidden states are moved to the head anyway (`AuxHiddenCapture.take`), so the head belongs where the
target's final states are computed. Why the embedding's dtype: quantised targets (bitsandbytes) keep int8 / 4-bit
linear weights, but their embeddings and hidden states stay in the floating dtype the head must match.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from .modeling_dart import DartHead
from .target_binding import decoder_layers


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


def prepare_head(head: DartHead, target: PreTrainedModel) -> DartHead:
    """Move and cast `head` (in place, as `nn.Module.to` does) for `target`; integer buffers keep their dtype."""
    device, dtype = head_placement(target)
    return head.to(device=device, dtype=dtype)


__all__ = ["head_placement", "module_device", "prepare_head"]
