"""Sharing heads: what a head folder uploads, the push itself, and the `custom_generate/` copy it carries.

A head folder on the Hub is self-sufficient in two ways:
- with dart_hf installed: `AutoModel.from_pretrained(repo)` + `target.generate(..., assistant_model=head)`;
- without it: `target.generate(..., custom_generate=repo, trust_remote_code=True)` runs `custom_generate/generate.py`
  (see `custom_generate_sources`). The copy is generated, never committed: `push_head` uploads a fresh one, the
  converter writes one, and `python -m dart_hf.tools.hub <head folder>` (`write_custom_generate`) writes one into any
  folder, so it always matches the dart_hf version that wrote it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import sys
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from .. import TRANSFORMERS_FLOOR, __version__
from transformers.utils import CONFIG_NAME as CONFIG_FILE
from transformers.utils import SAFE_WEIGHTS_NAME as WEIGHTS_FILE
from ..core.ngram import FILE_NAME as NGRAM_FILE

PACKAGE_DIR = Path(__file__).resolve().parent.parent
CORE_DIR = PACKAGE_DIR / "core"
ENTRY_FILE = PACKAGE_DIR / "integrations" / "custom_generate.py"
CUSTOM_GENERATE_DIR = "custom_generate"
CARD_FILE = "README.md"
WEIGHTS_INDEX = "model.safetensors.index.json"
REGENERATE_COMMAND = "python -m dart_hf.tools.hub <head folder>"
# the patterns transformers (dynamic_module_utils.get_relative_imports) uses to find the files to copy along
_TRANSFORMERS_RELATIVE_IMPORT = re.compile(r"^\s*(?:from\s+\.(\S+)\s+import|import\s+\.(\S+)\s*$)", flags=re.MULTILINE)
_ENTRY_CORE_IMPORT = re.compile(r"^from \.\.core\.(\w+) import ", flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------------------- custom_generate
def _imports(text: str) -> tuple[set[str], list[str]]:
    """(relative modules imported as `from .x import y`, absolute top-level packages) of a source file; raises on
    any other relative import form, which transformers' regex-based copier would mishandle."""
    relative, absolute = set(), []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level != 1 or not node.module or "." in node.module:
                raise ValueError("only `from .module import name` works in a custom_generate copy")
            relative.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.module:
            absolute.append(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            absolute += [alias.name.split(".")[0] for alias in node.names]
    return relative, absolute


def _check_self_contained(files: dict[str, str]) -> None:
    """Every relative import names a file of the copy, transformers' copier sees the same imports as Python,
    and nothing imports dart_hf itself."""
    names = {Path(rel).stem for rel in files}
    for rel, text in files.items():
        try:
            relative, absolute = _imports(text)
        except ValueError as err:
            raise RuntimeError(f"{rel}: {err}") from err
        if "dart_hf" in absolute:
            raise RuntimeError(f"{rel} imports dart_hf: the custom_generate copy would need dart_hf installed")
        seen = {a or b for a, b in _TRANSFORMERS_RELATIVE_IMPORT.findall(text)}
        if relative - names or seen != relative:
            raise RuntimeError(
                f"{rel} imports {sorted(relative | seen)}; the custom_generate copy has {sorted(names)}"
            )


def custom_generate_sources() -> dict[str, str]:
    """`custom_generate/*` files (relative path -> source), generated from the installed dart_hf.

    Every `dart_hf/core/*.py` module is copied whole and verbatim (core modules import each other only as
    `from .x import y`, which transformers follows), and `dart_hf/integrations/custom_generate.py` becomes
    `generate.py` with its `from ..core.x import` lines turned into `from .x import`, plus a `requirements.txt`
    with dart_hf's transformers floor. The same files serve every head: generate.py finds the head from the
    `custom_generate=` argument it was called with.
    """
    files = {
        f"{CUSTOM_GENERATE_DIR}/{path.name}": path.read_text(encoding="utf-8")
        for path in sorted(CORE_DIR.glob("*.py"))
        if path.name != "__init__.py"  # a package marker: transformers makes its own
    }
    entry = _ENTRY_CORE_IMPORT.sub(r"from .\1 import ", ENTRY_FILE.read_text(encoding="utf-8"))
    header = (
        f"# Generated from dart_hf/integrations/custom_generate.py (dart_hf {__version__}) by "
        f"`{REGENERATE_COMMAND}`. Do not edit.\n"
    )
    files[f"{CUSTOM_GENERATE_DIR}/generate.py"] = header + entry
    _check_self_contained(files)
    # transformers checks it before loading generate.py: an older release is refused with this line, not run
    files[f"{CUSTOM_GENERATE_DIR}/requirements.txt"] = f"transformers>={TRANSFORMERS_FLOOR}\n"
    return files


def write_custom_generate(folder: str | os.PathLike) -> list[str]:
    """Write `<folder>/custom_generate/` so `generate(custom_generate=folder, trust_remote_code=True)` runs DART
    without dart_hf; `.py` files of an older copy that this one no longer has are removed. Returns the written
    paths, relative to `folder`."""
    folder = Path(folder)
    target = folder / CUSTOM_GENERATE_DIR
    target.mkdir(parents=True, exist_ok=True)
    files = custom_generate_sources()
    stale = {p.name for p in target.glob("*.py")} - {Path(rel).name for rel in files}
    for name in stale:
        (target / name).unlink()
    for rel, text in files.items():
        (folder / rel).write_text(text, encoding="utf-8")
    return sorted(files)


# ---------------------------------------------------------------------------------------------------- push
def _weight_files(folder: Path) -> list[str]:
    if (folder / WEIGHTS_FILE).is_file():
        return [WEIGHTS_FILE]
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [WEIGHTS_INDEX, *shards]
    raise ValueError(f"{folder} is not a DART head folder: no {WEIGHTS_FILE} (safetensors weights are required)")


def push_file_list(folder: str | os.PathLike) -> list[str]:
    """What `push_head` uploads from `folder`, as repo paths: config.json, the safetensors weights,
    ngram.safetensors and README.md when present, and the `custom_generate/` files (always regenerated)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{folder} is not a DART head folder: no {CONFIG_FILE}")
    files = [CONFIG_FILE, *_weight_files(folder)]
    files += [name for name in (NGRAM_FILE, CARD_FILE) if (folder / name).is_file()]
    return files + sorted(custom_generate_sources())


def push_head(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload DART head (dart_hf)",
) -> str:
    """Upload a head folder to the Hub in one commit; returns the commit URL.

    Refuses (ValueError, before any network call) a folder that `DartHead.from_pretrained` would not load, so a
    broken head never reaches the Hub. `custom_generate/` is uploaded freshly generated, whatever the folder holds.
    """
    from ..core.modeling import DartHead

    files = push_file_list(folder)
    try:
        DartHead.from_pretrained(folder)
    except (ValueError, OSError) as err:
        raise ValueError(f"refusing to push {folder}: it is not a loadable DART head: {err}") from err
    sources = custom_generate_sources()
    operations = [
        CommitOperationAdd(path_in_repo=rel, path_or_fileobj=sources[rel].encode("utf-8"))
        if rel in sources
        else CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(Path(folder) / rel))
        for rel in files
    ]
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    commit = api.create_commit(repo_id, operations=operations, commit_message=commit_message, repo_type="model")
    return commit.commit_url


def run(args: argparse.Namespace) -> int:
    try:
        url = push_head(args.folder, args.repo, private=args.private, token=args.token)
    except (ValueError, OSError) as err:
        print(f"dart-hf push: error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {args.folder} to {args.repo}: {url}")
    return 0


def resolve_head_folder(name_or_folder: str | os.PathLike) -> Path:
    """A head folder: the path itself when it is a folder, else the head shipped with dart_hf of that name (e.g.
    `smollm2-135m-instruct-dart`, wherever dart_hf is installed); FileNotFoundError naming both otherwise."""
    folder = Path(name_or_folder).expanduser()
    if folder.is_dir():
        return folder
    from .assets import shipped_head

    try:
        return shipped_head(str(name_or_folder))
    except FileNotFoundError:
        raise FileNotFoundError(f"{name_or_folder!r} is neither a folder nor the name of a head shipped with dart_hf "
                                f"(smollm2-135m-instruct-dart)") from None


def export_head(source: str | os.PathLike, out: str | os.PathLike) -> list[str]:
    """Copy a head (its config, weights, n-gram and card: what `push_head` uploads) into `out` and write `out`'s
    `custom_generate/`, leaving the source folder untouched. Returns the written paths, relative to `out`."""
    source, out = resolve_head_folder(source), Path(out)
    if out.resolve() == source.resolve():
        return write_custom_generate(out)
    out.mkdir(parents=True, exist_ok=True)
    sources = custom_generate_sources()
    copied = [rel for rel in push_file_list(source) if rel not in sources]
    for rel in copied:
        shutil.copy2(source / rel, out / rel)
    return sorted(copied + write_custom_generate(out))


def main(argv: list[str] | None = None) -> int:
    """`python -m dart_hf.tools.hub <head folder>...`: regenerate the folders' `custom_generate/` copies;
    `python -m dart_hf.tools.hub --out DIR <head folder or shipped head name>`: a self-contained copy in DIR."""
    parser = argparse.ArgumentParser(
        prog="python -m dart_hf.tools.hub",
        description="write custom_generate/ into DART head folders, so that target.generate(..., custom_generate="
                    "<folder>, trust_remote_code=True) runs DART with transformers alone")
    parser.add_argument("heads", nargs="+", metavar="HEAD",
                        help="head folder, or the name of a head shipped with dart_hf (smollm2-135m-instruct-dart)")
    parser.add_argument("--out", default=None,
                        help="copy the head (config, weights, n-gram, card) into this folder and write "
                        "custom_generate/ there, leaving the head's own folder untouched; without it: written into "
                        "each head folder")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.out is not None and len(args.heads) != 1:
        parser.error("--out takes one head")
    try:
        if args.out is not None:
            written = export_head(args.heads[0], args.out)
            print(f"{args.out}: wrote {len(written)} files ({Path(args.out).resolve()})")
            return 0
        for name in args.heads:
            folder = resolve_head_folder(name)
            print(f"{folder}: wrote {len(write_custom_generate(folder))} files")
    except (OSError, ValueError) as err:
        print(f"python -m dart_hf.tools.hub: error: {err}", file=sys.stderr)
        return 1
    return 0


__all__ = ["custom_generate_sources", "export_head", "push_file_list", "push_head", "resolve_head_folder",
           "write_custom_generate"]


if __name__ == "__main__":
    sys.exit(main())
