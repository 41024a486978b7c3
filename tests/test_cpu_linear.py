"""The few-row CPU linear: same numbers as F.linear, installed only where safe, always removed again."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_head, make_target, prompts
from dart_hf.core import cpu_linear
from dart_hf.core.cpu_linear import few_row_linear, few_row_linears


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    w, b = torch.randn(48, 32), torch.randn(48) if bias else None
    x = torch.randn(1, rows, 32)
    torch.testing.assert_close(few_row_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_output_is_row_major_so_attention_keeps_its_fused_kernel(rows):
    # a column-major q/k/v makes SDPA on CPU fall back from the flash kernel to the math path (~8 ms of a
    # 4-token SmolLM2 verify)
    out = few_row_linear(torch.randn(1, rows, 32), torch.randn(48, 32), None)
    assert out.is_contiguous()
    q = out.view(1, rows, 3, 16).transpose(1, 2)
    with torch.profiler.profile() as prof:
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(rows, rows, dtype=torch.bool))
    kernels = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in kernels, kernels


@pytest.mark.parametrize("threads", [2, 1])
def test_uses_the_weight_stationary_product_only_for_few_rows(monkeypatch, threads):
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(cpu_linear.torch, "mm", lambda a, b: calls.append(b.shape[1]) or real_mm(a, b))
    monkeypatch.setattr(cpu_linear.torch, "get_num_threads", lambda: threads)
    w = torch.randn(16, 8)
    rows = (1, 2, cpu_linear.ONE_THREAD_MAX_ROWS, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 64)
    for n in rows:
        x = torch.randn(n, 8)
        torch.testing.assert_close(few_row_linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    small = [2, 2, cpu_linear.ONE_THREAD_MAX_ROWS]  # one row is computed as two: MKL's matrix-vector path is slower
    assert calls == small + ([cpu_linear.MAX_ROWS] if threads > 1 else [])
    calls.clear()  # a large weight (an output projection) keeps the product up to MAX_ROWS on one thread too
    monkeypatch.setattr(cpu_linear, "LARGE_WEIGHT", w.numel())
    for n in rows:
        few_row_linear(torch.randn(n, 8), w, None)
    assert calls == small + [cpu_linear.MAX_ROWS]


def test_patches_only_plain_fp32_cpu_linears_and_restores_them():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    hooked = model[2]
    hooked.forward = hooked.forward  # an instance-level forward, as accelerate's offload hooks install
    with few_row_linears(model) as count:
        assert count == 1 and "forward" in model[0].__dict__
        x = torch.randn(3, 8)
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias))
    assert "forward" not in model[0].__dict__ and "forward" not in model[1].__dict__
    assert "forward" in hooked.__dict__  # someone else's forward is left alone


def test_generate_routes_linears_through_it_and_leaves_them_unpatched(monkeypatch):
    target = make_target("llama")
    head = make_head(target)
    rows = []
    real = cpu_linear.few_row_linear
    monkeypatch.setattr(cpu_linear, "few_row_linear", lambda x, w, b: rows.append(x.shape[-2]) or real(x, w, b))
    out = target.generate(prompts(1)[0], assistant_model=head, do_sample=False, max_new_tokens=8)
    assert torch.equal(out, target.generate(prompts(1)[0], do_sample=False, max_new_tokens=8))
    assert rows and max(rows) > 1  # tree verify and head forwards went through it
    for m in [*target.modules(), *head.modules()]:
        assert "forward" not in m.__dict__, type(m).__name__
