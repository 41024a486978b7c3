"""Head folders as they are shared: the push file list, the push itself (offline, with a fake Hub client), whole-folder
round trips, the model cards, loading safety, and `custom_generate/` running DART without dart_hf installed."""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

import dart_hf
from conftest import make_head, make_target, prompts
from dart_hf.tools import hub
from dart_hf.tools.convert import QWEN3_TARGETS

REPO_ROOT = Path(__file__).resolve().parents[1]
CARDS = REPO_ROOT / "model_cards"
CUSTOM_FILES = sorted(hub.custom_generate_sources("<repo>"))


@pytest.fixture(scope="module")
def qwen3():
    return make_target("qwen3")


@pytest.fixture(scope="module")
def head(qwen3):
    h = make_head(qwen3, draft_vocab_size=48, node_budget=16, beam_width=8)
    h.set_draft_vocab(torch.arange(0, 96, 2))
    h.ngram = dart_hf.NGramModel.build([p[0].tolist() for p in prompts(6)], order=3, vocab_size=96, progress=False)
    return h


def write_folder(head, folder: Path, card: bool = True, custom: bool = True) -> Path:
    head.save_pretrained(folder)
    if card:
        (folder / "README.md").write_text("---\nlibrary_name: dart_hf\n---\n# a head\n")
    if custom:
        hub.write_custom_generate(folder)
    return folder


# ---------------------------------------------------------------------------------------------------- file list
def test_push_file_list(tmp_path, head):
    full = write_folder(head, tmp_path / "full")
    expected = ["config.json", "model.safetensors", "ngram.safetensors", "README.md", *CUSTOM_FILES]
    assert hub.push_file_list(full) == expected
    assert "custom_generate/generate.py" in CUSTOM_FILES and "custom_generate/modeling_dart.py" in CUSTOM_FILES
    bare = tmp_path / "bare"
    make_head(make_target("qwen3")).save_pretrained(bare)
    # custom_generate/ is regenerated on push, so it is listed even where the folder has none yet
    assert hub.push_file_list(bare) == ["config.json", "model.safetensors", *CUSTOM_FILES]
    (bare / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        hub.push_file_list(bare)
    with pytest.raises(ValueError, match="no config.json"):
        hub.push_file_list(tmp_path / "missing")


def test_custom_generate_copy_is_generated_and_self_contained(tmp_path, head):
    folder = write_folder(head, tmp_path / "h")
    (folder / "custom_generate" / "stale_module.py").write_text("x = 1\n")
    written = hub.write_custom_generate(folder)
    assert sorted(f"custom_generate/{p.name}" for p in (folder / "custom_generate").iterdir()) == written
    files = {rel: (folder / rel).read_text() for rel in written}
    for rel, text in files.items():
        imported = [
            name for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
            if not getattr(node, "level", 0)
        ]
        assert not any(name.split(".")[0] == "dart_hf" for name in imported), rel
        assert text.startswith("# Generated from dart_hf/"), rel
        name = Path(rel).stem
        if name != "generate":  # every other file is the package module, verbatim below the header
            original = (REPO_ROOT / "dart_hf" / f"{name}.py").read_text()
            body = text.split("\n", 1)[1]
            assert body == original or "is not part of this custom_generate copy" in body, rel
    assert f"HEAD_LOCATION: str | None = {str(folder.resolve())!r}" in files["custom_generate/generate.py"]
    assert "from .cost_model" not in files["custom_generate/modeling_dart.py"]


# ---------------------------------------------------------------------------------------------------- round trip
def test_whole_folder_round_trip(tmp_path, head):
    folder = write_folder(head, tmp_path / "h")
    loaded = dart_hf.DartHead.from_pretrained(folder)
    assert {**loaded.config.to_dict(), "_name_or_path": ""} == {**head.config.to_dict(), "_name_or_path": ""}
    want = head.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert loaded.ngram is not None
    assert all(torch.equal(loaded.ngram.tables[k], t) for k, t in head.ngram.tables.items())
    # and again, through save_pretrained of the loaded head into a folder that keeps its card
    again = tmp_path / "again"
    shutil.copytree(folder, again)
    loaded.save_pretrained(again)
    assert (again / "README.md").read_text() == (folder / "README.md").read_text()
    assert load_file(again / "model.safetensors").keys() == load_file(folder / "model.safetensors").keys()
    assert dart_hf.DartHead.from_pretrained(again).ngram.order == 3


# ---------------------------------------------------------------------------------------------------- model cards
CARD_DIRS = sorted(CARDS.glob("qwen3-*-dart"))


def test_every_reference_target_has_a_card():
    assert [d.name for d in CARD_DIRS] == sorted(f"{t.name.split('/')[1].lower()}-dart" for t in QWEN3_TARGETS.values())


@pytest.mark.parametrize("folder", CARD_DIRS, ids=lambda d: d.name)
def test_model_card_config_and_front_matter(folder):
    target = QWEN3_TARGETS[f"Qwen/Qwen3-{folder.name.split('-')[1].upper()}"]
    cfg = dart_hf.DartConfig.from_pretrained(folder)
    n = target.num_hidden_layers
    assert cfg.model_type == "dart" and cfg.final_norm_repeats == 2
    assert (cfg.target_hidden_size, cfg.target_num_layers, cfg.target_model_type) == (target.hidden_size, n, "qwen3")
    assert cfg.aux_layer_ids == [2, n // 2, n - 3]
    assert (cfg.hidden_size, cfg.intermediate_size) == (target.hidden_size, target.intermediate_size)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (target.num_attention_heads, 8, 128)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (151936, 40960)
    assert cfg.rope_parameters["rope_theta"] == 1_000_000.0
    assert not (folder / "model.safetensors").exists()
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "dart_hf" and card.data.base_model == target.name
    assert {"speculative-decoding", "dart"} <= set(card.data.tags)
    text = card.text
    assert f"dart-hf convert reference/{target.reference_repo.split('/')[1]}" in text
    assert f"hf download {target.reference_repo}" in text and "carries no weights" in text
    assert "import dart_hf" in text and "assistant_model=head" in text and "AutoModel.from_pretrained" in text


# ---------------------------------------------------------------------------------------------------- push
class FakeHfApi:
    """Records what push_head would send; never touches the network."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, **kw):
        FakeHfApi.calls.append(("create_repo", repo_id, kw))

    def create_commit(self, repo_id, operations, **kw):
        FakeHfApi.calls.append(("create_commit", repo_id, operations, kw))
        return argparse.Namespace(commit_url=f"https://hf.co/{repo_id}/commit/0")


@pytest.fixture
def fake_hub(monkeypatch):
    FakeHfApi.calls = []
    monkeypatch.setattr(hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_push_head_uploads_the_file_list(tmp_path, head, fake_hub):
    folder = write_folder(head, tmp_path / "h")
    url = hub.push_head(folder, "someone/tiny-dart", private=True, token="tok")
    assert url == "https://hf.co/someone/tiny-dart/commit/0"
    (_, repo, kw), (_, _, ops, _) = fake_hub.calls
    assert repo == "someone/tiny-dart" and kw["private"] is True
    assert [op.path_in_repo for op in ops] == hub.push_file_list(folder)
    generate_py = next(op for op in ops if op.path_in_repo == "custom_generate/generate.py").path_or_fileobj
    assert b"HEAD_LOCATION: str | None = 'someone/tiny-dart'" in generate_py  # not the local folder


def test_push_refuses_a_folder_that_is_not_a_loadable_head(tmp_path, head, fake_hub):
    folder = write_folder(head, tmp_path / "h")
    sd = load_file(folder / "model.safetensors")
    del sd["norm.weight"]
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="refusing to push.*norm.weight"):
        hub.push_head(folder, "someone/broken")
    assert fake_hub.calls == []


def test_push_cli(tmp_path, head, fake_hub, capsys):
    folder = write_folder(head, tmp_path / "h")
    parser = argparse.ArgumentParser(prog="dart-hf")
    hub.add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["push", str(folder), "someone/tiny-dart", "--private"])
    assert args.func(args) == 0 and "pushed" in capsys.readouterr().out
    args = parser.parse_args(["push", str(tmp_path / "nothing"), "someone/x"])
    assert args.func(args) == 1 and "error" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- loading safety
def _broken_folder(tmp_path: Path, head, how: str) -> Path:
    folder = write_folder(head, tmp_path / how, card=False, custom=False)
    weights = folder / "model.safetensors"
    sd = load_file(weights)
    if how == "pickle_only":
        torch.save(sd, folder / "pytorch_model.bin")
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "wrong_shape":
        sd["midlayer.mask_rep"] = torch.zeros(3)
        save_file(sd, weights, metadata={"format": "pt"})
    elif how == "missing_key":
        del sd["midlayer.self_attn.q_proj.weight"]
        save_file(sd, weights, metadata={"format": "pt"})
    elif how == "other_model_type":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    return folder


@pytest.mark.parametrize(
    "how, pattern",
    [
        ("pickle_only", r"no file named model\.safetensors"),
        ("truncated", r"could not load a DART head from .*truncated: Error while deserializing header"),
        ("wrong_shape", r"model\.safetensors does not match DartConfig.*mismatched_keys.*midlayer\.mask_rep"),
        ("missing_key", r"model\.safetensors does not match DartConfig.*missing_keys.*q_proj\.weight"),
        ("other_model_type", r"is not a DART head: its config\.json has model_type='llama'"),
    ],
)
def test_unsafe_or_broken_folders_raise_clear_errors(tmp_path, head, how, pattern):
    folder = _broken_folder(tmp_path, head, how)
    with pytest.raises(ValueError, match=pattern):
        dart_hf.DartHead.from_pretrained(folder)
    if how == "pickle_only":  # and the pickle file was never opened: safetensors only
        with pytest.raises(ValueError):
            dart_hf.DartHead.from_pretrained(folder, use_safetensors=False)


# ---------------------------------------------------------------------------------------------------- custom_generate
RUN_WITHOUT_DART_HF = textwrap.dedent(
    """
    import json, sys, torch
    sys.modules["dart_hf"] = None  # any `import dart_hf` now raises ImportError
    from transformers import AutoModelForCausalLM

    target_dir, head_dir, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    same = []
    for p in prompts:
        ids = torch.tensor([p])
        ref = target.generate(ids, do_sample=False, max_new_tokens=12)
        out = target.generate(ids, custom_generate=head_dir, trust_remote_code=True, do_sample=False, max_new_tokens=12)
        same.append(torch.equal(out, ref))
    loaded = sorted(m for m in sys.modules if m == "dart_hf" or m.startswith("dart_hf."))
    print(json.dumps({"same": same, "dart_hf_modules": loaded, "dart_hf": repr(sys.modules["dart_hf"])}))
    """
)


def test_custom_generate_runs_dart_without_dart_hf(tmp_path, qwen3, head):
    target_dir, head_dir = tmp_path / "target", tmp_path / "head"
    qwen3.save_pretrained(target_dir)
    write_folder(head, head_dir)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    ids = json.dumps([p[0].tolist() for p in prompts(2, seed=5)])
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_DART_HF, str(target_dir), str(head_dir), ids],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"same": [True, True], "dart_hf_modules": ["dart_hf"], "dart_hf": "None"}
    # transformers copied the vendored modules next to generate.py in its module cache
    copied = {p.name for p in (tmp_path / "modules").rglob("custom_generate/*.py")}
    assert {"generate.py", "decoding.py", "modeling_dart.py", "tree.py"} <= copied


def test_shipped_custom_generate_copy_matches_the_package():
    """The committed model_cards/*/custom_generate/ copy is generated: it must not drift from dart_hf."""
    from dart_hf.tools.hub import custom_generate_sources

    folder = Path(__file__).resolve().parent.parent / "model_cards" / "smollm2-135m-instruct-dart"
    expected = custom_generate_sources("dart-hf/smollm2-135m-instruct-dart")
    shipped = {f"custom_generate/{p.name}": p.read_text() for p in (folder / "custom_generate").glob("*.py")}
    expected = {k if k.startswith("custom_generate/") else f"custom_generate/{k}": v for k, v in expected.items()}
    assert shipped == expected, "regenerate with: python examples/export_head.py runs/<head> <folder>"
