"""`dart-hf bench --synthetic --compiled --batch-size 1 8 32` (gpu_check.sh part 7), on CPU with a tiny shape: the
compiled section per batch size, every row of DART's batched output compared with plain's, and the CLI wiring."""

from __future__ import annotations

import json

import pytest
import torch

from dart_hf.core.modeling import DartHead
from dart_hf.tools import bench, bench_synthetic
from dart_hf.tools.bench_synthetic import run_synthetic
from dart_hf_cli import build_parser

pytestmark = pytest.mark.usefixtures("private_cache")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=96, max_position_embeddings=512, tie_word_embeddings=False)


def tiny_run(out_dir, **kwargs) -> dict:
    return run_synthetic(TINY, device="cpu", dtype=torch.float32, budgets=(3, 7), prompt_len=16, new_tokens=8,
                         cost_sizes=(1, 4), repeats=1, out_dir=out_dir, progress=False, compiled=True,
                         compile_backend="eager", **kwargs)


def test_compiled_section_per_batch_size_on_a_tiny_shape(tmp_path):
    results = tiny_run(tmp_path, batch_sizes=(2, 1))
    c = results["compiled"]
    assert c["backend"] == "eager" and c["batch_sizes"] == [1, 2] and list(c["batches"]) == ["2"]
    parts = {1: c, 2: c["batches"]["2"]}  # batch size 1 where a one-row run puts it
    for b, part in parts.items():
        assert part["batch_size"] == b and part["plain_equal_to_eager"] is True
        assert part["plain_step_ms"] > 0 and part["plain_ms_per_row_token"] == pytest.approx(part["plain_step_ms"] / b)
        assert [r["node_budget"] for r in part["budgets"]] == [3, 7]
        for r in part["budgets"]:
            # True only when every row of DART's compiled batch equals plain eager generate's on the same batch
            assert r["output_equal_to_plain"] is True, (b, r)
            assert r["compiled"] and r["static_reason"] is None
            assert r["step_ms"] > 0 and r["ms_per_row_token"] > 0 and r["row_token_over_plain_compiled"] > 0
            assert r["step_over_plain_compiled_step"] > 0
            assert all(v != v for v in r["phase_ms"].values())  # no split in a run of several batch sizes
    saved = json.loads((tmp_path / "synthetic.json").read_text())
    assert saved["compiled"]["batches"]["2"]["budgets"][1]["output_equal_to_plain"] is True
    md = (tmp_path / "synthetic.md").read_text().split("## Static cache + torch.compile (eager)")[1]
    assert "| batch | budget | step ms | / plain compiled step | ms per row token |" in md
    for b in (1, 2):
        assert md.count(f"\n| {b} | ") == 3  # plain's row, then a row per budget
        for budget in (3, 7):
            assert f"\n| {b} | {budget} | " in md
    assert "**7-node DART compiled step / plain compiled step: " in md


def test_a_row_that_differs_from_plain_is_reported():
    """The equality fields are no formality: against a reference whose last row differs (as a DART batch with one
    wrong row would), plain's and every budget's are False."""
    target = bench_synthetic.synthetic_target(TINY, "cpu", torch.float32)
    torch.manual_seed(0)
    head = DartHead.from_target(target, draft_length=4).eval()
    ids = torch.randint(TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=4, attention_mask=torch.ones_like(ids))
    wrong = target.generate(ids, **gen)
    wrong[-1, -1] = (wrong[-1, -1] + 1) % TINY["vocab_size"]
    part = bench_synthetic._synthetic_compiled(target, head, ids, gen, (3,), wrong, "eager", False, split=False)
    assert part["batch_size"] == 2 and part["plain_equal_to_eager"] is False
    assert [r["output_equal_to_plain"] for r in part["budgets"]] == [False]
    lines = bench_synthetic._synthetic_compiled_lines({"backend": "eager", "batches": {"2": part}})
    assert next(line for line in lines if line.startswith("| 2 | 3 | ")).endswith("| no |")


def test_batch_sizes_need_the_compiled_part():
    with pytest.raises(ValueError, match="compiled"):
        run_synthetic(TINY, device="cpu", batch_sizes=(1, 2))
    with pytest.raises(ValueError, match=">= 1"):
        run_synthetic(TINY, device="cpu", compiled=True, batch_sizes=(0, 2))


def test_cli_passes_batch_sizes_to_the_synthetic_bench(tmp_path, monkeypatch, capsys):
    """`--synthetic --compiled --batch-size 1 8 32` reaches `run_synthetic` (faked here: no GPU); sizes past 1
    without --compiled, or under 1, are refused before any model is built."""

    def parse(*argv):
        return build_parser().parse_args(["bench", "--synthetic", "--out", str(tmp_path), *argv])

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_synthetic", lambda **kw: calls.append(kw) or {})
    monkeypatch.setattr(bench, "synthetic_markdown", lambda results: "report")
    assert bench.main(parse("--compiled", "--batch-size", "1", "8", "32", "--budget", "7", "31")) == 0
    assert calls[-1]["batch_sizes"] == (1, 8, 32) and calls[-1]["budgets"] == (7, 31) and calls[-1]["compiled"]
    assert bench.main(parse()) == 0 and calls[-1]["batch_sizes"] == (1,)
    assert bench.main(parse("--batch-size", "8")) == 2
    assert "--batch-size" in capsys.readouterr().err and len(calls) == 2
    assert bench.main(parse("--compiled", "--batch-size", "0", "8")) == 2
    assert ">= 1" in capsys.readouterr().err and len(calls) == 2
