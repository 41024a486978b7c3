"""Tensor-parallel targets with real processes: `python -m torch.distributed.run --nproc-per-node 2` (gloo, CPU)
runs `tests/tp_worker.py` on tiny Llama- and Qwen3-shaped targets loaded tensor-parallel (`tp_plan="auto"`, and
`distributed_config=DistributedConfig(tp_plan="auto")`) and a head loaded from a folder on each rank.

Greedy: every rank's output equals single-process plain `generate` (tree and chain mode, one row and a left-padded
batch, a fixed and the cost-aware budget). Sampling: the same seed gives the same ids on every rank, in tree mode
the ids of budget 0 (DART's draws do not depend on the trees). Refused with the
same ValueError on every rank: ranks with different seeds when sampling, a head that differs across ranks. A rank
that fails ends every rank well before the timeout (the launcher ends the others, or their collective sees its
connection close).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import dart_hf
from conftest import make_head, make_target
from dart_hf.core.distributed import check_tensor_parallel_call, head_digest, is_tensor_parallel

WORKER = Path(__file__).resolve().parent / "tp_worker.py"
RANKS = 2
TIMEOUT = 240  # seconds for the whole launch; the passing run takes ~15 s on 2 cores
NEW = 12
PROMPTS = [[5, 17, 33, 9, 41, 12, 7], [60, 61, 3, 44, 28, 90, 13, 70, 21]]
BATCH = [[2, 2, 2, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18], [2, 2, 2, 2, 2, 20, 21, 22]]
MASK = [[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8, [0, 0, 0, 0, 0, 1, 1, 1]]
MODELS = ("llama", "qwen3")


def launch(spec: dict, tmp: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run the worker on RANKS CPU processes; the launcher's result. On timeout the whole process group
    (the launcher and its ranks) is killed and the test fails."""
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec))
    repo = str(Path(dart_hf.__file__).resolve().parent.parent)  # the dart_hf this test imported
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [repo, *filter(None, [os.environ.get("PYTHONPATH")])]), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}", str(WORKER),
           str(spec_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        pytest.fail(f"torch.distributed.run did not end within {timeout} s:\n{stdout[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout)


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """(rank outputs, single-process references): one launch for both targets."""
    tmp = tmp_path_factory.mktemp("tp")
    models, refs = [], {}
    for name in MODELS:
        target = make_target(name)
        target.save_pretrained(tmp / name)
        make_head(target, node_budget=8).save_pretrained(tmp / f"{name}_head")
        models.append({"name": name, "folder": str(tmp / name), "head": str(tmp / f"{name}_head"),
                       "distributed_config": name == "qwen3",  # both ways transformers loads a TP target
                       "bench": name == "llama"})
        loaded = AutoModelForCausalLM.from_pretrained(tmp / name).eval()  # what the ranks load, in one process
        rows = [loaded.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                do_sample=False, max_new_tokens=NEW).tolist() for p in PROMPTS]
        batch = loaded.generate(torch.tensor(BATCH), attention_mask=torch.tensor(MASK), do_sample=False,
                                max_new_tokens=NEW).tolist()
        refs[name] = {"rows": rows, "batch": batch}
    spec = {"models": models, "prompts": PROMPTS, "batch_ids": BATCH, "batch_mask": MASK, "max_new_tokens": NEW,
            "out": str(tmp)}
    result = launch(spec, tmp)
    assert result.returncode == 0, result.stdout[-6000:]
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(RANKS)]
    return ranks, refs


@pytest.mark.parametrize("name", MODELS)
def test_greedy_on_every_rank_equals_single_process_plain_generate(tp_run, name):
    ranks, refs = tp_run
    for out in ranks:
        res = out[name]
        assert res["tp_size"] == RANKS
        for mode in ("tree", "chain"):
            assert [r.get("ids", r.get("error")) for r in res[f"greedy_{mode}"]] == refs[name]["rows"], mode
        assert res["greedy_batch"].get("ids", res["greedy_batch"].get("error")) == refs[name]["batch"]
        # the cost-aware budget: each rank times its own steps, every rank verifies the first rank's tree size
        assert [r.get("ids", r.get("error")) for r in res["auto_tree"]] == refs[name]["rows"]
        assert res["auto_chain"].get("ids", res["auto_chain"].get("error")) == refs[name]["rows"][0]
        assert max(res["accepted"]) > 1.0  # the head drafts tokens the target accepts: DART did run


@pytest.mark.parametrize("name", MODELS)
def test_seeded_sampling_is_identical_on_every_rank(tp_run, name):
    ranks, refs = tp_run
    for key in ("sample_tree", "sample_chain", "sample_batch", "sample_tree_budget_0", "sample_batch_budget_0"):
        first = ranks[0][name][key]
        for row in first if isinstance(first, list) else [first]:
            assert "ids" in row, row
        assert all(out[name][key] == first for out in ranks[1:]), key
    for key in ("sample_tree", "sample_batch"):  # the tree's text is budget 0's, same seed
        assert ranks[0][name][key] == ranks[0][name][f"{key}_budget_0"], key
    # sampled, not greedy: some sampled row differs from the greedy one
    sampled = [r["ids"] for r in ranks[0][name]["sample_tree"]]
    assert sampled != refs[name]["rows"]


@pytest.mark.parametrize("name", MODELS)
def test_what_cannot_run_in_lockstep_is_refused_on_every_rank(tp_run, name):
    ranks, refs = tp_run
    expected = {
        "refused_seed": "the ranks differ in the random generator state",
        "refused_head": "the ranks differ in the head's weights",
    }
    for rank, out in enumerate(ranks):
        for key, text in expected.items():
            error = out[name][key].get("error", "")
            assert error.startswith("ValueError") and text in error, (rank, key, out[name][key])
            assert f"rank {rank} of {RANKS}" in error
        # the process group survived the refusals: the next call runs and is still exact
        assert out[name]["after_refusals"].get("ids") == refs[name]["rows"][0]


def test_the_bench_runs_in_lockstep_and_rank_0_alone_reports(tp_run):
    ranks, _ = tp_run
    for out in ranks:
        b = out["llama"]["bench"]
        assert b["all_equal"] and b["tensor_parallel"] == RANKS
        assert b["methods"] == ["plain", "prompt_lookup", "dart_chain", "dart_tree_3", "dart_tree_auto"]
    folder = Path(ranks[0]["out"])
    saved = json.loads((folder / "bench_rank0" / "results.json").read_text())
    assert saved["all_equal"] and saved["meta"]["tensor_parallel"] == RANKS
    assert "Tensor-parallel target over 2 ranks" in (folder / "bench_rank0" / "results.md").read_text()
    assert not (folder / "bench_rank1").exists()


def test_a_failing_rank_ends_every_rank_before_the_timeout(tmp_path):
    target = make_target("llama")
    target.save_pretrained(tmp_path / "llama")
    make_head(target, node_budget=8).save_pretrained(tmp_path / "head")
    spec = {"models": [{"name": "llama", "folder": str(tmp_path / "llama"), "head": str(tmp_path / "head")}],
            "prompts": PROMPTS, "batch_ids": BATCH, "batch_mask": MASK, "max_new_tokens": NEW, "out": str(tmp_path),
            "fail_rank": 1}  # rank 0 goes on into loading and generate: its first collective waits for rank 1
    result = launch(spec, tmp_path, timeout=120)  # a rank left waiting in a collective would hit this limit
    assert result.returncode != 0 and "rank 1 fails on purpose" in result.stdout
    # rank 0, in or on its way to its first collective with rank 1, ended at once: either the launcher ended it
    # (SIGTERM, -15) or, when rank 1's exit reached it first, gloo saw the peer's connection close (exit 1). Which
    # comes first is a race on a loaded machine; a collective's timeout (30 min) is never what ends it.
    report = result.stdout[result.stdout.index("Failures:"):]
    rank0 = re.search(r"rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: (-?\d+)", report)
    assert rank0 and rank0.group(1) in ("-15", "1"), report
    if rank0.group(1) == "1":
        assert "Connection closed by peer" in result.stdout, result.stdout[-4000:]
    assert "timed out" not in result.stdout.lower() and "timeout" not in result.stdout.lower()
    assert not (tmp_path / "rank0.json").exists()


def test_a_single_process_target_pays_nothing(llama, llama_head):
    """No process group: not tensor-parallel, and the check returns at once (no collective, any budget)."""
    assert not is_tensor_parallel(llama)
    check_tensor_parallel_call(llama_head, llama, mode="tree", batch_size=3, node_budget="auto", do_sample=True)


def test_the_head_digest_follows_its_weights_config_and_ngram():
    target = make_target("llama")
    a, b = make_head(target, seed=1), make_head(target, seed=1)
    assert head_digest(a) == head_digest(b)
    assert head_digest(a) != head_digest(make_head(target, seed=2))
    before = head_digest(a)
    with torch.no_grad():
        next(a.parameters()).view(-1)[-1] += 1e-3  # in place: the cache sees the tensor's new version
    assert head_digest(a) != before
    b.config.beam_width += 1
    assert head_digest(b) != before
