"""The import graph points one way: a lower folder of ``fastdeploy`` never imports a higher one.

Layers, from the top (``docs/architecture.md`` in the shared docs): entrypoints, integrations
(launchers behind another serving layer) -> engine ->
scheduler, worker -> model_executor, cache_manager -> distributed -> core, config, envs,
platforms. Every
``import`` and ``from ... import`` in a module counts, lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fastdeploy"

#: Rank of each top-level part of the package; a module may import only equal or lower ranks.
RANKS = {
    "core": 0,
    "config": 0,
    "envs": 0,
    "platforms": 0,
    "distributed": 1,
    "model_executor": 2,
    "cache_manager": 2,
    "scheduler": 3,
    "worker": 3,
    "splitwise": 3,
    "metrics": 4,
    "engine": 4,
    "entrypoints": 5,
    "router": 5,
    # Launchers behind another serving layer (a Dynamo worker): start-up, like entrypoints.
    "integrations": 5,
}
#: Modules ranked apart from their folder. ``config.resolve`` resolves a whole deployment (the
#: model's config, the attention backends, the graph policy, flashinfer's comm module): it ranks
#: with the engine, so only the engine and the entry points may import it.
MODULE_RANKS = {"config.resolve": RANKS["engine"]}


def rank_of(module: str) -> int:
    """The rank of ``module`` (dotted, without ``fastdeploy.``): its own, else its folder's."""
    for name, rank in MODULE_RANKS.items():
        if module == name or module.startswith(name + "."):
            return rank
    return RANKS[module.split(".")[0]]


#: Extra rules stricter than the ranks: (importer prefix, forbidden prefixes).
FORBIDDEN = [
    ("model_executor.graph_optimization", ("worker", "scheduler", "engine", "entrypoints")),
    ("cache_manager", ("engine", "entrypoints", "scheduler", "worker")),
    ("scheduler", ("engine", "entrypoints", "worker")),
    ("worker", ("engine", "entrypoints", "scheduler")),
    ("model_executor", ("engine", "entrypoints", "scheduler", "worker")),
    ("core", tuple(k for k in RANKS if k not in ("core", "config"))),
]


#: The server's side of the process line: what runs in an API server process. It may import
#: from below only what both sides share (:data:`SERVER_MAY_IMPORT`); start-up
#: (``entrypoints.launch``, ``entrypoints.server_args``, ``entrypoints.llm``, the CLI) may import
#: anything, and only :data:`ENGINE_LAUNCHERS` of the server's side may import the engine's entry
#: points (the process's main, the loop a thread runs).
SERVER_SIDE = ("entrypoints.openai", "entrypoints.engine_client")
SERVER_MAY_IMPORT = ("core", "config", "envs", "platforms", "metrics", "entrypoints")
#: ``config.resolve`` resolves the deployment (model loader, graph policy): start-up's, not the
#: server's.
SERVER_MAY_NOT_IMPORT = ("config.resolve",)
ENGINE_LAUNCHERS = (
    "entrypoints.engine_client.process_client",
    "entrypoints.engine_client.thread_core",
)
#: The calls that send a message across the process line; their first argument is never a string.
MESSAGE_CALLS = ("emit", "_emit", "send", "put", "put_nowait")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def type_checking_lines(tree: ast.AST) -> set[int]:
    """The lines inside ``if TYPE_CHECKING:`` blocks (imports there never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def imported_modules(path: Path, runtime_only: bool = False) -> list[tuple[int, str]]:
    """``(line, 'fastdeploy.x.y')`` for every import of the package in ``path``
    (``runtime_only``: not those under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = type_checking_lines(tree) if runtime_only else set()
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from fastdeploy import envs`: the imported names are modules too.
            if node.module == "fastdeploy":
                found += [(node.lineno, f"fastdeploy.{a.name}") for a in node.names]
    return [(line, name) for line, name in found if name.startswith("fastdeploy.")]


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        if not here:  # fastdeploy/__init__.py: the public face, imports lazily from the top
            continue
        top = here.split(".")[0]
        for line, name in imported_modules(path):
            target = name.removeprefix("fastdeploy.")
            target_top = target.split(".")[0]
            if target_top not in RANKS or top not in RANKS:
                bad.append(f"{path.name}:{line}: unranked part {target_top!r} or {top!r}")
                continue
            if rank_of(target) > rank_of(here):
                bad.append(f"fastdeploy.{here}:{line} imports {name} (a higher layer)")
            for prefix, forbidden in FORBIDDEN:
                if here == prefix or here.startswith(prefix + "."):
                    if any(target == f or target.startswith(f + ".") for f in forbidden):
                        bad.append(f"fastdeploy.{here}:{line} imports {name} (forbidden)")
    return bad


def test_no_module_imports_a_higher_layer():
    assert violations() == []


def test_every_top_level_part_is_ranked():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    parts = {p for p in parts if not p.startswith("__")}
    assert parts <= set(RANKS), parts - set(RANKS)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from fastdeploy.engine.engine import LLMEngine\n", "fastdeploy.engine.engine"),
        ("def f():\n    import fastdeploy.worker.gpu_worker\n", "fastdeploy.worker.gpu_worker"),
        ("from fastdeploy import envs\n", "fastdeploy.envs"),
    ],
)
def test_the_walk_sees_lazy_and_package_imports(tmp_path, source, expected):
    """The checker itself can fail: it finds imports at module level and inside functions."""
    path = tmp_path / "m.py"
    path.write_text(source)
    assert expected in [name for _, name in imported_modules(path)]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports when it runs (lazy imports included, type-only
    imports under ``if TYPE_CHECKING:`` not), by dotted name below ``fastdeploy``; an import of
    a name inside a module counts as an import of that module."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name:
            modules[name] = path
    graph = {}
    for name, path in modules.items():
        edges = set()
        for _, imported in imported_modules(path, runtime_only=True):
            target = imported.removeprefix("fastdeploy.")
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle():
    assert import_circles(import_graph()) == []


def test_the_circle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_type_only_imports_make_no_circle(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fastdeploy.a\n"
        "def f():\n    import fastdeploy.b\n"
    )
    assert [n for _, n in imported_modules(path, runtime_only=True)] == ["fastdeploy.b"]
    assert len(imported_modules(path)) == 2


def server_side_violations() -> list[str]:
    """Imports from the server's side of the process line of anything below it but the parts
    the server may use (:data:`SERVER_MAY_IMPORT`); only :data:`ENGINE_LAUNCHERS` may import the
    engine."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_name(path)
        if not any(here == s or here.startswith(s + ".") for s in SERVER_SIDE):
            continue
        for line, name in imported_modules(path):
            target = name.removeprefix("fastdeploy.")
            top = target.split(".")[0]
            banned = any(target == b or target.startswith(b + ".") for b in SERVER_MAY_NOT_IMPORT)
            if top in SERVER_MAY_IMPORT and not banned:
                continue
            if top == "engine" and here in ENGINE_LAUNCHERS:
                continue
            bad.append(f"fastdeploy.{here}:{line} imports {name} (across the process line)")
    return bad


def test_the_server_side_imports_only_core_and_config_from_below():
    assert server_side_violations() == []


def mixin_violations(paths) -> list[str]:
    """Classes named ``*Mixin``, and classes built from two or more of the package's own classes."""
    trees = [(path, ast.parse(path.read_text(), filename=str(path))) for path in paths]
    own = {n.name for _, tree in trees for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    bad = []
    for path, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            if node.name.endswith("Mixin") or sum(b in own for b in bases) >= 2:
                bad.append(f"{path.name}:{node.lineno}: class {node.name}({', '.join(bases)})")
    return bad


def test_no_mixin_classes():
    assert mixin_violations(sorted(PACKAGE.rglob("*.py"))) == []


def string_dispatch_violations(paths) -> list[str]:
    """Messages named by a string across the process line (``emit("step", ...)``), and probes of
    a PD role's attributes by name (``hasattr(self.pd, ...)``)."""
    bad = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = ast.unparse(node.func).rpartition(".")[2]
            first = node.args[0]
            if (
                func in MESSAGE_CALLS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                bad.append(f"{path.name}:{node.lineno}: {func}({first.value!r}, ...)")
            if func in ("hasattr", "getattr") and "pd" in ast.unparse(first).split("."):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_string_message_kinds_and_no_probing_of_pd_roles():
    assert string_dispatch_violations(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_checkers_can_fail(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "class AMixin: pass\nclass B: pass\nclass C(AMixin, B): pass\n"
        "def f(self):\n    self.emit('step', 1)\n    hasattr(self.pd, 'x')\n"
    )
    assert len(mixin_violations([path])) == 2
    assert len(string_dispatch_violations([path])) == 2
