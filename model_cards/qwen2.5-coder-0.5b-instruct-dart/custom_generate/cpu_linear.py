"""Few-row fp32 `nn.Linear` on CPU: the matmul kernels that make a small tree cost about one decode step.

Why: every verify forward streams all the target's weights once, so up to a few dozen rows it should cost about what
one row costs. `F.linear` (MKL sgemm on `x @ W.T`) packs the weight first, and on a 2-core CPU a 4-token SmolLM2
verify cost 1.7x a 1-token step. Two kernels do better, by number of rows (BENCHMARKS.md has the curves):
- 2..MMT_MAX_ROWS rows: `(W @ x.T).T`, made row-major again (a column-major q/k/v pushes SDPA off its fused kernel):
  the weight is the operand MKL streams without packing;
- MMT_MAX_ROWS+1..ONEDNN_MAX_ROWS rows: oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`, the kernel
  PyTorch's own CPU inference compiler emits), which stays nearly flat from 2 to 16 rows where `(W @ x.T).T` grows
  1.6x from 4 to 8 rows. On SmolLM2, interleaved: 8 tokens 85 ms against 117 ms, 16 tokens 107 against 142. Below
  5 rows `(W @ x.T).T` is faster still. Where PyTorch has no oneDNN, or under autograd (the op has no
  backward; DART decodes under no_grad), `F.linear`.
One row (the decode step) and the prefill keep `F.linear`, so a prompt's first token is computed exactly as plain
`generate` computes it.

`few_row_linears(*models)` installs this on the fp32 CPU `nn.Linear` layers of the given models and restores them on
exit; `dart_hf.core.runtime` enters it once per DART call, for the target and the head. Results differ from
`F.linear` only in float rounding order, as any N-token forward already differs from N one-token forwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MMT_MAX_ROWS = 4
ONEDNN_MAX_ROWS = 64  # from ~96 rows (prefill sizes) F.linear is as fast


def _onednn_linear_op():
    """oneDNN's dense linear op, or None where this PyTorch build has none (or it fails a small check)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w, b = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3)
        if not torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), rtol=1e-4, atol=1e-5):
            return None
    except (AttributeError, RuntimeError):
        return None
    return op


_ONEDNN_LINEAR = _onednn_linear_op()


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the kernel that is fastest for x's number of rows (module docstring)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 1 < rows <= MMT_MAX_ROWS:
        out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()
        return (out if bias is None else out + bias).reshape(*x.shape[:-1], weight.shape[0])
    if MMT_MAX_ROWS < rows <= ONEDNN_MAX_ROWS and _ONEDNN_LINEAR is not None and not torch.is_grad_enabled():
        out = _ONEDNN_LINEAR(x.reshape(rows, x.shape[-1]).contiguous(), weight, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _eligible(module: nn.Module) -> bool:
    """Plain fp32 CPU linears whose forward nobody else replaced (accelerate's offload hooks, quantizers)."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    )


@contextmanager
def few_row_linears(*models: nn.Module) -> Iterator[int]:
    """Route the eligible linears of `models` through `few_row_linear` inside the block; yields their count."""
    patched = [m for model in models for m in model.modules() if _eligible(m)]
    for m in patched:
        m.forward = lambda x, m=m: few_row_linear(x, m.weight, m.bias)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward
