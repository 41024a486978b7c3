"""Few-row fp32 `nn.Linear` on CPU: the matmul layout that makes a small tree cost about one token.

Why: for `x @ W.T` with a few rows, MKL's sgemm packs the weight before multiplying, so on a small CPU a few-token
forward cost well over a 1-token one although both are bound by streaming the weights once. Computing `(W @ x.T).T`
puts the weight in the operand MKL streams without packing, so a small tree verifies in about the time of one decode
step (`dart-hf calibrate` prints the verify cost curve). From about MAX_ROWS rows the packed kernel is as fast, so larger
inputs and the prefill keep `F.linear`.

One row goes through the same product with the row written twice: MKL's matrix-vector path (what `F.linear` runs
for one row) can stream the weights more slowly than the 2-column product, so a head drafting one row, or a 1-token
target forward, would pay more than a 2-token one. Plain `generate` runs that slower path for every token, which is part of every
CPU speed-up measured against it; `dart-hf bench` reports plain `generate` inside `few_row_linears` as a
kernel-matched reference (BENCHMARKS.md).

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

MAX_ROWS = 8
# On ONE thread the packed kernel already wins from ONE_THREAD_MAX_ROWS + 1 rows for weights that are not large:
# SmolLM2's 1-token forward of 8 rows took 138 ms with every linear here and 125 ms with only its 28M-element output
# projection here (F.linear for all: 129 ms; 2 threads: 87 / 101 / 113 ms, so more threads keep MAX_ROWS).
ONE_THREAD_MAX_ROWS = 4
LARGE_WEIGHT = 16_000_000  # elements (64 MB in fp32): output projections, bound by streaming the weight


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, as `(weight @ x.T).T` when x holds 1..MAX_ROWS rows (one row written twice);
    on one CPU thread, 1..ONE_THREAD_MAX_ROWS rows, or up to MAX_ROWS for a weight of LARGE_WEIGHT elements."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= MAX_ROWS or (rows > ONE_THREAD_MAX_ROWS and weight.numel() < LARGE_WEIGHT
                                    and torch.get_num_threads() == 1):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:
        x2 = x2.repeat(2, 1)  # a real copy: a stride-0 expand sends MKL down a slower path than F.linear
    out = torch.mm(weight, x2.t())[:, :rows].t().contiguous().reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _eligible(module: nn.Module) -> bool:
    """Plain fp32 CPU linears whose forward nobody else replaced (accelerate's offload hooks, quantizers)."""
    return (
        type(module) is nn.Linear
        and "forward" not in module.__dict__
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    )


def eligible_linears(*models: nn.Module) -> list[nn.Linear]:
    """The linears of `models` that `few_row_linears` would route (empty on GPU, in bf16, under quantizers)."""
    return [m for model in models for m in model.modules() if _eligible(m)]


@contextmanager
def few_row_linears(*models: nn.Module) -> Iterator[int]:
    """Route the eligible linears of `models` through `few_row_linear` inside the block; yields their count."""
    patched = eligible_linears(*models)
    for m in patched:
        m.forward = lambda x, m=m: few_row_linear(x, m.weight, m.bias)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward
