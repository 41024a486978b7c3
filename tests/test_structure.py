"""The package's shape, checked: no import cycles, a self-contained core, and a light `import dart_hf` / CLI.

Why these matter: `custom_generate/` ships `dart_hf/core/` copied whole (so core may only import itself and
third-party packages); a cycle hidden behind a function-level import breaks as soon as someone imports the modules
in another order; and users pay for every import `import dart_hf` or `dart-hf --help` triggers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dart_hf"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """Absolute name of what `from <dots><name> import ...` in `module` refers to."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> dart_hf modules it imports, at module level or inside functions (both can close a cycle)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(name, path.name == "__init__.py", node) if node.level else node.module or ""
                candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            deps.update(c for c in candidates if c in modules and c != name)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package `__init__` files re-export their submodules; an edge into one is an edge into what it re-exports,
    and an edge from a submodule to its own package's `__init__` is how Python imports it, not a design choice."""
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_the_checker_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    assert _cycle(_without_package_inits(import_graph())) is None


def test_core_imports_only_core() -> None:
    """`custom_generate/` is `dart_hf/core/*.py` copied verbatim: anything else core imports would be missing."""
    graph = import_graph()
    outside = {m: sorted(d for d in deps if not d.startswith("dart_hf.core"))
               for m, deps in graph.items() if m.startswith("dart_hf.core")}
    assert {m: d for m, d in outside.items() if d} == {}


def test_core_uses_flat_relative_imports() -> None:
    """transformers' dynamic-module loader copies the files named by `from .x import y`: nothing else works there."""
    bad = []
    for path in (PACKAGE / "core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level and (node.level != 1 or not node.module):
                bad.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                bad += [f"{path.name}:{node.lineno}" for n in names if n and n.split(".")[0] == "dart_hf"]
    assert bad == []


def test_the_head_module_imports_nothing_above_it() -> None:
    allowed = {"dart_hf.core.configuration", "dart_hf.core.ngram"}
    assert import_graph()["dart_hf.core.modeling"] <= allowed


def _imported_by(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


@pytest.fixture(scope="module")
def imported_by_dart_hf() -> set[str]:
    return _imported_by("import dart_hf")  # one fresh interpreter for all the cases below


@pytest.mark.parametrize("heavy", ["matplotlib", "gguf", "dart_hf.tools", "dart_hf.training"])
def test_import_dart_hf_stays_light(imported_by_dart_hf: set[str], heavy: str) -> None:
    assert "dart_hf" in imported_by_dart_hf and heavy not in imported_by_dart_hf


def test_cli_parses_before_importing_torch() -> None:
    loaded = _imported_by("import dart_hf_cli\ndart_hf_cli.build_parser().parse_args(['bench', '--n', '3'])")
    assert "torch" not in loaded and "dart_hf" not in loaded
