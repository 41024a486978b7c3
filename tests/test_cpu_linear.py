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
    out = few_row_linear(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert out.is_contiguous()  # row-major like F.linear's (a column-major q/k/v slows CPU SDPA down)


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
    """(With it, the tokens are plain `generate`'s: every fp32 CPU case of tests/test_lossless.py runs through it.)"""
    target = make_target("llama")
    head = make_head(target)
    rows = []
    real = cpu_linear.few_row_linear
    monkeypatch.setattr(cpu_linear, "few_row_linear", lambda x, w, b: rows.append(x.shape[-2]) or real(x, w, b))
    target.generate(prompts(1)[0], assistant_model=head, do_sample=False, max_new_tokens=8)
    assert rows and max(rows) > 1  # tree verify and head forwards went through it
    for m in [*target.modules(), *head.modules()]:
        assert "forward" not in m.__dict__, type(m).__name__
