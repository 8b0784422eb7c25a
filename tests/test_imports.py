"""The package's import graph, read from the source (no import runs): the layout the
architecture says (docs/architecture.md), held.

An edge is an import a module runs, at the top or inside a function; ``typed=True`` adds those
under ``if TYPE_CHECKING:``. ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module, else to ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "steerserve"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def graph(typed: bool = False) -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        todo: list[ast.AST] = [ast.parse(path.read_text())]
        while todo:
            node = todo.pop()
            if not typed and _type_checking(node):
                todo.extend(node.orelse)  # type: ignore[attr-defined]
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                    for a in node.names
                ]
            for n in names:
                if n.startswith("steerserve") and (o := owner(n)) and o != mod:
                    edges[mod].add(o)
            todo.extend(ast.iter_child_nodes(node))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_reader_sees_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    """None at run time, and none through the type checker's imports either (a circle that
    only types close is still two modules that cannot be read one before the other)."""
    edges = graph(typed=True)
    assert len(edges) > 100 and sum(map(len, edges.values())) > 300  # it read the package
    assert cycles(edges) == []


#: The layers, lowest first: a module imports its own layer's and lower ones only. The engine
#: runs inside vLLM and knows nothing of the rest; artifacts and models describe what it runs;
#: the server and tune (making vectors) use those (and never each other); the CLI sits on top.
LAYERS = {"engine": 0, "artifacts": 1, "models": 1, "server": 2, "tune": 2, "cli": 3}


def _layer(module: str) -> tuple[str, int]:
    part = module.split(".")[1] if "." in module else ""
    part = "cli" if part == "__main__" else part
    return part, LAYERS.get(part, -1)  # the package root (its version): below everything


def test_no_import_runs_up_or_across() -> None:
    bad = []
    for mod, targets in graph(typed=True).items():
        (here, mine) = _layer(mod)
        for t in targets:
            (there, theirs) = _layer(t)
            if theirs > mine or (theirs == mine and here != there and mine > 0):
                bad.append(f"{mod} -> {t}")
    assert bad == []


def test_no_loose_modules_at_the_top() -> None:
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py"]
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} <= {
        *LAYERS,
        "vectors",  # the shipped vectors, copied in by setup.py when a wheel is built
    }


def _child(pkg: str, module: str) -> str | None:
    """The child of ``pkg`` (a module or subpackage) that ``module`` is or is inside of."""
    if not module.startswith(f"{pkg}."):
        return None
    return f"{pkg}.{module[len(pkg) + 1 :].split('.')[0]}"


def test_no_import_runs_up_inside_a_package() -> None:
    """Inside every package too: its modules and subpackages, each taken whole, import one
    another without a circle (a subpackage's module that imports the module above that uses it,
    as generate/ once typed ``state``, closes one)."""
    edges = graph(typed=True)
    packages = {m for m in edges if any(x.startswith(f"{m}.") for x in edges)}
    assert {"steerserve.server", "steerserve.server.ab"} <= packages
    for pkg in packages:
        inner: dict[str, set[str]] = {}
        for mod, targets in edges.items():
            if (a := _child(pkg, mod)) is not None:
                inner.setdefault(a, set()).update({_child(pkg, t) for t in targets} - {None, a})
        assert cycles(inner) == [], pkg


#: Where the product starts: the console script, ``python -m steerserve``, the vLLM plugin entry
#: point; modules loaded by name (vLLM imports the worker extension from a string), and the tools
#: run as ``python -m`` or from bench/ (the facts builder, the tiny models).
ROOTS = {
    "steerserve.cli": "[project.scripts]",
    "steerserve.__main__": "python -m steerserve",
    "steerserve.engine.plugin": "vllm.general_plugins",
    "steerserve.engine.worker": "engine.api.WORKER_EXTENSION",
    "steerserve.tune.facts.build": "python -m steerserve.tune.facts.build",
    "steerserve.models.tiny": "bench/ and the tests build tiny models",
}


def test_every_module_is_reached_from_where_the_product_starts() -> None:
    """No module only its own tests reach: each is imported, at last, from a root above."""
    from steerserve.engine.api import WORKER_EXTENSION

    assert WORKER_EXTENSION.rsplit(".", 1)[0] in ROOTS
    edges = graph(typed=True)  # a protocol is reached by the types that name it
    seen, todo = set(), [*ROOTS, "steerserve"]
    while todo:
        if (m := todo.pop()) not in seen:
            seen.add(m)
            todo.extend(edges[m])
            todo.extend(m.rsplit(".", i)[0] for i in range(1, m.count(".")))  # its packages
    assert sorted(set(edges) - seen) == []
