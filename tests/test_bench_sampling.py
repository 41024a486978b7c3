"""`dart-hf bench` sampling rows (`--temperature`, `--top-p`, `--top-k`, `--min-p`, `--qwen3-sampling`) on a tiny
random target and head: every method gets the same settings and the same seed per prompt, sampled outputs are not
compared with plain's (so differing texts never give exit status 3), the reports state the settings, and a greedy run
stays as it was."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_head, make_target, prompts
from dart_hf.tools import bench
from dart_hf.tools.bench_methods import (QWEN3_SAMPLING, Method, call_seed, sampling_kwargs, sampling_settings,
                                         standard_methods)
from dart_hf.tools.bench_synthetic import run_synthetic
from dart_hf_cli import build_parser


pytestmark = pytest.mark.usefixtures("private_cache", "fresh_compiler_per_test")


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def settings_of(args) -> dict | None:
    return sampling_settings(args.temperature, args.top_p, args.top_k, args.min_p, args.qwen3_sampling)


def test_sampling_options_parse_and_qwen3_expands(capsys):
    greedy = parse()
    assert (greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p, greedy.qwen3_sampling) == \
        (None, None, None, None, False)
    assert settings_of(greedy) is None and sampling_kwargs(None) == {"do_sample": False}
    args = parse("--temperature", "0.7", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05")
    assert settings_of(args) == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05}
    # the shortcut: Qwen3's shipped generation config; what it leaves out is off, not the target's config
    qwen3 = settings_of(parse("--qwen3-sampling"))
    assert qwen3 == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None}
    assert QWEN3_SAMPLING == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert settings_of(parse("--qwen3-sampling", "--top-k", "50"))["top_k"] == 50  # a value given replaces it
    assert settings_of(parse("--temperature", "1.2")) == {"temperature": 1.2, "top_p": 1.0, "top_k": 0, "min_p": None}
    assert sampling_kwargs(qwen3) == {"do_sample": True, **qwen3}
    # a sampling setting without sampling, or out of range: a clear error before any model is loaded
    for argv, message in ((["--top-p", "0.9"], "--top-p only apply when sampling"),
                          (["--temperature", "0"], "--temperature must be > 0"),
                          (["--temperature", "1", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
                          (["--temperature", "1", "--top-k", "-1"], "--top-k must be >= 0")):
        assert bench.main(parse(*argv)) == 2
        assert message in capsys.readouterr().err


def differing(t, h, ids, **kw):
    """Plain generate with its last token changed: a mismatch in greedy runs (exit 3), not compared when sampling."""
    out = t.generate(ids, **kw).clone()
    out[0, -1] = (out[0, -1] + 1) % t.config.vocab_size
    return out


def test_sampled_bench_seeds_every_method_alike_states_settings_and_does_not_exit_3(bench_tiny, tmp_path):
    target, head = bench_tiny
    seen = []

    def recorded(name: str, run):
        def call(t, h, ids, **kw):
            seen.append((name, torch.initial_seed(), {k: kw.get(k) for k in ("do_sample", "temperature", "top_p",
                                                                             "top_k", "min_p")}))
            return run(t, h, ids, **kw)
        return call

    standard = {m.name: m for m in standard_methods(fixed_budget=[3])}
    methods = [Method(m.name, m.label, recorded(m.name, m.run), tree=m.tree)
               for m in (standard[n] for n in ("plain", "prompt_lookup", "dart_chain", "dart_tree_3"))]
    methods.append(Method("differing", "differs from plain", recorded("differing", differing)))
    settings = sampling_settings(qwen3=True)
    data = {"humaneval": prompts(2, seed=1)}
    results = bench.run_bench(target, head, data, max_new_tokens=8, methods=methods, out_dir=tmp_path,
                              progress=False, warmup=False, sampling=settings)
    assert results["all_equal"] is None and results["mismatches"] == [] and bench.exit_status(results) == 0
    # every call sampled with the run's settings, each method on a prompt from the same seed
    assert all(kw == {"do_sample": True, **settings} for _, _, kw in seen)
    names = [m.name for m in methods]
    for i in range(2):
        calls = seen[i * len(names):(i + 1) * len(names)]
        assert [name for name, _, _ in calls] == names
        assert {seed for _, seed, _ in calls} == {call_seed("humaneval", i)}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {k: saved["meta"]["sampling"][k] for k in settings} == settings and "seeds" in saved["meta"]["sampling"]
    assert saved["all_equal"] is None
    rows = saved["datasets"]["humaneval"]
    for name in names:
        assert rows[name]["equal_to_plain"] is None and rows[name]["tokens_per_s"] > 0
        assert [p["seed"] for p in rows[name]["per_prompt"]] == [call_seed("humaneval", i) for i in range(2)]
    # accepted length still counted by the target's forward hook
    assert rows["plain"]["accepted_length"] == 1.0 and rows["dart_tree_3"]["accepted_length"] >= 1.0
    assert rows["dart_tree_3"]["target_forwards"] == rows["dart_tree_3"]["steps"] + len(data["humaneval"])
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# dart-hf bench, sampling (temperature 0.6, top-p 0.95, top-k 20, min-p off)\n")
    assert "| differs from plain |" in md and "n/a (sampling)" in md and "MISMATCH" not in md


def test_sampled_batched_bench_and_greedy_unchanged(bench_tiny, tmp_path):
    target, head = bench_tiny
    standard = {m.name: m for m in standard_methods(fixed_budget=[3])}
    methods = [standard["plain"], standard["dart_tree_3"]]
    results = bench.run_bench(target, head, {"x": prompts(2, seed=2)}, max_new_tokens=6, methods=methods,
                              out_dir=tmp_path / "sampled", progress=False, warmup=False, batch_sizes=[2],
                              sampling=sampling_settings(0.8, min_p=0.1))
    assert results["all_equal"] is None and bench.exit_status(results) == 0
    assert results["meta"]["sampling"]["min_p"] == 0.1
    row = results["batches"]["x"]["2"]["dart_tree_3"]
    assert row["equal_to_plain"] is None and row["per_prompt"][0]["seed"] == call_seed("x", "b2", 0)
    assert row["per_prompt"][0]["rows_compared"] == 0
    assert "| 2 | DART tree, budget 3 |" in (tmp_path / "sampled" / "results.md").read_text()
    # greedy (no sampling): compared with plain as before, nothing about sampling in the reports
    greedy = bench.run_bench(target, head, {"x": prompts(1, seed=2)}, max_new_tokens=4, methods=methods,
                             out_dir=tmp_path / "greedy", progress=False, warmup=False)
    assert greedy["all_equal"] is True and "sampling" not in greedy["meta"]
    assert greedy["datasets"]["x"]["dart_tree_3"]["equal_to_plain"] is True
    assert "seed" not in greedy["datasets"]["x"]["plain"]["per_prompt"][0]
    md = (tmp_path / "greedy" / "results.md").read_text()
    assert md.startswith("# dart-hf bench\n") and "sampling" not in md


def test_cli_sampled_run_writes_settings_and_exits_0(bench_tiny, tmp_path, monkeypatch, capsys):
    """`dart-hf bench --qwen3-sampling` end to end through `bench.main`, the tiny target standing in for the real one
    (loading and prompts patched): exit status 0 and the settings in results.json."""
    import dart_hf.tools.datasets as datasets
    import dart_hf.tools.demo as demo

    target, head = bench_tiny
    monkeypatch.setattr(demo, "load_target_and_head", lambda *a, **k: (target, None, head))
    monkeypatch.setattr(datasets, "eval_prompts", lambda tokenizer, ds, n: prompts(n, seed=3))
    status = bench.main(parse("--qwen3-sampling", "--n", "1", "--datasets", "humaneval", "--max-new-tokens", "6",
                              "--methods", "plain", "dart_tree_3", "--budget", "3", "--no-warmup",
                              "--out", str(tmp_path)))
    assert status == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {k: saved["meta"]["sampling"][k] for k in ("temperature", "top_p", "top_k")} == QWEN3_SAMPLING
    assert list(saved["datasets"]["humaneval"]) == ["plain", "dart_tree_3"] and saved["all_equal"] is None
    assert "n/a (sampling)" in capsys.readouterr().out


def test_synthetic_compiled_rows_sample_on_a_tiny_shape(tmp_path):
    """`--synthetic --compiled --qwen3-sampling` (gpu_check.sh part 6) on CPU with a tiny shape: the compiled DART
    step and compiled plain timed while both sample, outputs not compared, settings in synthetic.json / .md."""
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=96, max_position_embeddings=512, tie_word_embeddings=False)
    settings = sampling_settings(qwen3=True)
    results = run_synthetic(shape, device="cpu", dtype=torch.float32, budgets=(3,), prompt_len=16, new_tokens=8,
                            cost_sizes=(1, 4), repeats=1, out_dir=tmp_path, progress=False, compiled=True,
                            compile_backend="eager", sampling=settings)
    c = results["compiled"]
    assert c["plain_step_ms"] > 0 and c["plain_equal_to_eager"] is None
    [row] = c["budgets"]
    assert row["compiled"] and row["step_ms"] > 0 and row["step_over_plain_compiled_step"] > 0
    assert row["output_equal_to_plain"] is None and results["budgets"][0]["output_equal_to_plain"] is None
    assert json.loads((tmp_path / "synthetic.json").read_text())["meta"]["sampling"] == settings
    md = (tmp_path / "synthetic.md").read_text()
    assert md.startswith("# dart-hf bench --synthetic, sampling (temperature 0.6, top-p 0.95, top-k 20, min-p off)")
    assert "n/a (sampling)" in md
