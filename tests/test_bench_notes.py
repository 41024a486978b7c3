"""The bench's reports cannot mislead (issue 73): a figure timed while other processes kept the machine busy says so
beside it, and a DART method that decoded plainly in every call is not shown as a speed-up. Fake readings of other
processes' CPU use (`machine.CpuUse` replaced), no timing asserted."""

from __future__ import annotations

import os

import pytest

from conftest import prompts
from dart_hf.tools import bench_timing
from dart_hf.tools.bench_methods import standard_methods
from dart_hf.tools.bench_report import PLAIN_DECODING, batch_markdown_report, markdown_report
from dart_hf.tools.bench_timing import run_batched, run_rows

GEN = {"do_sample": False, "max_new_tokens": 4}


def fake_cpu_use(other_cores: float | None, load_busy: str | None = None):
    """A `CpuUse` whose every reading is `other_cores` (None: /proc/stat unread, `load_busy` the load average's
    verdict), on 2 cores."""

    class Fake:
        cores = 2

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.other_cores = other_cores

        def busy(self) -> str | None:
            return load_busy

    return Fake


def methods(*names: str):
    standard = {m.name: m for m in standard_methods(fixed_budget=[0, 5])}
    return [standard[n] for n in ("plain", *names)]


def rows_bench(bench_tiny, monkeypatch, reading, names=("dart_tree_0", "dart_tree_5")) -> dict:
    monkeypatch.setattr(bench_timing, "CpuUse", reading)
    target, head = bench_tiny
    return run_rows(target, head, {"x": prompts(2, seed=4)}, methods(*names), GEN, False, False, None, 1, 0)


def test_busy_machine_is_said_beside_every_figure(bench_tiny, monkeypatch):
    results = rows_bench(bench_tiny, monkeypatch, fake_cpu_use(1.5))
    rows = results["datasets"]["x"]
    assert all(r["other_cores"] == pytest.approx(1.5) for r in rows.values())
    assert rows["plain"]["busy"] == "other processes used 1.5 of the 2 cores on average while its calls were timed"
    md = markdown_report(results)
    assert "| DART tree, budget 5 | " in md and md.count("x (busy machine) |") == 2  # plain's 1.00x and budget 5's
    assert "- DART tree, budget 5: timed on a busy machine, other processes used 1.5 of the 2 cores" in md


def test_idle_machine_gets_no_note(bench_tiny, monkeypatch):
    results = rows_bench(bench_tiny, monkeypatch, fake_cpu_use(0.1), names=("dart_tree_5",))
    rows = results["datasets"]["x"]
    assert all(r["busy"] is None for r in rows.values())
    md = markdown_report(results)
    assert "busy" not in md and PLAIN_DECODING not in md


def test_the_real_reading_is_taken(bench_tiny):
    """Without a fake: every method's row carries other processes' CPU use (None only where /proc/stat is missing)."""
    target, head = bench_tiny
    rows = run_rows(target, head, {"x": prompts(1, seed=4)}, methods(), GEN, False, False, None, 1, 0)["datasets"]["x"]
    assert isinstance(rows["plain"]["other_cores"], float) or not os.path.exists("/proc/stat")
    assert "busy" in rows["plain"]


def test_load_average_where_cpu_use_is_unread(bench_tiny, monkeypatch):
    reading = fake_cpu_use(None, "the load average was 3.0 on 2 cores")
    rows = rows_bench(bench_tiny, monkeypatch, reading, names=("dart_tree_5",))["datasets"]["x"]
    assert rows["dart_tree_5"]["other_cores"] is None
    assert rows["dart_tree_5"]["busy"] == "the load average was 3.0 on 2 cores at 2 of its 2 timed calls"


def test_plain_decoding_inside_dart_is_no_speed_up(bench_tiny, monkeypatch):
    results = rows_bench(bench_tiny, monkeypatch, fake_cpu_use(0.0))
    rows = results["datasets"]["x"]
    assert rows["dart_tree_0"]["plain_decoding"] is True and rows["dart_tree_0"]["plain_calls"] == 2
    assert rows["dart_tree_5"]["plain_decoding"] is False and rows["dart_tree_5"]["plain_calls"] == 0
    assert "plain_decoding" not in rows["plain"]  # not a DART method
    md = markdown_report(results)
    assert f"| DART tree, budget 0 | {rows['dart_tree_0']['tokens_per_s']:.1f} | {PLAIN_DECODING} |" in md
    assert "- DART tree, budget 0: all 2 of its calls decoded plainly (node budget 0 in every step)" in md
    assert "is overhead and timing noise, not a speed-up" in md
    assert not any(line.startswith("- DART tree, budget 5") for line in md.splitlines())  # it drafted


def test_batched_report_has_the_notes(bench_tiny, monkeypatch):
    monkeypatch.setattr(bench_timing, "CpuUse", fake_cpu_use(1.2))
    target, head = bench_tiny
    results = run_batched(target, head, {"x": prompts(2, seed=5)}, methods("dart_tree_0", "dart_tree_5"),
                          {**GEN, "pad_token_id": 2}, [2], False, False, None, 1, 0)
    md = batch_markdown_report(results)
    assert f"| 2 | DART tree, budget 0 | {results['batches']['x']['2']['dart_tree_0']['tokens_per_s']:.1f} | " \
           f"{PLAIN_DECODING} |" in md
    assert "- DART tree, budget 0: all 1 of its calls at batch size 2 decoded plainly" in md
    assert "- generate: timed on a busy machine, other processes used 1.2 of the 2 cores" in md
