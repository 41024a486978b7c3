"""Head folders as they are shared: the push file list, the push itself (offline, with a fake Hub client), whole-folder
round trips, the model cards, loading safety, and `custom_generate/` running DART without dart_hf installed."""

from __future__ import annotations

import argparse
import json
import os
import re
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
from dart_hf_cli import main as cli
from dart_hf.tools import hub
from dart_hf.tools.convert import QWEN3_TARGETS

REPO_ROOT = Path(__file__).resolve().parents[1]
CARDS = REPO_ROOT / "model_cards"
CUSTOM_FILES = sorted(hub.custom_generate_sources())


@pytest.fixture(scope="module")
def qwen3(tiny_target):
    return tiny_target("qwen3")


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
    assert {"custom_generate/generate.py", "custom_generate/modeling.py", "custom_generate/budget.py"} <= set(CUSTOM_FILES)
    bare = tmp_path / "bare"
    make_head(make_target("qwen3")).save_pretrained(bare)
    # custom_generate/ is regenerated on push, so it is listed even where the folder has none yet
    assert hub.push_file_list(bare) == ["config.json", "model.safetensors", *CUSTOM_FILES]
    (bare / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        hub.push_file_list(bare)
    with pytest.raises(ValueError, match="no config.json"):
        hub.push_file_list(tmp_path / "missing")


def test_custom_generate_copy_is_core_verbatim_plus_the_entry(tmp_path, head):
    folder = write_folder(head, tmp_path / "h")
    (folder / "custom_generate" / "stale_module.py").write_text("x = 1\n")
    written = hub.write_custom_generate(folder)
    assert sorted(f"custom_generate/{p.name}" for p in (folder / "custom_generate").iterdir()) == written
    core = sorted(p for p in (REPO_ROOT / "dart_hf" / "core").glob("*.py") if p.name != "__init__.py")
    assert written == sorted([f"custom_generate/{p.name}" for p in core]
                             + ["custom_generate/generate.py", "custom_generate/requirements.txt"])
    assert (folder / "custom_generate" / "requirements.txt").read_text() == "transformers>=5.25\n"
    for path in core:  # every core module, whole and verbatim (the cost model behind node_budget=None included)
        assert (folder / "custom_generate" / path.name).read_text() == path.read_text(), path.name
    generate_py = (folder / "custom_generate" / "generate.py").read_text()
    entry = (REPO_ROOT / "dart_hf" / "integrations" / "custom_generate.py").read_text()
    assert generate_py.split("\n", 1)[1] == re.sub(r"^from \.\.core\.", "from .", entry, flags=re.MULTILINE)
    assert hub.REGENERATE_COMMAND in generate_py.split("\n", 1)[0]
    assert str(tmp_path) not in generate_py  # the copy names no folder: it can be moved or pushed as it is


def test_custom_generate_copy_refuses_imports_transformers_would_not_copy():
    ok = {"custom_generate/a.py": "from .b import x\n", "custom_generate/b.py": "import torch\n"}
    hub._check_self_contained(ok)
    for bad, message in [
        ("from . import b\n", "only `from .module import name`"),
        ("from ..b import x\n", "only `from .module import name`"),
        ("from .c import x\n", r"imports \['c'\]"),
        ("import dart_hf.core\n", "imports dart_hf"),
        ('"""\nfrom .c import x\n"""\n', r"imports \['c'\]"),  # transformers' regex would look for c.py
    ]:
        with pytest.raises(RuntimeError, match=message):
            hub._check_self_contained({**ok, "custom_generate/a.py": bad})


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
    assert generate_py == hub.custom_generate_sources()["custom_generate/generate.py"].encode()


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
    assert cli(["push", str(folder), "someone/tiny-dart", "--private"]) == 0 and "pushed" in capsys.readouterr().out
    assert cli(["push", str(tmp_path / "nothing"), "someone/x"]) == 1 and "error" in capsys.readouterr().err


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

    target_dir, runs, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    results = []
    for location, extra in runs:
        try:
            same = []
            for p in prompts:
                ids = torch.tensor([p])
                ref = target.generate(ids, do_sample=False, max_new_tokens=12)
                out = target.generate(ids, custom_generate=location, trust_remote_code=True, do_sample=False,
                                      max_new_tokens=12, **extra)
                same.append(torch.equal(out, ref))
            results.append(same)
        except Exception as error:
            results.append(f"{type(error).__name__}: {error}")
    loaded = sorted(m for m in sys.modules if m == "dart_hf" or m.startswith("dart_hf."))
    print(json.dumps({"runs": results, "dart_hf_modules": loaded, "dart_hf": repr(sys.modules["dart_hf"])}))
    """
)


def run_without_dart_hf(tmp_path: Path, target_dir: Path, *runs: tuple[str, dict], **env) -> dict:
    """`target.generate(custom_generate=location, **extra)` for each (location, extra) of `runs`, in one Python with
    dart_hf blocked, on 2 prompts: {"runs": [per prompt: equal to plain greedy generate, or the error], ...}."""
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1",
           "DART_HF_CACHE": str(tmp_path / "dart_cache"), **env}
    ids = json.dumps([p[0].tolist() for p in prompts(2, seed=5)])
    proc = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_DART_HF, str(target_dir), json.dumps(runs), ids],
        capture_output=True, text=True, env={**os.environ, **env}, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def without_dart_hf(*runs) -> dict:
    """What `run_without_dart_hf` prints when dart_hf was never imported: `runs` as given."""
    return {"runs": list(runs), "dart_hf_modules": ["dart_hf"], "dart_hf": "None"}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, qwen3):
    folder = tmp_path_factory.mktemp("target")
    qwen3.save_pretrained(folder)
    return folder


def test_custom_generate_runs_dart_without_dart_hf(tmp_path, qwen3_dir, head):
    """A relative path from another folder, after the head folder was moved: the copy finds the head where it
    was loaded from; and a cost-aware head (node_budget null) runs its budget policy from the copy."""
    write_folder(head, tmp_path / "written")
    (tmp_path / "elsewhere").mkdir()
    shutil.move(tmp_path / "written", tmp_path / "elsewhere" / "head")
    shutil.copytree(tmp_path / "elsewhere" / "head", tmp_path / "elsewhere" / "auto")
    cfg_file = tmp_path / "elsewhere" / "auto" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "node_budget": None}))
    result = run_without_dart_hf(tmp_path, qwen3_dir, ("elsewhere/head", {}), ("elsewhere/auto", {}))
    assert result == without_dart_hf([True, True], [True, True])
    # transformers copied the core modules next to generate.py in its module cache
    copied = {p.name for p in (tmp_path / "modules").rglob("custom_generate/*.py")}
    assert {"generate.py", "loop.py", "modeling.py", "tree.py", "budget.py"} <= copied
    assert not (tmp_path / "dart_cache" / "cost").exists()  # the copy's cost-aware budget measured and wrote nothing


def test_custom_generate_from_a_hub_snapshot_offline(tmp_path, qwen3_dir, head):
    """`custom_generate="<user>/<repo>"` with the repo in the Hub cache: the head loads from that snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-dart"
    write_folder(head, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    result = run_without_dart_hf(tmp_path, qwen3_dir, ("someone/tiny-dart", {}), HF_HUB_CACHE=str(tmp_path / "hub"))
    assert result == without_dart_hf([True, True])


def test_custom_generate_dart_head_overrides_the_location(tmp_path, qwen3_dir, head):
    """`dart_head=` picks the head; a folder with only the code then runs it (and a missing head is named)."""
    code_only = tmp_path / "code_only"
    hub.write_custom_generate(code_only)
    write_folder(head, tmp_path / "head", custom=False)
    result = run_without_dart_hf(tmp_path, qwen3_dir, (str(code_only), {"dart_head": str(tmp_path / "head")}),
                                 (str(code_only), {}))
    missing = result["runs"][1]
    assert isinstance(missing, str) and "code_only" in missing, missing
    assert result == without_dart_hf([True, True], missing)


# The README's custom_generate snippet, run verbatim from another folder with dart_hf blocked: tests/test_install.py
# (test_readme_custom_generate_runs_verbatim_from_another_folder_without_dart_hf).


def test_export_head_writes_a_self_contained_copy_and_leaves_the_source_alone(tmp_path, head):
    """`python -m dart_hf.tools.hub --out DIR HEAD` (the README's command): the head's files and a fresh
    `custom_generate/` in DIR, the source folder unchanged; a shipped head is found by its name; a wrong name is an
    error that names it."""
    source = write_folder(head, tmp_path / "source", custom=False)
    before = sorted(p.relative_to(source) for p in source.rglob("*"))
    assert hub.main(["--out", str(tmp_path / "copy"), str(source)]) == 0
    assert sorted(p.relative_to(source) for p in source.rglob("*")) == before
    written = {str(p.relative_to(tmp_path / "copy")) for p in (tmp_path / "copy").rglob("*") if p.is_file()}
    assert written == set(hub.push_file_list(source))
    shipped = hub.resolve_head_folder("smollm2-135m-instruct-dart")  # from any folder: the installed copy
    assert shipped.is_absolute() and (shipped / "config.json").is_file()
    with pytest.raises(FileNotFoundError, match="no-such-head"):
        hub.resolve_head_folder("no-such-head")
    assert hub.main(["--out", str(tmp_path / "x"), "no-such-head"]) == 1


@pytest.mark.parametrize("card, max_mib", [("smollm2-135m-instruct-dart", 48), ("qwen2.5-coder-0.5b-instruct-dart", 64)])
def test_shipped_card_folder_is_hub_ready_and_small(card, max_mib):
    """Every file a Hub repo needs (`custom_generate/` is generated on push, never committed: `.gitignore`), and a
    size that stays below what the folder may grow to (the SmolLM2 one ships in the wheel: 41.8 MiB since its draft
    vocabulary grew to 16,308 rows; 48 leaves room for the card's plots)."""
    files = {p.name for p in (CARDS / card).iterdir()}
    assert {"README.md", "config.json", "model.safetensors", "ngram.safetensors"} <= files
    assert hub.push_file_list(CARDS / card)[-len(CUSTOM_FILES):] == CUSTOM_FILES
    size = sum(p.stat().st_size for p in (CARDS / card).rglob("*") if p.is_file() and "custom_generate" not in p.parts)
    assert size <= max_mib * 2**20, f"{size / 2**20:.1f} MiB"
