"""The folders import one way (imports inside functions count too: they run as soon as the function
does): terminal/ -> conversation/ -> models/ -> persist/ -> engine/ -> the leaves (errors.py, paths.py,
hints.py, units.py, wrap.py). No module imports itself back through others; the engine reaches outside
itself only for the leaves (its own errors, where its files go, how a hint file is read, the size
format); persist/'s modules are reached from conversation/ alone, the rest of the app takes the
package's front (colichat.persist: Store, check_name, ...). Every module is named in docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import colichat

ROOT = Path(colichat.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """colichat module -> the colichat modules it imports: each module named, and the packages above
    it (their __init__ runs first), but not the importer's own packages (already imported)."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
        found |= {m.rsplit(".", k)[0] for m in found for k in range(1, m.count("."))}  # importing a.b.c runs a.b
        graph[name] = {m for m in found if m in paths and m != name and not name.startswith(m + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


LEAVES = {"colichat.errors", "colichat.paths", "colichat.hints", "colichat.units", "colichat.wrap"}
ORDER = ["colichat.terminal", "colichat.conversation", "colichat.models", "colichat.persist", "colichat.engine"]


def part_of(module: str) -> str:
    """The folder (or leaf) a module belongs to: colichat.conversation.chat -> colichat.conversation."""
    return ".".join(module.split(".")[:2])


def test_errors_and_paths_are_at_the_bottom():
    graph = import_graph()
    assert graph["colichat.errors"] == set()
    assert graph["colichat.paths"] == {"colichat.errors"}
    assert graph["colichat.hints"] == set()


def test_the_leaves_import_only_leaves():
    graph = import_graph()
    assert {m: found - LEAVES for m, found in graph.items() if m in LEAVES and found - LEAVES} == {}


def test_the_engine_imports_only_the_leaves_of_the_app():
    graph = import_graph()
    outside = {m for name, found in graph.items() if name.startswith("colichat.engine")
               for m in found if not m.startswith("colichat.engine")}
    assert outside <= {"colichat.errors", "colichat.paths", "colichat.units", "colichat.hints"}


def test_each_folder_imports_only_the_folders_below_it():
    graph = import_graph()
    upward = sorted(f"{name} -> {m}" for name, found in graph.items() if part_of(name) in ORDER
                    for m in found if part_of(m) in ORDER
                    and ORDER.index(part_of(m)) < ORDER.index(part_of(name)))
    assert upward == []


def test_persist_modules_are_reached_only_from_the_conversation():
    """Outside persist/ and conversation/, only the package's front (colichat.persist) is imported. The
    one exception: --prune-kv (terminal/one_shot.py) runs persist/prune.py, which works on files alone."""
    graph = import_graph()
    allowed = {("colichat.terminal.one_shot", "colichat.persist.prune")}
    reached = sorted((name, m) for name, found in graph.items()
                     if part_of(name) not in ("colichat.persist", "colichat.conversation")
                     for m in found if m.startswith("colichat.persist.") and (name, m) not in allowed)
    assert reached == []


def test_the_design_lists_every_module():
    design = (ROOT.parent / "docs" / "design.md").read_text(encoding="utf-8")
    unlisted = [module_name(p) for p in ROOT.rglob("*.py")
                if p.name != "__init__.py" and p.name not in design]
    assert unlisted == []
