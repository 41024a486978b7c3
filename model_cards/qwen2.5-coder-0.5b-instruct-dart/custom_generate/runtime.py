"""Every temporary change DART makes to a target, made on entry of ONE context manager and undone on exit.

A DART call needs three things the target does not do by itself:
- the inputs of the decoder layers `aux_layer_ids` (forward pre-hooks, `AuxHiddenCapture`);
- on CPU, few-row fp32 linears (`cpu_linear.few_row_linears`) on the target and the head;
- on CPU with SDPA, a verify attention that keeps grouped K/V heads grouped under a mask
  (`verify.grouped_sdpa_attention_forward`), reached by naming it in `target.config._attn_implementation`, which
  needs the name registered with transformers' attention and mask interfaces.

`dart_runtime` is entered once per `generate` call (tree loop: around `dart_decode`; chain mode: around transformers'
own `generate`), so nothing is swapped per step and nothing outlives the call. Registration with transformers is
counted: the first active runtime registers the attention, the last one to exit removes it; nothing is registered at
import. Entries nest: an inner entry on a target whose attention is already switched leaves it alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cpu_linear import few_row_linears
from .target import AuxHiddenCapture
from .verify import GROUPED_SDPA, grouped_sdpa_attention_forward

_lock = threading.Lock()
_registered = 0  # active runtimes that rely on the GROUPED_SDPA registration


@contextmanager
def _grouped_attention_registered() -> Iterator[None]:
    global _registered
    with _lock:
        if _registered == 0:
            AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention_forward)
            AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
        _registered += 1
    try:
        yield
    finally:
        with _lock:
            _registered -= 1
            if _registered == 0:
                AttentionInterface._global_mapping.pop(GROUPED_SDPA, None)
                AttentionMaskInterface._global_mapping.pop(GROUPED_SDPA, None)


@contextmanager
def verify_attention(target: PreTrainedModel) -> Iterator[None]:
    """Inside the block an SDPA target on CPU runs `grouped_sdpa_attention_forward`, which is plain SDPA for
    unmasked calls (prefill, one-token steps) and grouped-KV SDPA for the masked tree verify. Other backends, other
    devices and nested entries are left as they are."""
    original = target.config._attn_implementation
    if original != "sdpa" or target.device.type != "cpu":
        yield
        return
    with _grouped_attention_registered():
        target.config._attn_implementation = GROUPED_SDPA
        try:
            yield
        finally:
            target.config._attn_implementation = original


@contextmanager
def verify_runtime(target: PreTrainedModel, *models: nn.Module) -> Iterator[None]:
    """The verify-time changes without the capture hooks: what measuring a verify forward must run under
    (`dart_hf.core.budget`) so it measures the forward the loop runs."""
    with verify_attention(target), few_row_linears(target, *models):
        yield


class DartRuntime:
    """Handle of an active `dart_runtime`: the captured layer inputs of the latest target forward."""

    def __init__(self, capture: AuxHiddenCapture):
        self._capture = capture

    def take_aux(self, device: torch.device | None = None) -> torch.Tensor:
        """[1, S, 3 * hidden]: the aux states of the latest target forward's S positions (then forgotten)."""
        return self._capture.take(device)


@contextmanager
def dart_runtime(target: PreTrainedModel, head: nn.Module) -> Iterator[DartRuntime]:
    """Capture hooks, few-row linears and the verify attention for one DART call on `target` with `head`."""
    with ExitStack() as stack:
        capture = stack.enter_context(AuxHiddenCapture(target, head.config.aux_layer_ids))
        stack.enter_context(verify_runtime(target, head))
        yield DartRuntime(capture)
