"""The manager package stays split along its seams: every module says in its docstring what it
owns, no function is longer than can be read at once, and the orchestrating class holds no
module-sized concern again.

Each source file of src/resurgo/manager is read with ``ast``; a failure names the module, the
function and its length.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MANAGER = Path(__file__).resolve().parents[1] / "src" / "resurgo" / "manager"
MODULES = sorted(MANAGER.glob("*.py"))
MAX_FUNCTION_LINES = 80
MAX_ORCHESTRATION_LINES = 500  # manager.py: the CheckpointManager class and its docstring


def functions(tree: ast.AST) -> list[tuple[str, int]]:
    """(qualified name, length in lines) of every function and method in ``tree``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                found.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_the_split_modules_are_there():
    names = {p.stem for p in MODULES}
    assert {"manager", "config", "saving", "chain", "restore", "prune", "tier_copy", "janitor",
            "preemption"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_every_module_says_what_it_owns_and_has_no_long_function(path):
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 5, f"{path.name}: no module docstring saying what it owns"
    long = [(name, n) for name, n in functions(tree) if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_orchestration_stays_thin():
    lines = (MANAGER / "manager.py").read_text().count("\n")
    assert lines <= MAX_ORCHESTRATION_LINES, (
        f"manager/manager.py has {lines} lines (at most {MAX_ORCHESTRATION_LINES}): give the new concern a module")


def test_functions_counts_methods_and_nested_functions():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert functions(tree) == [("A.f", 4), ("A.f.g", 2)]
