"""`dart-hf bench` end to end on a tiny random target and head (prompts injected, no real data loaded)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import make_head, make_target, prompts
from dart_hf.core.budget import LADDER
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
    auto = rows["dart_compiled_auto"]  # every call at the size its shape took in the warm-up (0: plain decoding)
    assert auto["baseline"] == "plain_compiled" and set(auto["node_budget_counts"]) <= {0, *LADDER}, auto
    assert all(w["seconds"] >= w["first_call_seconds"] > 0 for w in warm.values())
    assert all(w["calls"] == 2 for w in warm.values())  # one warm-up call per prompt, the cost-aware one included
    md = (tmp_path / "results.md").read_text()
    assert "| vs generate, static cache + compile |" in md and "| DART, static cache + compile, budget 3 |" in md
    assert "| captured step |" in md and "Those warm-up seconds are not in any tokens/s" in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["datasets"]["x"]["dart_compiled_3"]["speedup_vs_baseline_runs"] == dart["speedup_vs_baseline_runs"]


def test_the_cost_aware_compiled_method_compiles_only_in_its_warm_up(bench_tiny, monkeypatch):
    """A cost-aware compiled call holds its shape's size from the shape's first call (`BudgetPolicy.call_budget`)
    and steps among it and its ladder neighbours, all compiled in the warm-up: the timed passes compile no graph,
    even where the policy's choice moved after the warm-up (here: steered to 2 nodes by scripted eager steps), and
    every timed call runs sizes of the warm-up's ladder."""
    from dart_hf.core.budget import START, budget_policy, ladder_around
    from dart_hf.tools import bench_timing

    target, head = bench_tiny
    head.budget_state = None  # a fresh policy
    standard = {m.name: m for m in standard_methods(fixed_budget=[3], compiled=True, compile_backend="eager")}
    auto, sizes = standard["dart_compiled_auto"], {}

    def run(t, h, ids, **kw):  # records each call's sizes, per prompt, in call order
        out = auto.run(t, h, ids, **kw)
        sizes.setdefault(tuple(ids[0].tolist()), []).append(sorted(set(h.stats.node_budgets)))
        return out

    graphs, passes, one_pass = torch._dynamo.utils.counters["stats"], [], bench_timing._one_pass

    def timed_pass(*args, **kwargs):
        if not passes:  # after the warm-up: the one-row choice moves to 2 nodes (plain and 5 nodes dear, 2 cheap)
            policy = budget_policy(head, target)
            for _ in range(4):
                policy.observe(1, 0, [()], 0.05)
                policy.observe(1, 2, [[0, 1]], 0.01)
                policy.observe(1, 5, [[0, 1]], 0.05)
            policy.next_budget(1)
            passes.append(policy.choice)
        before = graphs["unique_graphs"]
        out = one_pass(*args, **kwargs)
        passes.append(graphs["unique_graphs"] - before)
        return out

    monkeypatch.setattr(bench_timing, "_one_pass", timed_pass)
    methods = [standard["plain"], standard["plain_compiled"], dataclasses.replace(auto, run=run)]
    gen_prompts = prompts(3, seed=4)
    results = bench.run_bench(target, head, {"x": gen_prompts}, max_new_tokens=8, methods=methods, progress=False,
                              warmup=False, runs=2)
    assert results["all_equal"] and graphs["unique_graphs"] > 0  # the warm-up compiled
    assert passes == [2, 0, 0], passes  # the choice moved to 2; neither timed pass compiled a graph
    assert len(sizes) == len(gen_prompts)
    ladder = set(ladder_around(START))
    assert 2 not in ladder
    for calls in sizes.values():  # a warm-up call, then one per timed pass, all on the warm-up call's ladder
        assert len(calls) == 3 and all(set(c) <= ladder for c in calls), sizes


def test_hindsight_compares_the_default_with_the_best_fixed_choice():
    """`bench.hindsight` on synthetic results (no timing): per data set and batch size, eager and compiled apart,
    the default's speed-up over plain (the median over runs where there is one) against the best of plain decoding
    (1.0) and every fixed tree size, and their ratio; `hindsight_lines` prints it. `--hindsight` is a bench flag."""
    from dart_hf.tools.bench_report import hindsight_lines

    rows = {"plain": {"speedup": 1.0}, "dart_tree_auto": {"speedup": 1.3, "speedup_median": 1.2},
            "dart_tree_auto_no_lookup": {"speedup": 9.0}, "dart_tree_3": {"speedup": 1.5},
            "dart_tree_8": {"speedup": 1.1}, "dart_tree_60": {"speedup": 0.7}, "prompt_lookup": {"speedup": 9.0},
            "plain_compiled": {"speedup": 2.0}, "dart_compiled_auto": {"speedup": 3.0, "speedup_vs_baseline": 0.8},
            "dart_compiled_2": {"speedup": 1.5, "speedup_vs_baseline": 0.75}}
    [eager, compiled] = bench.hindsight({"datasets": {"x": rows}})
    assert eager == {"dataset": "x", "rows": 1, "compiled": False, "default": 1.2, "fixed": {3: 1.5, 8: 1.1, 60: 0.7},
                     "best_budget": 3, "best": 1.5, "default_over_best": pytest.approx(0.8)}
    assert compiled["compiled"] and compiled["fixed"] == {2: 0.75} and compiled["default"] == 0.8
    assert (compiled["best_budget"], compiled["best"]) == (0, 1.0)  # compiled plain beats every compiled tree
    assert compiled["default_over_best"] == pytest.approx(0.8)

    slow = {"plain": {"speedup": 1.0}, "dart_tree_auto": {"speedup": 0.95}, "dart_tree_1": {"speedup": 0.9}}
    batched = bench.hindsight({"datasets": {}, "batches": {"x": {"1": rows, "8": slow}, "y": {"8": {"plain": {}}}}})
    assert [(r["dataset"], r["rows"], r["compiled"]) for r in batched] == [("x", 1, False), ("x", 1, True),
                                                                           ("x", 8, False)]
    assert batched[0] == eager and (batched[2]["best_budget"], batched[2]["best"]) == (0, 1.0)
    assert batched[2]["default_over_best"] == pytest.approx(0.95)
    assert bench.hindsight({"datasets": {"x": {"plain": {"speedup": 1.0}, "dart_tree_3": {"speedup": 2.0}}}}) == []

    lines = hindsight_lines({"hindsight": batched})
    assert lines[0] == "## The default against the best fixed choice in hindsight"
    table = [line for line in lines if line.startswith("| x |")]
    assert len(table) == 3 and "fixed 3: 1.50x" in table[0] and "**0.80**" in table[0]
    assert "plain: 1.00x" in table[2] and "**0.95**" in table[2]
    assert hindsight_lines({"hindsight": []}) == []
    assert parse("--hindsight").hindsight and not parse().hindsight


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
    # The static greedy step reads the device once per step (`DartStep._host_result`: one tolist of length +
    # tokens). The loop's bookkeeping then reads two host tensors per step (`loop._append`: the stop positions and the
    # lengths, tolist; on a GPU they are CPU tensors already, no sync, but on this CPU every read counts), and a
    # few reads fall outside the steps (prefill, first token, the end, the call's input checks: the ids' range):
    # 3 per step plus at most 14.
    assert static["host_reads"]["tolist"] <= 3 * static["steps"] + 14
    assert static["host_syncs"] <= 3 * static["steps"] + 14
    eager = profile["dart_tree_3"]  # the eager step reads the accepted lengths once too (`DartStep.step`)
    assert eager["host_syncs"] <= 3 * eager["steps"] + 14
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
