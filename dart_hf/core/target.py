"""Everything the head needs from the target: its shape, its decoder layers, and their captured inputs.

The checks here are the contract that a head never drafts for a target it was not built for: a
mismatched hidden size or vocab would otherwise fail deep inside a matmul, or worse, run and draft
garbage from the wrong layers.
"""

from __future__ import annotations

import inspect
from functools import lru_cache, partial

import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration import check_config_matches_target, dart_config_for_target  # noqa: F401 (re-exported)


def cache_kwargs(model: nn.Module, cache) -> dict:
    """`{name: cache}` for this model's forward: transformers 5.24 renamed `past_key_values` to `cache`, while model
    code written before (remote-code targets) takes only `past_key_values` and may swallow an unknown `cache=` in
    `**kwargs`, which would run the target WITHOUT its KV cache."""
    return {_cache_parameter(type(model)): cache}


@lru_cache(maxsize=None)
def _cache_parameter(model_class: type) -> str:
    """Read once per model class (every verify step asks): the class's forward, not an instance's hook wrapper."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


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


def check_head_matches_target(head, target: PreTrainedModel) -> None:
    """Raise a ValueError naming the first field where the head and the target disagree
    (`check_config_matches_target`), and a TypeError when the target has no decoder layers to capture."""
    check_config_matches_target(head.config, target)
    decoder_layers(target)


class AuxHiddenCapture:
    """Forward pre-hooks that keep the INPUTS of the target layers `layer_ids` from the latest forward.

    Hooks avoid asking the target for all hidden states (memory, and not every model returns them the same
    way). Use as a context manager so the hooks never outlive the decoding call.
    """

    def __init__(self, target: PreTrainedModel, layer_ids: list[int]):
        self._captured: list[torch.Tensor | None] = [None] * len(layer_ids)
        layers = decoder_layers(target)
        self._handles = [
            layers[i].register_forward_pre_hook(partial(self._record, slot), with_kwargs=True)
            for slot, i in enumerate(layer_ids)
        ]

    def _record(self, slot: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._captured[slot] = args[0] if args else kwargs["hidden_states"]

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
    """Move and cast `head` (in place, as `nn.Module.to` does) for `target`; integer buffers keep their dtype.

    `generate(assistant_model=head)` calls this on every call: the first call with a target moves the user's head
    (once), later calls find it in place and change nothing."""
    device, dtype = head_placement(target)
    weight = next(head.parameters())
    if weight.device == device and weight.dtype == dtype:
        return head
    return head.to(device=device, dtype=dtype)
