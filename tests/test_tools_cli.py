"""`dart-hf demo`, the verify-cost measurement of `dart-hf bench --synthetic` and the command line's help, on tiny
targets. Nothing here asserts a timing: the measurements are faked where a check depends on their values.

- verify cost (`dart_hf.tools.verify_cost`, measured on demand, never stored): the time limit leaves the finer sizes
  out, never the smallest and the largest; the sizes are timed coarse to fine; the curve interpolates between them.
- demo: plain and DART alternate with the order flipped every pair; the summary takes medians, their quotient as the
  speed-up and the per-pair ratios' range; the whole command runs on a tiny target and head and leaves the caller's
  thread count as it was (busy machines, time limit: tests/test_new_user.py).
- every subcommand's --help shows its defaults, and no help text repeats one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_head, make_target, word_llama
from dart_hf.tools import demo, machine
from dart_hf.tools.verify_cost import VerifyCost, coverage_order, measure_verify_cost
from dart_hf_cli import build_parser
from dart_hf_cli import main as cli


pytestmark = pytest.mark.usefixtures("private_cache")


def test_the_time_limit_keeps_the_ends_of_the_range():
    target = make_target("llama")
    sizes = (1, 2, 3, 4, 8, 16)
    cut = measure_verify_cost(target, sizes=sizes, repeats=3, probes=1, max_seconds=0.0)
    assert cut.sizes == [1, 16] and cut.record["asked_sizes"] == list(sizes) and cut.record["repeats"] == 0
    assert all(len(s) == 1 for s in cut.record["samples"]) and cut.record["spread"] == [None, None]
    whole = measure_verify_cost(target, sizes=sizes, repeats=3, probes=1)
    assert whole.sizes == list(sizes) and whole.record["repeats"] == 3 and all(s > 0 for s in whole.seconds)
    assert all(len(s) == 3 for s in whole.record["samples"]) and all(w is not None for w in whole.record["spread"])
    assert set(whole.record["machine"]) == {"other_cores", "load_average_1min", "cores"}
    assert set(whole.record["probe"]) == {"size", "start", "end"} and whole.record["probe"]["size"] == 1
    with pytest.raises(ValueError, match="at least one tree size"):
        measure_verify_cost(target, sizes=(0,))


def test_coverage_order_and_the_curve_between_sizes():
    for n in range(1, 16):
        order = coverage_order(n)
        assert sorted(order) == list(range(n)) and order[:2] == [0, n - 1][:n]
    assert coverage_order(14)[:3] == [0, 13, 6]
    cost = VerifyCost(sizes=[1, 4, 16], seconds=[1.0, 1.3, 2.5])
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.1) and cost(10) == pytest.approx(1.9)
    assert cost(28) == pytest.approx(3.7)  # past the largest size: the last segment's slope (0.1 per token)
    assert np.allclose(cost(np.array([4, 16])), [1.3, 2.5])


def test_cpu_use_and_the_busy_rule(monkeypatch):
    with machine.CpuUse() as use:
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass
    if Path("/proc/stat").is_file():
        assert use.other_cores is not None and use.other_cores >= 0
    use.other_cores = 1.5
    assert "other processes used 1.5" in use.busy()
    use.other_cores = 0.1
    assert use.busy() is None
    use.other_cores, use.load_average = None, use.cores + 2.0  # no /proc/stat: the load average decides
    assert "load average" in use.busy()


def test_demo_alternates_the_methods_and_takes_medians():
    calls = []
    ids = torch.zeros(1, 3, dtype=torch.long)
    out = torch.zeros(1, 13, dtype=torch.long)

    def method(name):
        def run(max_time, progress):
            calls.append(name)
            return out
        return run

    runs = demo.interleaved_runs(method("plain"), method("dart"), repeats=3, prompt_length=3, show=False)
    assert calls == ["plain", "dart", "dart", "plain", "plain", "dart"]
    assert len(runs["plain"]) == len(runs["dart"]) == 3 and isinstance(runs["cpu"], machine.CpuUse)
    runs.update(plain=[1.0, 2.0, 4.0], dart=[0.5, 0.5, 4.0])
    result = demo.summary(runs, ids.shape[1])
    assert result["tokens"] == (10, 10) and result["plain_tps"] == 5.0 and result["dart_tps"] == 20.0
    assert result["speedup"] == 4.0 and (result["speedup_min"], result["speedup_max"]) == (1.0, 4.0)
    assert result["identical"]


def test_demo_runs_on_a_tiny_target_without_touching_the_threads(tmp_path, target_folder, capsys, monkeypatch):
    idle = machine.CpuUse()
    idle.other_cores = 0.0
    monkeypatch.setattr(machine, "other_cpu_use", lambda: idle)  # the machine looks idle before timing
    make_head(word_llama(), node_budget=3).save_pretrained(tmp_path / "head")
    threads = torch.get_num_threads()
    status = cli(["demo", "--target", str(target_folder), "--head", str(tmp_path / "head"), "--prompt", "w3 w14",
                  "--max-new-tokens", "6", "--repeats", "2"])
    out = capsys.readouterr().out
    assert status == 0 and torch.get_num_threads() == threads
    assert "median of 2 runs" in out and "the medians above" in out and f"on {threads} torch" in out
    assert "identical to plain generate: True" in out
    assert cli(["demo", "--target", str(target_folder), "--repeats", "0"]) == 2


def test_every_subcommand_help_shows_its_defaults_once():
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        text = " ".join(command.format_help().split())
        for action in command._actions:
            assert "(default" not in (action.help or ""), f"{name} {action.option_strings}: default in its help"
            if action.default is None or action.nargs == 0 or action.default == argparse.SUPPRESS:
                continue
            assert action.help, f"dart-hf {name} {action.option_strings}: no help, so --help hides its default"
            shown = f"(default: {action.default})"
            assert shown in text, f"dart-hf {name} --help does not show {shown}"
    assert "(default: 3)" in " ".join(sub.choices["demo"].format_help().split())
