"""Sharing heads: what a head folder uploads, the push itself, and the `custom_generate/` copy it carries.

A head folder on the Hub is self-sufficient in two ways:
- with dart_hf installed: `AutoModel.from_pretrained(repo)` + `target.generate(..., assistant_model=head)`;
- without it: `target.generate(..., custom_generate=repo, trust_remote_code=True)` runs `custom_generate/generate.py`,
  a generated copy of `dart_hf.integrations.custom_generate` plus the dart_hf modules it imports (see
  `custom_generate_sources`). The copy is regenerated on every push so it always matches this dart_hf version and
  names the repo it lives in.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from .. import __version__
from .convert import CONFIG_FILE, WEIGHTS_FILE
from ..core.ngram import FILE_NAME as NGRAM_FILE

PACKAGE_DIR = Path(__file__).resolve().parent
ENTRY_MODULE = "custom_generate_entry"
CUSTOM_GENERATE_DIR = "custom_generate"
CARD_FILE = "README.md"
WEIGHTS_INDEX = "model.safetensors.index.json"
_LOCATION_LINE = "HEAD_LOCATION: str | None = None\n"
# the pattern transformers (dynamic_module_utils.get_relative_imports) uses to find files to copy along
_TRANSFORMERS_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\S+)\s+import", flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------------------- vendoring
def _relative_imports(tree: ast.Module, module: str) -> tuple[set[str], list[ast.ImportFrom]]:
    """(modules imported at module level, import statements inside functions) among `from .x import y`."""
    eager: set[str] = set()
    lazy: list[ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and child.level:
                if child.level != 1 or not child.module:
                    raise ValueError(f"dart_hf/{module}.py: only `from .module import name` can be vendored")
                if in_function:
                    lazy.append(child)
                else:
                    eager.add(child.module)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return eager, lazy


def _vendored_modules() -> dict[str, ast.Module]:
    """The entry module and everything it imports at module level, transitively (name -> parsed source)."""
    found: dict[str, ast.Module] = {}
    todo = [ENTRY_MODULE]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        source = (PACKAGE_DIR / f"{name}.py").read_text(encoding="utf-8")
        found[name] = ast.parse(source)
        todo.extend(_relative_imports(found[name], name)[0])
    return found


def _vendor(name: str, tree: ast.Module, modules: set[str]) -> str:
    """The source of dart_hf/<name>.py with function-level imports of non-vendored modules turned into an
    ImportError (e.g. the cost model behind `node_budget=None`): transformers would otherwise look for those files."""
    lines = (PACKAGE_DIR / f"{name}.py").read_text(encoding="utf-8").splitlines(keepends=True)
    for node in sorted(_relative_imports(tree, name)[1], key=lambda n: -n.lineno):
        if node.module in modules:
            continue
        indent = lines[node.lineno - 1][: node.col_offset]
        message = f"dart_hf.{node.module} is not part of this custom_generate copy; pip install dart_hf to use it"
        lines[node.lineno - 1 : node.end_lineno] = [f"{indent}raise ImportError({message!r})\n"]
    header = (
        f"# Generated from dart_hf/{name}.py (dart_hf {__version__}) by dart_hf.tools.hub.write_custom_generate."
        " Do not edit.\n"
    )
    return header + "".join(lines)


def _absolute_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module)
    return names


def _check_self_contained(files: dict[str, str]) -> None:
    """Every relative import resolves inside the copy, and nothing imports dart_hf itself."""
    names = {Path(rel).stem for rel in files}
    for rel, text in files.items():
        if any(name.split(".")[0] == "dart_hf" for name in _absolute_imports(ast.parse(text))):
            raise RuntimeError(f"{rel} imports dart_hf: the custom_generate copy would need dart_hf installed")
        missing = set(_TRANSFORMERS_RELATIVE_IMPORT.findall(text)) - names
        if missing:
            raise RuntimeError(f"{rel} imports {sorted(missing)}, which are not part of the custom_generate copy")


def custom_generate_sources(head_location: str) -> dict[str, str]:
    """`custom_generate/*` files (relative path -> source) for a head found at `head_location`.

    Generated from the installed dart_hf, never maintained by hand: `custom_generate_entry.py` becomes
    `generate.py` with `HEAD_LOCATION` filled in, and each dart_hf module it needs is copied verbatim.
    """
    trees = _vendored_modules()
    files = {}
    for name, tree in sorted(trees.items()):
        text = _vendor(name, tree, set(trees))
        if name == ENTRY_MODULE:
            if text.count(_LOCATION_LINE) != 1:
                raise RuntimeError(f"dart_hf/{ENTRY_MODULE}.py must define {_LOCATION_LINE.strip()!r} exactly once")
            text = text.replace(_LOCATION_LINE, f"HEAD_LOCATION: str | None = {head_location!r}\n")
            name = "generate"
        files[f"{CUSTOM_GENERATE_DIR}/{name}.py"] = text
    _check_self_contained(files)
    return files


def write_custom_generate(folder: str | os.PathLike, head_location: str | None = None) -> list[str]:
    """Write `<folder>/custom_generate/` so `generate(custom_generate=folder, trust_remote_code=True)` runs DART.

    `head_location` is where generate.py loads the head from: by default this folder's absolute path (local use);
    `push_head` writes the repo id instead. Returns the written paths, relative to `folder`.
    """
    folder = Path(folder)
    location = head_location or str(folder.resolve())
    target = folder / CUSTOM_GENERATE_DIR
    target.mkdir(parents=True, exist_ok=True)
    files = custom_generate_sources(location)
    stale = {p.name for p in target.glob("*.py")} - {Path(rel).name for rel in files}
    for name in stale:  # modules of an older dart_hf that the new copy no longer needs
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
    return files + sorted(custom_generate_sources("<repo>"))


def push_head(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload DART head (dart_hf)",
) -> str:
    """Upload a head folder to the Hub in one commit; returns the commit URL.

    Refuses (ValueError, before any network call) a folder that `DartHead.from_pretrained` would not load, so a
    broken head never reaches the Hub. The uploaded `custom_generate/generate.py` loads the head from `repo_id`.
    """
    from ..core.modeling import DartHead

    files = push_file_list(folder)
    try:
        DartHead.from_pretrained(folder)
    except (ValueError, OSError) as err:
        raise ValueError(f"refusing to push {folder}: it is not a loadable DART head: {err}") from err
    sources = custom_generate_sources(repo_id)
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


def _run(args: argparse.Namespace) -> int:
    try:
        url = push_head(args.folder, args.repo, private=args.private, token=args.token)
    except (ValueError, OSError) as err:
        print(f"dart-hf push: error: {err}", file=sys.stderr)
        return 1
    print(f"pushed {args.folder} to {args.repo}: {url}")
    return 0


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `dart-hf push <folder> <repo>` on an argparse subparsers object (args carry `func(args) -> int`)."""
    parser = subparsers.add_parser(
        "push",
        help="upload a DART head folder (weights, n-gram, card, custom_generate/) to the Hugging Face Hub",
        description=push_head.__doc__.split("\n\n")[0],
    )
    parser.add_argument("folder", help="a dart_hf head folder (config.json + model.safetensors)")
    parser.add_argument("repo", help="Hub repo id, e.g. <user>/qwen3-8b-dart")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--token", default=None, help="Hub token (default: the one saved by `hf auth login`)")
    parser.set_defaults(func=_run)
    return parser


__all__ = ["add_cli", "custom_generate_sources", "push_file_list", "push_head", "write_custom_generate"]
