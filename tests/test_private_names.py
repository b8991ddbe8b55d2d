"""Nothing private crosses a module boundary: a name with a leading underscore that infinikv defines is used
only in the module that defines it (not imported, not read as ``obj._name`` elsewhere, not reached through
``self._name`` from a subclass in another module). Tests reach the code through its public names too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "infinikv").rglob("*.py"))
TESTS = sorted((ROOT / "tests").glob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, module or class variables, and attributes it
    assigns (``self._x = ...``, or a marker it sets on another object)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            names.add(node.attr)
    return names


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _crossings(sources: list[Path], tests: list[Path]) -> list[str]:
    """Every use of a private name of ``sources`` outside the module that defines it."""
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sources + tests}
    defined = {path: _defined(tree) for path, tree in trees.items()}
    owners: dict[str, set[Path]] = defaultdict(set)
    for path in sources:
        for name in defined[path]:
            owners[name].add(path)
    found = []
    for path, tree in trees.items():
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if _private(alias.name) and alias.name in owners and path not in owners[alias.name]:
                        found.append(f"{where}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.Attribute) and node.attr in owners and path not in owners[node.attr]:
                reach = "reaches an inherited" if _is_self(node.value) else "reads"
                found.append(f"{where}:{node.lineno} {reach} {ast.unparse(node)}")
    return found


def test_no_private_name_is_used_outside_its_module():
    assert _crossings(SOURCES, TESTS) == []


def test_the_check_finds_a_reach_in(tmp_path):
    """The check itself can fail: a test module reading a policy's private attribute is reported."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_x(policy):\n    return policy._selector_s\n", encoding="utf-8")
    assert any("policy._selector_s" in line for line in _crossings(SOURCES, [probe]))
