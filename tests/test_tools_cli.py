"""`dart-hf demo`, `dart-hf calibrate` and the command line's help, on tiny targets. Nothing here asserts a timing:
the measurements are faked where a check depends on their values.

- calibrate: a measurement that fails its checks is repeated once, its rounds pooled with the first's, and stored
  marked noisy (with its problems, spread and raw medians; the stored curve made monotone) and used, except over a
  curve that passed its checks, which only `--accept-noisy` replaces (the command says so); the time limit leaves
  the finer sizes out, never the smallest and the largest, and the next measurement asks for every size again.
- demo: plain and DART alternate with the order flipped every pair; the summary takes medians, their quotient as the
  speed-up and the per-pair ratios' range; the whole command runs on a tiny target and head and leaves the caller's
  thread count as it was (busy machines, time limit: tests/test_new_user.py).
- every subcommand's --help shows its defaults, and no help text repeats one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch

from conftest import make_head, make_target, word_llama
from dart_hf.core.cost import VerifyCost, load_curve
from dart_hf.tools import calibrate as calibration
from dart_hf.tools import demo
from dart_hf_cli import build_parser
from dart_hf_cli import main as cli


pytestmark = pytest.mark.usefixtures("private_cache")


def fake_measurements(monkeypatch, seconds, probe=(0.010, 0.010)):
    """calibration.measure_verify_cost returning `seconds` (samples: each value and 1.5x it) and the probe's start
    and end time; returns the list of the calls' keyword arguments."""
    calls = []

    def fake(target, sizes, **kwargs):
        calls.append(kwargs)
        samples = [[s, 1.5 * s] for s in seconds]
        return VerifyCost(list(sizes), list(seconds), record={
            "past_len": 16, "measured_at": time.time(), "asked_sizes": list(sizes), "samples": samples,
            "spread": calibration.spread(samples), "probe": {"size": 1, "start": [probe[0]], "end": [probe[1]]}})

    monkeypatch.setattr(calibration, "measure_verify_cost", fake)
    return calls


def stored(folder_cache: Path) -> dict:
    [path] = (folder_cache / "cost").glob("*.json")
    return json.loads(path.read_text())


def test_a_noisy_curve_is_stored_with_its_spread_and_used_unless_a_clean_one_exists(tmp_path, target_folder,
                                                                                     monkeypatch, capsys):
    from dart_hf.tools.assets import load_target

    drifting = (0.010, 0.030)  # the load changed during the measurement
    calls = fake_measurements(monkeypatch, [0.050, 0.011, 0.013], drifting)  # and one size above a larger one
    assert cli(["calibrate", str(target_folder), "--sizes", "1,2,4"]) == 0
    err = capsys.readouterr().err
    assert "noisy" in err and "--force" in err and "load changed" in err
    assert len(calls) == 2  # measured again once, then kept
    record = stored(tmp_path / "cache")
    assert record["noisy"] is True and record["problems"] and record["attempts"] == 2
    medians = [1.25 * s for s in (0.050, 0.011, 0.013)]  # pooled: each size's median over both measurements
    assert record["medians"] == pytest.approx(medians)
    assert record["seconds"] == pytest.approx([medians[1], medians[1], medians[2]])  # monotone
    assert len(record["samples"][0]) == 4 and record["spread"][0] == pytest.approx(0.5 / 1.25)  # pooled
    target, _ = load_target(str(target_folder))
    assert load_curve(target).record["noisy"] is True  # the budget reads it like any curve

    fake_measurements(monkeypatch, [0.010, 0.011, 0.013])  # a clean measurement replaces a noisy curve
    assert cli(["calibrate", str(target_folder), "--force"]) == 0
    assert stored(tmp_path / "cache")["noisy"] is False and stored(tmp_path / "cache")["seconds"] == [0.010, 0.011,
                                                                                                      0.013]
    capsys.readouterr()
    fake_measurements(monkeypatch, [0.020, 0.022, 0.026], drifting)  # a noisy one does not replace a clean one...
    assert cli(["calibrate", str(target_folder), "--force"]) == 1
    err = capsys.readouterr().err
    assert "was kept" in err and f"dart-hf calibrate {target_folder} --accept-noisy" in err
    assert stored(tmp_path / "cache")["seconds"] == [0.010, 0.011, 0.013]
    assert cli(["calibrate", str(target_folder), "--accept-noisy"]) == 0  # ...unless asked to
    assert stored(tmp_path / "cache")["noisy"] is True and stored(tmp_path / "cache")["seconds"][0] == pytest.approx(
        1.25 * 0.020)


def test_the_library_call_keeps_its_contract_without_keep_noisy(monkeypatch):
    """`calibrate()` as the bench calls it: a curve that fails every check is not written."""
    target = make_target("llama")
    fake_measurements(monkeypatch, [0.010, 0.011], (0.010, 0.030))
    cost, problems = calibration.calibrate(target, sizes=(1, 2), verbose=False, attempts=2)
    assert cost is None and "load changed" in problems[0] and load_curve(target) is None


def test_the_time_limit_keeps_the_ends_of_the_range_and_the_next_run_asks_for_every_size():
    target = make_target("llama")
    sizes = (1, 2, 3, 4, 8, 16)
    cut = calibration.measure_verify_cost(target, sizes=sizes, repeats=3, probes=1, max_seconds=0.0)
    assert cut.sizes == [1, 16] and cut.record["asked_sizes"] == list(sizes) and cut.record["repeats"] == 0
    assert all(len(s) == 1 for s in cut.record["samples"]) and cut.record["spread"] == [None, None]
    whole = calibration.measure_verify_cost(target, sizes=sizes, repeats=3, probes=1)
    assert whole.sizes == list(sizes) and whole.record["repeats"] == 3
    assert all(len(s) == 3 for s in whole.record["samples"]) and all(w is not None for w in whole.record["spread"])
    assert set(whole.record["machine"]) == {"other_cores", "load_average_1min", "cores"}

    first, _ = calibration.calibrate(target, sizes=sizes, max_seconds=0.0, accept_noisy=True, verbose=False, force=True)
    assert first.sizes == [1, 16] and load_curve(target).sizes == [1, 16]
    again, _ = calibration.calibrate(target, force=True, accept_noisy=True, verbose=False)
    assert again.sizes == list(sizes)  # the sizes asked for, not the ones the limit left


def test_coverage_order_monotone_and_pooling():
    for n in range(1, 16):
        order = calibration.coverage_order(n)
        assert sorted(order) == list(range(n)) and order[:2] == [0, n - 1][:n]
    assert calibration.coverage_order(14)[:3] == [0, 13, 6]
    assert calibration.monotone([1.0, 3.0, 2.0, 5.0, 4.0]) == [1.0, 2.0, 2.0, 4.0, 4.0]
    a = VerifyCost([1, 8], [1.0, 2.0], record={"samples": [[1.0], [2.0]], "repeats": 1})
    b = VerifyCost([1, 2, 8], [3.0, 4.0, 6.0], record={"samples": [[3.0, 5.0], [4.0], [6.0]], "repeats": 2})
    both = calibration.pooled(a, b)
    assert both.sizes == [1, 2, 8] and both.seconds == [3.0, 4.0, 4.0] and both.record["repeats"] == 3
    assert calibration.pooled(VerifyCost([1], [1.0]), b) is b


def test_cpu_use_and_the_busy_rule(monkeypatch):
    with calibration.CpuUse() as use:
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
    busy = {"machine": {"other_cores": 1.0, "cores": 2}}
    assert "busy" in calibration.check_curve([1, 2], [0.010, 0.012], busy)[0]
    assert not calibration.check_curve([1, 2], [0.010, 0.012], {"machine": {"other_cores": 0.1, "cores": 2}})


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
    assert len(runs["plain"]) == len(runs["dart"]) == 3 and isinstance(runs["cpu"], calibration.CpuUse)
    runs.update(plain=[1.0, 2.0, 4.0], dart=[0.5, 0.5, 4.0])
    result = demo.summary(runs, ids.shape[1])
    assert result["tokens"] == (10, 10) and result["plain_tps"] == 5.0 and result["dart_tps"] == 20.0
    assert result["speedup"] == 4.0 and (result["speedup_min"], result["speedup_max"]) == (1.0, 4.0)
    assert result["identical"]


def test_demo_runs_on_a_tiny_target_without_touching_the_threads(tmp_path, target_folder, capsys, monkeypatch):
    idle = calibration.CpuUse()
    idle.other_cores = 0.0
    monkeypatch.setattr(calibration, "other_cpu_use", lambda: idle)  # the machine looks idle before timing
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
