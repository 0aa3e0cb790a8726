"""The import graph points one way: a lower folder of ``fastdeploy`` never imports a higher one.

Layers, from the top (``docs/architecture.md`` in the shared docs): entrypoints -> engine ->
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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, 'fastdeploy.x.y')`` for every import of the package in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
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
