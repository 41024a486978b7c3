"""dart_hf as users install it: a wheel (not the source tree) carries the shipped head, and the default head of
`dart-hf demo` / `dart-hf bench` resolves to that installed copy; without the [tools] extra the library works and the
tools name the extra; the README quick start runs verbatim from another folder (its custom_generate snippet,
transformers alone and offline: tests/test_new_user.py)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_dart_hf_package():
    """setuptools gets an explicit package list (for the model_cards mapping): a new subpackage must be in it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.relative_to(REPO_ROOT).parts[:-1]) for p in (REPO_ROOT / "dart_hf").rglob("__init__.py")}
    assert set(config["packages"]) == found | {"dart_hf.model_cards"}
    assert config["package-dir"] == {"dart_hf.model_cards": "model_cards"}


def test_pyproject_pins_the_transformers_floor_dart_hf_checks():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    import dart_hf

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert f"transformers>={dart_hf.TRANSFORMERS_FLOOR},<6" in project["dependencies"]


RESOLVE = """
import json, dart_hf
from dart_hf.tools.assets import shipped_head
from dart_hf.tools.hub import custom_generate_sources
head = shipped_head()
cfg = dart_hf.DartConfig.from_pretrained(head)
print(json.dumps({"package": dart_hf.__file__, "head": str(head), "model_type": cfg.model_type, "has_ngram": cfg.has_ngram,
                  "files": sorted(p.name for p in head.iterdir()), "custom_generate": sorted(custom_generate_sources())}))
"""


@pytest.mark.slow
def test_wheel_ships_the_head_and_resolves_it(tmp_path):
    source = tmp_path / "src"  # a clean copy: an in-tree build/ folder could leak stale files into the wheel
    ignore = shutil.ignore_patterns(".git", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache")
    shutil.copytree(REPO_ROOT, source, ignore=ignore)
    wheels, target = tmp_path / "wheels", tmp_path / "installed"
    build = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    proc = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), *wheels.glob("*.whl")]
    proc = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *site.getsitepackages()])}
    proc = subprocess.run([sys.executable, "-c", RESOLVE], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    installed_head = target / "dart_hf" / "model_cards" / "smollm2-135m-instruct-dart"
    assert got["package"] == str(target / "dart_hf" / "__init__.py")  # the wheel, not the source tree
    assert got["head"] == str(installed_head)
    assert got["model_type"] == "dart" and got["has_ngram"] is True
    assert {"config.json", "model.safetensors", "ngram.safetensors"} <= set(got["files"])
    # custom_generate/ is not shipped: the wheel generates it (`python -m dart_hf.tools.hub <head folder>`)
    assert "custom_generate" not in got["files"] and "custom_generate/generate.py" in got["custom_generate"]
    assert "custom_generate/loop.py" in got["custom_generate"]
    assert (target / "dart_hf_cli.py").is_file()


LIBRARY_ALONE = """
import sys
from pathlib import Path
sys.modules["gguf"] = sys.modules["matplotlib"] = None  # `pip install dart-hf`, without the [tools] extra
import dart_hf_cli
from transformers import AutoModel
from dart_hf.tools.assets import convert_target, shipped_head
head = AutoModel.from_pretrained(shipped_head())
print("HEAD", type(head).__name__)
print("CLI", dart_hf_cli.main(["demo"]))
print("PUSH", dart_hf_cli.main(["push", str(Path(sys.argv[1]) / "no-head"), "user/no-head"]))
try:
    convert_target("smollm2-135m-instruct", Path(sys.argv[1]) / "targets" / "smollm2")
except ImportError as error:
    print("CONVERT", error)
"""


def test_the_library_alone_loads_a_head_and_the_tools_ask_for_their_extra(tmp_path):
    """Without gguf and matplotlib (the [tools] extra) a head still loads; the `dart-hf` commands and a target
    conversion say which extra to install before doing anything, instead of a ModuleNotFoundError minutes in; `push`
    (hub only) runs without it."""
    proc = subprocess.run([sys.executable, "-c", LIBRARY_ALONE, str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAD DartHead" in proc.stdout and "CLI 2" in proc.stdout
    assert "dart-hf demo needs the [tools] extra (gguf, matplotlib not installed)" in proc.stderr
    assert "PUSH 1" in proc.stdout and "dart-hf push: error:" in proc.stderr  # push and convert need neither
    assert "dart-hf push needs" not in proc.stderr
    assert "CONVERT converting a PyPI-shipped target reads GGUF files" in proc.stdout
    assert "pip install gguf" in proc.stdout and "pip install gguf matplotlib" in proc.stderr  # true before PyPI
    assert not (tmp_path / "targets").exists()  # refused before installing or writing anything


def readme_block(heading: str) -> str:
    """The first python code block after a README heading."""
    text = (REPO_ROOT / "README.md").read_text()
    return text[text.index(heading):].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_readme_quick_start_runs_verbatim_from_another_folder(tmp_path):
    """The quick start, the batches example and the static-cache example as a user pastes them, run outside the
    repository (no relative path may leak in); the batched pipeline with the head gives the pipeline's texts without
    it, and the compiled DART step plain generate's tokens."""
    snippet = tmp_path / "snippet.py"
    batches = readme_block("### Batches")  # uses the quick start's target, tok and head
    printed = ("import builtins\nprinted = []\n"  # what the snippet prints, kept for the check
               "builtins.print = lambda *a, _p=print, **k: (printed.append(a), _p(*a, **k))\n")
    check = ('plain = pipeline("text-generation", model=target, tokenizer=tok, batch_size=4)'
             '(chats, do_sample=False, max_new_tokens=64)\n'
             'assert printed[-1] == (plain,), "batched pipeline differs"\n')  # what the README printed
    static = readme_block("### Static cache and `torch.compile`")  # compiles the step on this CPU (~1 min)
    static_check = ('assert head.stats.compiled and torch.equal(out, target.generate(ids, max_new_tokens=128)), '
                    '"compiled DART differs"\n')
    snippet.write_text(printed + readme_block("## Quick start (Python)") + batches + check + "import torch\n"
                       + static + static_check + 'print("QUICK START OK", out.shape)\n')
    proc = subprocess.run([sys.executable, str(snippet)], capture_output=True, text=True, cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "QUICK START OK" in proc.stdout
