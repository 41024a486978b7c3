"""The user docs name only things that exist: file paths and `dart_hf.*` names in README / BENCHMARKS / docs /
model cards resolve at this commit. A renamed module or a moved file fails here, with the names to fix."""

from __future__ import annotations

import glob
import importlib
import inspect
import re
from pathlib import Path

import pytest

import dart_hf

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "model_cards").glob("*/README.md")]
)

# Paths the docs mention that are not in the repository by design: outputs of commands (runs/, reference/,
# the user's own folders), per-user caches, and folders that commands write inside a head folder.
NOT_IN_REPO = ("runs/", "reference/", "<", "~/", "$")
GENERATED_NAMES = ("custom_generate/", "custom_generate/generate.py", "checkpoint/")
# Bare file names (no folder) are checked only for Python modules: they must exist somewhere in the repository.
PATH_EXT = (".py", ".md", ".json", ".jsonl", ".safetensors", ".png", ".sh", ".toml", ".pt", ".trie", ".gguf")

FENCE = re.compile(r"```.*?```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOTTED = re.compile(r"(?<![\w./-])dart_hf(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"from\s+(dart_hf(?:\.\w+)*)\s+import\s+([\w ,]+)")
CLASS_ATTR = re.compile(r"(?<![\w.])(" + "|".join(dart_hf.__all__) + r")\.([A-Za-z_]\w*)")
TOKEN = re.compile(r"[\w.<>~$*{},/-]+")


def _doc_text(doc: Path) -> tuple[str, str]:
    """(the whole text, the text outside fenced code blocks)."""
    text = doc.read_text(encoding="utf-8")
    return text, FENCE.sub("", text)


def _path_candidates(doc: Path) -> set[str]:
    text, prose = _doc_text(doc)
    tokens = set()
    for span in INLINE.findall(prose):
        tokens.update(TOKEN.findall(span))
    for block in FENCE.findall(text):
        tokens.update(TOKEN.findall(block))
    links = {t.split("#")[0] for t in LINK.findall(text) if "://" not in t and not t.startswith("#")}
    roots = {p.name for p in ROOT.iterdir()} | {p.name for p in (ROOT / "dart_hf").iterdir()}
    found = set(t for t in links if t)
    for token in tokens:
        token = token.strip(".,;:()")
        if "://" in token or token.startswith(("-", ".")) and not token.startswith(("./", "../")):
            continue
        if "/" in token:
            first = token.split("/")[0]
            if first in roots or token.endswith(PATH_EXT) or token.startswith(NOT_IN_REPO):
                found.add(token)
        elif token.endswith(".py"):
            found.add(token)
    return found


def _path_exists(token: str, doc: Path) -> bool:
    if token.startswith(NOT_IN_REPO) or any(token.endswith(g) or f"/{g}" in token for g in GENERATED_NAMES):
        return True
    if "/" not in token:  # a bare module file name
        return any(p for p in ROOT.rglob(token) if ".git" not in p.parts)
    bases = (ROOT, doc.parent, ROOT / "dart_hf")
    return any(glob.glob(str(base / token.rstrip("/"))) for base in bases)


def _dotted_names(doc: Path) -> set[str]:
    text, _ = _doc_text(doc)
    names = set(DOTTED.findall(text))
    for module, imported in FROM_IMPORT.findall(text):
        names.update(f"{module}.{name.strip()}" for name in imported.split(",") if name.strip())
    names.update(f"dart_hf.{cls}.{attr}" for cls, attr in CLASS_ATTR.findall(text))
    return names


def _has_attr(obj, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if inspect.isclass(obj):  # instance attributes: dataclass fields, annotations, `self.name = ...`
        if name in getattr(obj, "__dataclass_fields__", {}) or name in getattr(obj, "__annotations__", {}):
            return True
        for cls in obj.__mro__:
            try:
                if re.search(rf"self\.{name}\s*[:=]", inspect.getsource(cls)):
                    return True
            except (OSError, TypeError):
                continue
    return False


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not _has_attr(obj, attr):
                return False
            obj = getattr(obj, attr, None)
            if obj is None:  # an instance attribute: nothing further to check
                break
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_paths_exist(doc):
    missing = sorted(t for t in _path_candidates(doc) if not _path_exists(t, doc))
    assert not missing, f"{doc.relative_to(ROOT)} mentions paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_dart_hf_names_resolve(doc):
    missing = sorted(n for n in _dotted_names(doc) if not _resolves(n))
    assert not missing, f"{doc.relative_to(ROOT)} mentions dart_hf names that do not exist: {missing}"


def test_checker_catches_stale_names(tmp_path):
    doc = tmp_path / "X.md"
    doc.write_text("See `dart_hf/prompt_lookup.py`, `cost_model.py`, `dart_hf.core.nothing` and "
                   "`DartHead.node_budget_for`; fine: `runs/bench/results.json`, `dart_hf.core.loop.dart_decode`.\n")
    paths = {t for t in _path_candidates(doc) if not _path_exists(t, doc)}
    names = {n for n in _dotted_names(doc) if not _resolves(n)}
    assert paths == {"dart_hf/prompt_lookup.py", "cost_model.py"}
    assert names == {"dart_hf.core.nothing", "dart_hf.DartHead.node_budget_for"}


# ------------------------------------------------------------------------------------------- README size and links
README_LIMIT = 15_000  # bytes: what a user reads first fits a screen or two; reference material lives in docs/
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but `-` and `_` dropped, spaces to `-`, a
    repeated heading numbered (`-1`, `-2`, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _broken_anchors(doc: Path) -> list[str]:
    broken = []
    for link in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
        if "://" in link or "#" not in link:
            continue
        target, anchor = link.split("#", 1)
        page = (doc.parent / target).resolve() if target else doc
        if page.suffix == ".md" and page.exists() and anchor not in _anchors(page):
            broken.append(link)
    return broken


def test_readme_fits_its_limit():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes (limit {README_LIMIT}): move reference text to docs/"


def test_readme_links_every_docs_page():
    links = {t.split("#")[0] for t in LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))}
    unlinked = sorted(p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in links)
    assert not unlinked, f"README.md links no docs page {unlinked}: a user cannot find them"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_link_anchors_resolve(doc):
    broken = _broken_anchors(doc)
    assert not broken, f"{doc.relative_to(ROOT)} links headings that do not exist: {broken}"


def test_anchor_checker_catches_a_moved_heading(tmp_path):
    (tmp_path / "B.md").write_text("# Static cache + `torch.compile` on both sides\n## Run a head without dart_hf\n## Run\n## Run\n")
    doc = tmp_path / "A.md"
    doc.write_text("## Sampling\n[a](#sampling) [b](#limits) [c](B.md#static-cache--torchcompile-on-both-sides) "
                   "[d](B.md#run-a-head-without-dart_hf) [e](B.md#run-1) [f](B.md#node-budget) [g](https://x.org/#y)\n"
                   "```\n# not a heading\n```\n[h](#not-a-heading)\n")
    assert _broken_anchors(doc) == ["#limits", "B.md#node-budget", "#not-a-heading"]
