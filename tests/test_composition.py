"""Parts are owned, not mixed in (issue #44): no ``*Mixin`` class in ``fastdeploy``, the engine
never probes its PD role with ``hasattr``/``getattr``, and both roles implement the whole
:class:`~fastdeploy.splitwise.pd_role.PDRole` protocol."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from fastdeploy.splitwise.pd_role import PDRole
from fastdeploy.splitwise.roles import DecodeRole, PrefillRole

PACKAGE = Path(__file__).resolve().parents[1] / "fastdeploy"
#: What a PD role is called where the engine holds one.
ROLE_NAME = re.compile(r"\b(pd|role)\b")


def trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def test_no_mixin_class():
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
        for path, tree in trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name.endswith("Mixin")
    ]
    assert found == []


def test_no_hasattr_or_getattr_on_a_pd_role():
    found = []
    for path, tree in trees():
        for node in ast.walk(tree):
            probe = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr")
                and node.args
            )
            if probe and ROLE_NAME.search(ast.unparse(node.args[0])):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert found == []


def protocol_members() -> list[str]:
    own = {
        name
        for name, value in vars(PDRole).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    return sorted(own | {"trust"})


@pytest.mark.parametrize("role", [PrefillRole, DecodeRole])
def test_both_roles_implement_the_whole_protocol(role):
    missing = [name for name in protocol_members() if not hasattr(role, name)]
    assert missing == []
    for name in protocol_members():
        ours = vars(PDRole).get(name)
        if callable(ours):  # a method: the protocol's parameters, in its order
            theirs = inspect.getattr_static(role, name)
            assert list(inspect.signature(theirs).parameters) == list(
                inspect.signature(ours).parameters
            ), (role.__name__, name)
