"""`dart-hf bench` end to end on a tiny random target and head (prompts injected, no real data loaded)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import make_head, make_target, prompts
from dart_hf.tools import bench
from dart_hf.tools.bench_methods import Method, standard_methods
from dart_hf.tools.bench_synthetic import run_synthetic
from dart_hf.tools.bench_timing import CompetingLoad, left_pad, new_token_counts
from dart_hf_cli import build_parser


pytestmark = pytest.mark.usefixtures("private_cache", "fresh_compiler_per_test")


def broken(t, h, ids, **kw):
    """Plain generate with its last token changed: must be flagged."""
    out = t.generate(ids, **kw).clone()
    out[0, -1] = (out[0, -1] + 1) % t.config.vocab_size
    return out


def test_bench_end_to_end_writes_reports(bench_tiny, tmp_path):
    target, head = bench_tiny
    data = {"humaneval": prompts(2, seed=1), "sharegpt": prompts(1, seed=2)}
    results = bench.run_bench(target, head, data, max_new_tokens=12, out_dir=tmp_path / "out", progress=False,
                              meta={"head": "tiny"})
    files = {p.name: p for p in (tmp_path / "out").iterdir()}
    assert set(files) == {"results.json", "results.md", "results.png"}
    assert files["results.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(files["results.json"].read_text())
    assert saved["all_equal"] is True and saved["mismatches"] == []
    assert saved["meta"]["prompts"] == {"humaneval": 2, "sharegpt": 1} and saved["meta"]["head"] == "tiny"
    names = ["plain", "prompt_lookup", "dart_chain", "dart_tree_60", "dart_tree_auto", "dart_tree_auto_no_lookup"]
    for ds in data:
        rows = saved["datasets"][ds]
        assert list(rows) == names
        assert rows["plain"]["accepted_length"] == 1.0 and rows["plain"]["speedup"] == 1.0
        for name in names:
            r = rows[name]
            assert r["equal_to_plain"] and r["tokens_per_s"] > 0 and r["new_tokens"] == 12 * len(data[ds])
            assert r["accepted_length"] >= 1.0 - 1e-9 and len(r["per_prompt"]) == len(data[ds])
        for name in ("dart_tree_60", "dart_tree_auto"):
            assert sum(rows[name]["phase_share"].values()) == pytest.approx(1.0)
            assert rows[name]["steps"] > 0 and rows[name]["node_budget_mean"] >= 0  # auto: 0 = plain decoding steps
        assert rows["dart_tree_60"]["node_budget_counts"] == {"60": rows["dart_tree_60"]["steps"]}
        assert all("speedup_vs_matched" not in rows[name] for name in names)  # stock generate is the reference
        # tree methods: one target forward per step plus the prefill
        tree = rows["dart_tree_60"]
        assert tree["target_forwards"] == tree["steps"] + len(data[ds])
    md = files["results.md"].read_text()
    assert "equals plain `generate` on every prompt" in md and "MISMATCH" not in md
    assert "| DART tree, cost-aware budget |" in md and "target verify" in md
    assert "CPU linears" not in md and "Tensor-parallel" not in md
    assert bench.exit_status(results) == 0


def test_bench_flags_a_broken_method(bench_tiny, tmp_path, capsys):
    target, head = bench_tiny
    standard = {m.name: m for m in standard_methods()}
    methods = [standard["plain"], Method("broken", "deliberately broken", broken), standard["dart_tree_60"]]
    results = bench.run_bench(target, head, {"humaneval": prompts(2, seed=3)}, max_new_tokens=8, methods=methods,
                              out_dir=tmp_path, progress=False, warmup=False)
    assert results["all_equal"] is False
    assert {(m["method"], m["prompt"]) for m in results["mismatches"]} == {("broken", 0), ("broken", 1)}
    assert all(m["first_difference"] == 7 and m["new_tokens"] == 8 for m in results["mismatches"])  # the last token
    rows = results["datasets"]["humaneval"]
    assert rows["broken"]["equal_to_plain"] is False and rows["dart_tree_60"]["equal_to_plain"] is True
    md = (tmp_path / "results.md").read_text()
    assert "OUTPUT MISMATCH" in md and "deliberately broken | " in md and "**NO (2 prompts)**" in md
    assert bench.exit_status(results) == bench.MISMATCH_EXIT
    assert "OUTPUT MISMATCH" in capsys.readouterr().err


def test_bench_runs_and_competing_load(bench_tiny, tmp_path, monkeypatch):
    """`runs` repeats the interleaved pass (each run's speedup reported); `load` runs busy loops beside the methods
    and ends them with the bench."""
    target, head = bench_tiny
    started = []
    real_enter = CompetingLoad.__enter__

    def enter(self):
        out = real_enter(self)
        started.extend(self.procs)
        return out

    monkeypatch.setattr(CompetingLoad, "__enter__", enter)
    standard = {m.name: m for m in standard_methods(fixed_budget=[2, 5])}
    methods = [standard[n] for n in ("plain", "dart_tree_2", "dart_tree_5")]
    results = bench.run_bench(target, head, {"x": prompts(1, seed=4)}, max_new_tokens=4, methods=methods,
                              out_dir=tmp_path, progress=False, warmup=False, runs=2, load=1)
    row = results["datasets"]["x"]["dart_tree_5"]
    assert len(row["speedup_runs"]) == 2 and row["speedup_spread"][0] <= row["speedup_median"]
    assert results["meta"]["runs"] == 2 and results["meta"]["competing_load"] == 1 and results["all_equal"]
    assert len(started) == 1 and all(p.poll() is not None for p in started)  # the load ended with the bench
    md = (tmp_path / "results.md").read_text()
    assert "2 interleaved runs" in md and "competing load of 1 busy-loop" in md
    args = parse("--runs", "3", "--load", "--budget", "3", "60")
    assert args.runs == 3 and args.load >= 1 and args.budget == [3, 60]
    assert parse().load is None and parse("--load", "4").load == 4


def test_bench_needs_plain_first(bench_tiny):
    target, head = bench_tiny
    with pytest.raises(ValueError, match="plain"):
        bench.run_bench(target, head, {"x": prompts(1)}, methods=standard_methods()[1:], warmup=False)


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_cli_options_and_clear_errors(tmp_path, capsys):
    args = parse("--n", "2", "--datasets", "humaneval", "--dtype", "bfloat16", "--out", str(tmp_path))
    assert args.runner == "dart_hf.tools.bench:main" and args.n == 2
    assert args.datasets == ["humaneval"] and args.max_new_tokens == 128
    assert args.head is None and args.target == "smollm2-135m-instruct"
    # a head folder that does not exist: a clear message before any model is loaded
    assert bench.main(parse("--head", str(tmp_path / "nowhere"))) == 2
    assert "error" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(parse("--synthetic")) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_synthetic_path_runs_on_a_tiny_shape(tmp_path):
    """The GPU-only synthetic bench, exercised on CPU with a tiny shape so it is known to work before the H200 run."""
    shape = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=96, max_position_embeddings=512, tie_word_embeddings=False)
    results = run_synthetic(shape, device="cpu", dtype=torch.float32, budgets=(3, 7), prompt_len=32,
                            new_tokens=8, cost_sizes=(1, 4, 8), repeats=1, out_dir=tmp_path, progress=False,
                            draft_vocab_size=32000)  # clipped to the tiny vocab
    assert list(results["verify_cost_ms"]) == ["1", "4", "8"]
    assert [r["node_budget"] for r in results["budgets"]] == [3, 7]
    for r in results["budgets"]:
        assert r["step_ms_wall"] > 0 and 0 < r["overhead_share"] < 1 and r["break_even_accepted_length"] > 0
    assert (tmp_path / "synthetic.json").is_file()
    assert "Verify cost by tree size" in (tmp_path / "synthetic.md").read_text()


def test_batched_bench_compares_every_row_and_reports_per_batch_size(bench_tiny, tmp_path):
    """`batch_sizes`: plain batched generate and the batch-capable methods on left-padded batches, per batch size;
    every row compared with plain's; one-row-only methods kept at batch size 1 and noted."""
    target, head = bench_tiny
    standard = {m.name: m for m in standard_methods(fixed_budget=[3])}
    methods = [standard[n] for n in ("plain", "prompt_lookup", "dart_tree_3", "dart_tree_auto")]
    data = {"humaneval": prompts(3, seed=6), "sharegpt": prompts(4, seed=7)}
    results = bench.run_bench(target, head, data, max_new_tokens=6, methods=methods, out_dir=tmp_path,
                              progress=False, batch_sizes=[1, 2, 4])
    assert results["all_equal"] and results["batch_sizes"] == [1, 2, 4] and "datasets" not in results
    assert results["meta"]["skipped_for_batches"] == {"prompt_lookup": standard["prompt_lookup"].one_row_only}
    for ds, ps in data.items():
        sizes = results["batches"][ds]
        assert list(sizes) == ["1", "2", "4"]
        assert list(sizes["1"]) == ["plain", "prompt_lookup", "dart_tree_3", "dart_tree_auto"]
        for b in ("2", "4"):
            assert list(sizes[b]) == ["plain", "dart_tree_3", "dart_tree_auto"]
        for b, rows in sizes.items():
            batches = -(-len(ps) // int(b))
            plain = rows["plain"]
            assert plain["speedup"] == 1.0 and 0 < plain["new_tokens"] <= 6 * len(ps)
            for name, r in rows.items():
                assert r["equal_to_plain"] and r["new_tokens"] == plain["new_tokens"] and r["tokens_per_s"] > 0
                assert len(r["per_prompt"]) == batches
                assert [e["batch_size"] for e in r["per_prompt"]] == [len(ps[i:i + int(b)]) for i in
                                                                       range(0, len(ps), int(b))]
                if name != "plain":  # every row of every batch was compared with plain's
                    assert sum(e["rows_compared"] for e in r["per_prompt"]) == len(ps)
            assert rows["dart_tree_3"]["node_budget_counts"] == {3: rows["dart_tree_3"]["steps"]}
            assert 0 <= rows["dart_tree_auto"]["node_budget_mean"] <= max(bench_policy_candidates(head, target))
    md = (tmp_path / "results.md").read_text()
    assert "| 4 | DART tree, budget 3 |" in md and "runs at batch size 1 only" in md and "MISMATCH" not in md
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench.exit_status(results) == 0


def bench_policy_candidates(head, target):
    from dart_hf.core.budget import budget_policy

    return budget_policy(head, target).candidates


def test_batched_bench_flags_a_broken_row(bench_tiny, tmp_path):
    target, head = bench_tiny

    def broken_row(t, h, ids, **kw):
        out = t.generate(ids, **kw).clone()
        out[1, -1] = (out[1, -1] + 1) % t.config.vocab_size
        return out

    methods = [standard_methods()[0], Method("broken", "breaks row 1", broken_row)]
    results = bench.run_bench(target, head, {"x": prompts(2, seed=8)}, max_new_tokens=5, methods=methods,
                              out_dir=tmp_path, progress=False, warmup=False, batch_sizes=[2])
    assert not results["all_equal"] and bench.exit_status(results) == bench.MISMATCH_EXIT
    [m] = results["mismatches"]
    assert (m["method"], m["batch_size"], m["row"], m["prompt"], m["first_difference"]) == ("broken", 2, 1, 1, 4)
    assert "batch size 2 batch 0 row 1" in (tmp_path / "results.md").read_text()


def test_left_pad_and_new_token_counts():
    ids, mask = left_pad([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], pad_id=2)
    assert ids.tolist() == [[5, 6, 7], [2, 2, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    out = torch.tensor([[5, 6, 7, 9, 1, 2], [2, 2, 8, 9, 9, 9]])
    assert new_token_counts(out, 3, [1]) == [2, 3]  # up to and including the first EOS
    assert new_token_counts(out, 3, []) == [3, 3]
    assert parse("--batch-size", "1", "4", "8").batch_size == [1, 4, 8] and parse().batch_size == [1]


# ------------------------------------------------------------------------------------------ compiled rows, --profile
# compile backend "eager": dynamo captures the graphs (fullgraph, the same guards and recompiles as inductor) without
# generating code, seconds instead of minutes
def compiled_methods(budget: int = 3, *more: str) -> list:
    standard = {m.name: m for m in standard_methods(fixed_budget=[budget], compiled=True,
                                                    compile_backend="eager")}
    return [standard[n] for n in ("plain", f"dart_tree_{budget}", "plain_compiled", f"dart_compiled_{budget}", *more)]


def test_compiled_rows_equal_plain_and_report_their_ratio_over_compiled_plain(bench_tiny, tmp_path):
    target, head = bench_tiny
    methods = compiled_methods(3, "dart_compiled_auto")
    assert all(m.one_row_only is None for m in methods[2:])  # they decode batches too
    data = {"x": prompts(2, seed=9)}
    results = bench.run_bench(target, head, data, max_new_tokens=10, methods=methods, out_dir=tmp_path,
                              progress=False, warmup=False, runs=2)
    assert results["all_equal"] and bench.exit_status(results) == 0
    rows = results["datasets"]["x"]
    dart = rows["dart_compiled_3"]
    assert dart["baseline"] == "plain_compiled" and dart["speedup_vs_baseline"] > 0
    assert len(dart["speedup_vs_baseline_runs"]) == 2 and dart["speedup_vs_baseline_spread"][0] > 0
    assert "baseline" not in rows["plain_compiled"] and rows["plain_compiled"]["accepted_length"] == 1.0
    # the captured greedy step is one phase; every call ran compiled; one target forward per step plus the prefill
    assert dart["phase_ms"]["step"] > 0 and "not_compiled" not in dart
    assert dart["target_forwards"] == dart["steps"] + 2 * len(data["x"])
    assert "step" not in rows["dart_tree_3"]["phase_ms"]
    warm = results["compile_warmup"]
    assert list(warm) == ["plain_compiled", "dart_compiled_3", "dart_compiled_auto"]
    auto = rows["dart_compiled_auto"]  # per call, a tree its policy timed in the warm-up, or plain decoding
    held = {int(k.split("x")[1]) for k in warm["dart_compiled_auto"]["held_step_ms"]}
    assert auto["baseline"] == "plain_compiled" and set(auto["node_budget_counts"]) <= held and 0 in held, auto
    assert all(w["seconds"] >= w["first_call_seconds"] > 0 for w in warm.values())
    assert warm["plain_compiled"]["calls"] == warm["dart_compiled_3"]["calls"] == 2  # the cost-aware one: more
    md = (tmp_path / "results.md").read_text()
    assert "| vs generate, static cache + compile |" in md and "| DART, static cache + compile, budget 3 |" in md
    assert "| captured step |" in md and "Those warm-up seconds are not in any tokens/s" in md
    assert "step ms per held size (rows x nodes; 0: plain decoding) after the warm-up, which its calls choose by: 1x0 " in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["datasets"]["x"]["dart_compiled_3"]["speedup_vs_baseline_runs"] == dart["speedup_vs_baseline_runs"]


def test_the_compile_warm_up_of_the_cost_aware_method_runs_every_call_at_every_size_its_policy_may_hold(bench_tiny):
    """A cost-aware compiled call runs the size its policy holds (after trying its neighbours) or plain decoding, so
    a timed call may run a size its own warm-up call did not: the warm-up repeats the calls until the policy has
    tried every size it will try, then runs every call at every tree size the policy timed."""
    from dart_hf.core.batch_budget import held_settled
    from dart_hf.core.budget import budget_policy
    from dart_hf.tools.bench_timing import _compile_warmup

    target, head = bench_tiny
    auto = compiled_methods(3, "dart_compiled_auto")[-1]
    fixed = []
    spy = dataclasses.replace(auto, at_budget=lambda b: fixed.append(b) or auto.at_budget(b))
    calls = [(ids, torch.ones_like(ids)) for ids in prompts(3, seed=4)]
    gen = dict(do_sample=False, max_new_tokens=8, eos_token_id=None)  # every call long enough to be timed
    head.budget_state = None
    warm = _compile_warmup(target, head, calls, [spy], gen, progress=False)["dart_compiled_auto"]
    policy = budget_policy(head, target)
    sizes = policy.held_times.trees(1)
    assert held_settled(policy, 1) and len(sizes) >= 3 and policy.held_times.median(1, 0) is not None, sizes
    assert fixed == sizes * len(calls), (fixed, sizes)  # every call (3) at every timed size
    assert warm["calls"] > len(calls) + len(fixed)  # the auto calls passed more than once before settling


def test_compiled_flags_and_method_selection():
    args = parse("--compiled", "--profile", "--compile-backend", "eager", "--budget", "4")
    assert args.compiled and args.profile and args.compile_backend == "eager" and args.budget == [4]
    defaults = parse()
    assert not defaults.compiled and not defaults.profile and defaults.budget is None
    assert defaults.compile_backend == "inductor"
    assert "plain_compiled" not in {m.name for m in standard_methods()}  # off by default
    chosen = bench.selected_methods(standard_methods([4], compiled=True), ["dart_compiled_4"])
    assert [m.name for m in chosen] == ["plain", "plain_compiled", "dart_compiled_4"]  # plain and the baseline stay


def test_profile_counts_aten_ops_and_host_syncs_per_step(bench_tiny, tmp_path):
    target, head = bench_tiny
    results = bench.run_bench(target, head, {"x": prompts(1, seed=10)}, max_new_tokens=12, methods=compiled_methods(),
                              out_dir=tmp_path, progress=False, warmup=False, profile=True)
    profile = results["profile"]["datasets"]["x"]
    assert list(profile) == ["plain", "dart_tree_3", "plain_compiled", "dart_compiled_3"]
    for r in profile.values():
        assert isinstance(r["aten_ops"], int) and isinstance(r["host_syncs"], int) and r["steps"] > 0
        assert r["aten_ops"] > 0 and r["host_syncs"] > 0 and r["new_tokens"] == 12
        assert r["aten_ops_per_step"] == pytest.approx(r["aten_ops"] / r["steps"])
        assert r["host_syncs_per_token"] == pytest.approx(r["host_syncs"] / 12)
    assert profile["plain"]["steps"] == profile["plain_compiled"]["steps"] == 12  # plain: a step per new token
    static = profile["dart_compiled_3"]
    assert static["steps"] == results["datasets"]["x"]["dart_compiled_3"]["steps"]
    # The static greedy step reads the device once per step (`static_step._host_result`: one tolist of length +
    # tokens). The loop's bookkeeping then reads two host tensors per step (`loop._append`: the stop positions and the
    # lengths, tolist; on a GPU they are CPU tensors already, no sync, but on this CPU every read counts), and a
    # few reads fall outside the steps (prefill, first token, the end): 3 per step plus at most 10.
    assert static["host_reads"]["tolist"] <= 3 * static["steps"] + 10
    assert static["host_syncs"] <= 3 * static["steps"] + 10
    eager = profile["dart_tree_3"]  # the eager step reads the accepted lengths once too (`EagerStep.step`)
    assert eager["host_syncs"] <= 3 * eager["steps"] + 10
    md = (tmp_path / "results.md").read_text()
    assert "## Profile: aten ops and host syncs per step" in md and "| x | DART, static cache + compile, budget 3 |" in md
    assert json.loads((tmp_path / "results.json").read_text())["profile"]["datasets"]["x"]["plain"]["steps"] == 12


def test_synthetic_compiled_rows_on_a_tiny_shape(tmp_path):
    """The synthetic bench's compiled rows (gpu_check.sh part 4), on CPU with a tiny shape."""
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=96, max_position_embeddings=512, tie_word_embeddings=False)
    results = run_synthetic(shape, device="cpu", dtype=torch.float32, budgets=(3,), prompt_len=16,
                            new_tokens=8, cost_sizes=(1, 4), repeats=1, out_dir=tmp_path, progress=False,
                            compiled=True, compile_backend="eager")
    c = results["compiled"]
    assert c["backend"] == "eager" and c["plain_step_ms"] > 0 and c["plain_equal_to_eager"]
    assert [r["node_budget"] for r in c["budgets"]] == [3]
    for r in c["budgets"]:
        assert r["compiled"] and r["static_reason"] is None and r["output_equal_to_plain"]
        assert r["step_ms"] > 0 and r["step_over_plain_compiled_step"] > 0 and 0 < r["head_and_tree_share"] < 1
        assert set(r["phase_ms"]) == {"draft", "verify", "accept"}
    md = (tmp_path / "synthetic.md").read_text()
    assert "## Static cache + torch.compile (eager)" in md and "3-node DART compiled step / plain compiled step" in md


def test_compiled_rows_decode_batches_and_report_their_ratio_over_compiled_plain(bench_tiny, tmp_path):
    """`--compiled --batch-size`: the static-cache methods run on left-padded batches (each batch compiled first,
    untimed), every row equal to plain batched generate, DART reported over compiled plain at the same batch size."""
    target, head = bench_tiny
    results = bench.run_bench(target, head, {"x": prompts(4, seed=9)}, max_new_tokens=10, methods=compiled_methods(),
                              out_dir=tmp_path, progress=False, warmup=False, runs=1, batch_sizes=[1, 2])
    assert results["all_equal"] and not results["meta"]["skipped_for_batches"]
    rows = results["batches"]["x"]["2"]
    assert set(rows) == {"plain", "dart_tree_3", "plain_compiled", "dart_compiled_3"}
    assert rows["dart_compiled_3"]["baseline"] == "plain_compiled" and rows["dart_compiled_3"]["speedup_vs_baseline"] > 0
    assert results["compile_warmup"]["dart_compiled_3"]["calls"] == 6  # 4 single rows + 2 batches of 2
    assert "vs compiled plain" in (tmp_path / "results.md").read_text()
