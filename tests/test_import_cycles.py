"""No import cycles among loraplex's modules (#62).

The graph is built from the source with `ast`, not by importing anything: every `import` and
`from ... import` anywhere in a module counts, the ones inside functions (lazy imports) and under
`if TYPE_CHECKING:` included. A lazy import hides a cycle from Python's import machinery, not from the
design: the module still needs the other one, so the layering is still circular.

`from loraplex.x import name` is an edge to `loraplex.x.name` when that is a module, else to `loraplex.x`;
the package-level names of the five namespace packages (`from loraplex.platform import LLM`) resolve
through `_EXPORTS` in `loraplex/__init__.py` to the module that defines them. Importing a module also
runs its packages' `__init__.py`, so each import is an edge to those too, except a module's edge to its own
package's `__init__.py` when that holds nothing (no statement but a docstring): such an `__init__` imports
nothing, so it cannot close a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("platform", "adapters", "kernels", "grammar", "api")
PREFIX = "loraplex"


def module_name(path: Path, root: Path = ROOT) -> str:
    """platform/core/scheduler.py -> loraplex.platform.core.scheduler; an __init__.py -> its package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PREFIX, *parts])


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of the five folders."""
    files = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files[module_name(path, root)] = path
    return files


def package_exports(root: Path = ROOT) -> dict[str, str]:
    """`loraplex.platform.LLM` -> `loraplex.platform.engine.llm`: the lazy package-level names."""
    init = root / PREFIX / "__init__.py"
    if not init.is_file():
        return {}
    tree = ast.parse(init.read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            target = node.target
        elif isinstance(node, ast.Assign):
            target = node.targets[0]
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and node.value is not None:
            exports = ast.literal_eval(node.value)
            return {f"{PREFIX}.{sub}.{name}": f"{PREFIX}.{sub}.{where}"
                    for sub, names in exports.items() for name, where in names.items()}
    return {}


def is_empty(tree: ast.Module) -> bool:
    """Nothing but (at most) a docstring."""
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return not body


def imported_names(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """Each module name an import anywhere in the tree reaches (before resolving to our modules)."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.extend(f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names)
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules it imports (directly, anywhere in its source), ours only."""
    files = source_files(root)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in files.items()}
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    empty_inits = {name for name in packages if is_empty(trees[name])}
    exports = package_exports(root)

    def resolve(name: str) -> str | None:
        """The module an imported dotted name lands on: itself, a name's module, or its longest module prefix."""
        name = exports.get(name, name)
        while name and name not in files:
            name = name.rpartition(".")[0]
            name = exports.get(name, name)
        return name or None

    graph: dict[str, set[str]] = {}
    for module, tree in trees.items():
        own_packages = {module.rsplit(".", k)[0] for k in range(1, module.count("."))}
        if module in packages:
            own_packages.add(module)
        edges = set()
        for name in imported_names(tree, module, module in packages):
            target = resolve(name)
            if target is None:
                continue
            # the target and every package __init__ above it run on import
            reached = {target} | {target.rsplit(".", k)[0] for k in range(1, target.count("."))}
            for each in reached:
                if each not in files or each == module:
                    continue
                if each in own_packages and each in empty_inits:
                    continue
                edges.add(each)
        graph[module] = edges
    return graph


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit to hit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through a component's first module, shortest first (breadth-first), closed on itself."""
    members = set(component)
    start = component[0]
    previous = {start: None}
    queue = [start]
    for node in queue:
        for child in sorted(graph[node] & members):
            if child == start:
                path = [start]
                while node is not None:
                    path.append(node)
                    node = previous[node]
                return path[::-1]  # start -> ... -> node -> start
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    cycle = a_cycle(graph, component)
    line = " -> ".join(cycle)
    if len(component) > len(cycle) - 1:
        line += f"\n    (one of the cycles among these {len(component)} modules: {', '.join(component)})"
    return line


def cycles(graph: dict[str, set[str]]) -> list[str]:
    return [describe(graph, c) for c in strongly_connected_components(graph) if len(c) > 1]


def test_the_graph_has_every_module_and_only_ours():
    graph = import_graph()
    assert "loraplex.platform.core.scheduler" in graph
    assert "loraplex.platform.models" in graph  # an __init__.py is its package
    assert "loraplex.platform.models.__init__" not in graph
    assert len(graph) == len(source_files())
    assert "loraplex.api.serve" in graph["loraplex.api.cli"]  # imported inside `_serve`
    for module, targets in graph.items():
        assert module not in targets
        assert all(t in graph for t in targets)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_lazy_type_checking_relative_and_package_imports_all_count(tmp_path):
    """A cycle closed only by an import inside a function, one under `if TYPE_CHECKING:`, a relative import
    and a package's non-empty `__init__.py` are each found; an empty `__init__.py` closes none."""
    write_tree(tmp_path, {
        "platform/a.py": "def f():\n    from loraplex.platform import b\n",
        "platform/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loraplex.platform.a import f\n",
        "kernels/pkg/__init__.py": "from .inner import g\n",
        "kernels/pkg/inner.py": "import loraplex.kernels.pkg.other\ndef g(): ...\n",
        "kernels/pkg/other.py": "",
        "grammar/empty/__init__.py": '"""Only a docstring."""\n',
        "grammar/empty/leaf.py": "from loraplex.grammar.empty import sibling\n",
        "grammar/empty/sibling.py": "import loraplex.grammar.empty.leaf\n",
    })
    graph = import_graph(tmp_path)
    assert graph["loraplex.platform.a"] == {"loraplex.platform.b"}
    assert graph["loraplex.platform.b"] == {"loraplex.platform.a"}
    assert graph["loraplex.kernels.pkg"] == {"loraplex.kernels.pkg.inner"}
    # importing a submodule runs its package's __init__, which imports this module back
    assert graph["loraplex.kernels.pkg.inner"] == {"loraplex.kernels.pkg", "loraplex.kernels.pkg.other"}
    assert "loraplex.grammar.empty" not in graph["loraplex.grammar.empty.leaf"]
    assert sorted(cycles(graph)) == [
        "loraplex.grammar.empty.leaf -> loraplex.grammar.empty.sibling -> loraplex.grammar.empty.leaf",
        "loraplex.kernels.pkg -> loraplex.kernels.pkg.inner -> loraplex.kernels.pkg",
        "loraplex.platform.a -> loraplex.platform.b -> loraplex.platform.a",
    ]


def test_tarjan_finds_cycles_and_names_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}, "f": {"a"}}
    components = sorted(c for c in strongly_connected_components(graph) if len(c) > 1)
    assert components == [["a", "b", "c"], ["e", "e2"]]
    assert sorted(cycles(graph)) == ["a -> b -> c -> a", "e -> e2 -> e"]
    assert cycles({"x": {"x2"}, "x2": {"x"}}) == ["x -> x2 -> x"]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(found)
