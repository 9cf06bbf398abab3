"""The package's import graph: no circle of imports, and every import points down the layers.

Every ``import`` of a pdflow module counts, at module level or inside a function (a deferred
import still ties the two modules together); those under ``if TYPE_CHECKING:`` do not (they are
annotations). Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so an import
also points at the packages above its target.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pdflow"

# Low to high: a module may import from its own layer's packages (without a circle) and from
# lower layers. The leaves import nothing of pdflow's, or only other leaves.
LAYERS = (
    ("pdflow", "pdflow.registry", "pdflow.plugins", "pdflow.paths", "pdflow.log", "pdflow.timeline",
     "pdflow.messages", "pdflow.guides", "pdflow.model_files", "pdflow.security", "pdflow.kernels"),
    ("pdflow.transports",),  # the data plane
    ("pdflow.kv",),  # blocks, the store, its tiers and codecs
    ("pdflow.models", "pdflow.config"),  # models on disk; the pipeline as plain data
    ("pdflow.engine", "pdflow.routing"),
    ("pdflow.speculative",),  # given to the engine's batches as an object
    ("pdflow.runtime",),  # processes, buses, the launcher, the stage kinds
    ("pdflow.serving",),  # HTTP and the OpenAI API
    ("pdflow.stages",),
    ("pdflow.testing",),  # servers and references for tests and benchmarks
    ("pdflow.bench", "pdflow.plan", "pdflow.simulate"),
    ("pdflow.cli", "pdflow.top"),
)
# (importer, imported) pairs allowed to point up, each with its reason: none today.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (``pdflow.a.b.Name`` -> ``pdflow.a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                visit(ast.iter_child_nodes(node))
                continue
            for name in names:
                target = _owner(name, modules) if name.startswith("pdflow") else None
                while target and target != module and not module.startswith(target + "."):
                    targets.add(target)
                    target = target.rpartition(".")[0]

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return targets


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imported(module, path, modules) for module, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _layer(module: str) -> int:
    best, depth = None, -1
    for level, packages in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and package.count(".") > depth:
                best, depth = level, package.count(".")
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best


def test_no_circle_of_imports(graph) -> None:
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_point_down_the_layers(graph) -> None:
    upward = sorted((a, b) for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))
    assert [pair for pair in upward if pair not in UPWARD_ALLOWED] == []
    assert len(UPWARD_ALLOWED) <= 1


def test_deferred_and_parent_imports_count(tmp_path) -> None:
    modules = {"pdflow": Path("x/__init__.py"), "pdflow.a": Path("a/__init__.py"), "pdflow.a.b": Path("b.py"),
               "pdflow.c": Path("c.py")}
    source = "def f():\n    from pdflow.a.b import thing\nif TYPE_CHECKING:\n    import pdflow.c\n"
    path = tmp_path / "c.py"
    path.write_text(source)
    assert _imported("pdflow.c", path, modules) == {"pdflow.a.b", "pdflow.a"}
