"""Every function of src/resurgo reads in one sitting: at most MAX_LINES lines, from its ``def`` to
its last line (docstring and nested functions included, decorators not).

Each file is read with ``ast``. A function over the limit fails the test, named by file and
qualified name with its length, unless it is in ALLOWED: the functions not split yet. An entry of
ALLOWED that names no function over the limit fails too, so that the list only shrinks: remove
the entry once its function is split.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "resurgo"
MAX_LINES = 80

# "path/in/resurgo.py::Qualified.name": functions over MAX_LINES, not split yet.
ALLOWED = {
    "pipeline/load.py::_load_into",
}


def function_lengths(source: str) -> dict[str, int]:
    """The length in lines of every function and method in ``source``, by qualified name
    (``Class.method``, ``outer.inner``)."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return lengths


@functools.cache
def long_functions() -> dict[str, int]:
    """Every function over MAX_LINES in src/resurgo, by file and qualified name, with its length."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for name, n in function_lengths(path.read_text(encoding="utf-8")).items():
            if n > MAX_LINES:
                found[f"{rel}::{name}"] = n
    return found


def test_the_measure_counts_def_to_last_line():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    source = (f"import functools\n\n\n@functools.cache\ndef long():\n{body}\n\n\n"
              f"class C:\n    def method(self):\n        def inner():\n            pass\n        return inner\n")
    assert function_lengths(source) == {"long": MAX_LINES, "C.method": 4, "C.method.inner": 2}
    assert function_lengths(source.replace("def long():\n", "def long():\n    y = 0\n"))["long"] == MAX_LINES + 1


def test_no_function_is_longer_than_the_limit():
    found = long_functions()
    over = {k: n for k, n in found.items() if k not in ALLOWED}
    assert not over, (f"functions over {MAX_LINES} lines (split them into named steps): "
                      + ", ".join(f"{k} ({n} lines)" for k, n in sorted(over.items())))


def test_every_allowed_function_is_still_over_the_limit():
    stale = sorted(ALLOWED - set(long_functions()))
    assert not stale, (f"ALLOWED names functions that are now at most {MAX_LINES} lines, or gone: {stale}; "
                       "remove them from ALLOWED in tests/test_code_shape.py")
