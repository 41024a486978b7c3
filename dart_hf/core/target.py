"""Everything DART needs from the target: its shape, its decoder layers and their captured inputs, and the verify
forward both step backends run (`target_forward`: the cache keyword, the layer states, the masks in the form its
attention takes).

The checks here are the contract that a head never drafts for a target it was not built for: a
mismatched hidden size or vocab would otherwise fail deep inside a matmul, or worse, run and draft
garbage from the wrong layers.
"""

from __future__ import annotations

import inspect
import threading

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from .configuration import check_config_matches_target, dart_config_for_target  # noqa: F401 (re-exported)


def cache_kwargs(model: nn.Module, cache) -> dict:
    """`{name: cache}` for this model's forward: transformers 5.24 renamed `past_key_values` to `cache`, while model
    code written before (remote-code targets) takes only `past_key_values` and may swallow an unknown `cache=` in
    `**kwargs`, which would run the target WITHOUT its KV cache."""
    return {_cache_parameter(type(model)): cache}


_CACHE_PARAMETER: dict[type, str] = {}


def _cache_parameter(model_class: type) -> str:
    """Read once per model class (every verify step asks): the class's forward, not an instance's hook wrapper. A
    plain dict, not `lru_cache`: the compiled static step traces this lookup."""
    if model_class not in _CACHE_PARAMETER:
        params = inspect.signature(model_class.forward).parameters
        _CACHE_PARAMETER[model_class] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_PARAMETER[model_class]


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


def aux_request(layer_ids: list[int]) -> dict:
    """The forward keyword that makes a transformers model return the inputs of the decoder layers `layer_ids`.

    Why ask the forward instead of hooking the layers: transformers records hidden states per call (its collector
    lives in a ContextVar), so a forward running in another thread at the same time can neither read nor overwrite
    them, and nothing is installed on the shared target. `hidden_states[i]` is the input of layer i (index 0: the
    embeddings), and a list of indices keeps only those layers' states (the rest come back as None)."""
    return {"output_hidden_states": list(layer_ids)}


def aux_states(outputs, layer_ids: list[int], device: torch.device | None = None) -> torch.Tensor:
    """[B, S, len(layer_ids) * hidden]: the inputs of the layers `layer_ids` for the S positions of the forward that
    returned `outputs` (called with `aux_request`), concatenated in `layer_ids` order and moved to `device`."""
    states = getattr(outputs, "hidden_states", None)
    if states is None or len(states) <= max(layer_ids) or any(states[i] is None for i in layer_ids):
        raise RuntimeError(
            f"the target returned no hidden states for layers {list(layer_ids)}: DART reads them through "
            "`output_hidden_states`, which this model's forward does not honour"
        )
    device = device or states[layer_ids[0]].device
    return torch.cat([states[i].to(device) for i in layer_ids], dim=-1)


def target_forward(target: nn.Module, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor, cache,
                   aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward over draft nodes, as every DART step runs it (the eager and the static step alike): its
    cache under the keyword this model takes (`cache_kwargs`), every position's logits, and the inputs of the layers
    the head reads (`aux_request` / `aux_states`, checked). Returns (float logits [rows, N, vocab], states
    [rows, N, 3 * hidden])."""
    out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                 logits_to_keep=0, **cache_kwargs(target, cache), **aux_request(aux_layer_ids))
    return out.logits.float(), aux_states(out, aux_layer_ids)


# ---------------------------------------------------------------------------------------------- masks
# What the verify forwards of both step backends hand the target's attention: the window of each layer and the
# mask in the form its attention backend takes.
def layer_windows(config) -> list[int | None]:
    """The sliding window of each decoder layer of a target with this config (None: full attention), read from the
    cache transformers would build for it. Layers tree verification cannot roll back are refused before any work
    (`dart_hf.core.support.check_tree_target`)."""
    return [int(layer.sliding_window) if getattr(layer, "is_sliding", False) else None
            for layer in DynamicCache(config=config).layers]


def backend_mask(visible: torch.Tensor, attn_implementation: str, dtype: torch.dtype):
    """`visible` [rows, N, KV] (query i may attend to key slot j) in the form the target's attention backend takes as
    its `attention_mask`: bool [rows, 1, N, KV] for SDPA, 0 / -inf of `dtype` for eager, a BlockMask for FlexAttention."""
    rows, n, kv = visible.shape
    if attn_implementation == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            return visible[b, q_idx, kv_idx]

        return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=n, KV_LEN=kv, device=visible.device)
    visible = visible.unsqueeze(1)
    if attn_implementation == "sdpa":
        return visible
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


# ---------------------------------------------------------------------------------------------- placement
# Putting a loaded head where its target can use it: the target's floating dtype, beside its last decoder layer.
# 
# Why the last decoder layer: with `device_map="auto"` a target is split over devices, and `target.device` only
# names where its first parameters live. The head's logits feed the tree that the target verifies, and the
# captured hidden states are moved to the head anyway (`aux_states`), so the head belongs where the
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


_placement_lock = threading.Lock()


def prepare_head(head: nn.Module, target: PreTrainedModel) -> nn.Module:
    """The head to draft with for `target`: `head` itself, placed for it, or a placed copy.

    A head's first call moves and casts it in place (as `nn.Module.to` does; integer buffers keep their dtype), so a
    head that serves one target costs no second copy. After that the head is never moved again, since another thread
    may be drafting with it: a call for a target on another device or dtype gets a copy placed for that target, made
    once and kept on the head (`_placed_copies`), so a head never changes under a call that drafts with it. A head on the meta device (loaded without weights) is refused."""
    device, dtype = head_placement(target)
    with _placement_lock:
        weight = next(head.parameters())
        if weight.device.type == "meta":
            raise ValueError("the DART head's weights are on the meta device (loaded without weights, e.g. under "
                             "`init_empty_weights` or with device_map='meta'); load it with from_pretrained first")
        if weight.device == device and weight.dtype == dtype:
            head._dart_placed = True
            return head
        if not head._dart_placed:
            head._dart_placed = True
            return head.to(device=device, dtype=dtype)
        copies = head._placed_copies
        if (device, dtype) not in copies:
            copy = type(head)(head.config).to(device=device, dtype=dtype)
            copy.load_state_dict(head.state_dict())
            copy.ngram = head.ngram
            copy.eval()
            copies[(device, dtype)] = copy
        return copies[(device, dtype)]
