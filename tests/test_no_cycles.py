"""No import cycle among the package's modules as it installs, counting every import statement (module level,
inside functions, under ``TYPE_CHECKING``), and a planted cycle would be caught."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "lint_imports.py"
PACKAGE = "scd_store"


@pytest.fixture(scope="module")
def tool():
    if "lint_imports" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lint_imports", TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules["lint_imports"] = module
        spec.loader.exec_module(module)
    return sys.modules["lint_imports"]


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under ``root/PACKAGE``: its dotted name -> (file, whether it is a package's ``__init__``)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _known(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (None: outside the package)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in modules:
            return prefix
    return None


def _imported(node: ast.Import | ast.ImportFrom, module: str, package: bool) -> list[str]:
    """The dotted names an import statement of ``module`` names, relative ones resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if package else module.split(".")[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join([*here, *([base] if base else [])])
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, over every import statement of every module."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported(node, name, package)
            if isinstance(node, ast.ImportFrom):  # `from a import b`: the module a.b if there is one, else a
                base, names = names[-1], names[:-1]
                names = [n if n in modules else base for n in names]
            for target in (_known(n, modules) for n in names):
                if target is not None and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_package_has_no_import_cycle(tool, tmp_path):
    tool.installed_layout(tmp_path)
    graph = import_graph(tmp_path)
    assert "scd_store.codecs.scd.codec" in graph and "scd_store.adapters.lmcache.plugin" in graph  # as installed
    assert "scd_store.store.keys" in graph["scd_store.store.tiered"]
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("module, planted", [
    ("scd_store/store/keys.py", "import scd_store.store.tiered\n"),
    ("scd_store/store/keys.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from scd_store.store.views import ProducerView\n"),
    ("scd_store/store/records.py", "def late():\n    from . import registry_cache\n"),
    ("scd_store/store/tiers/lru.py", "from ..tiered import TieredStore\n"),
])
def test_a_planted_cycle_is_caught(tool, tmp_path, module, planted):
    tool.installed_layout(tmp_path)
    before = cycles(import_graph(tmp_path))
    path = tmp_path / module
    path.write_text(path.read_text() + "\n" + planted)
    after = cycles(import_graph(tmp_path))
    planted_in = module[:-3].replace("/", ".")
    assert after != before and any(planted_in in c for c in after)


def test_the_graph_resolves_relative_and_package_imports(tmp_path):
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import thing\n")
    (package / "sub" / "a.py").write_text("from . import b\nfrom scd_store.sub import thing\nimport os\n")
    (package / "sub" / "b.py").write_text("thing = 1\ndef f():\n    from ..sub import a\n")
    graph = import_graph(tmp_path)
    assert graph["scd_store.sub.a"] == {"scd_store.sub.b", "scd_store.sub"}
    assert graph["scd_store.sub"] == {"scd_store.sub.b"}
    assert graph["scd_store.sub.b"] == {"scd_store.sub.a"}
    assert cycles(graph) == [["scd_store.sub", "scd_store.sub.a", "scd_store.sub.b"]]
