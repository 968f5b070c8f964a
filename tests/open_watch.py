"""Watching every file the library opens, for the fuzz tests: an audit hook (installed once per
process: audit hooks cannot be removed) records each file opened while a :func:`opened_outside`
block runs that lies outside the roots it names. Python's, torch's and resurgo's own folders are
not counted, nor a lazy import of any module."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import resurgo

__all__ = ["opened_outside"]

_WATCH: dict[str, Any] = {"roots": None, "outside": []}
_HOOKED = False
_ALLOWED_PREFIXES = tuple(
    os.path.realpath(p) + os.sep
    for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, "/proc", "/sys", "/dev",
              str(Path(resurgo.__file__).resolve().parent), str(Path(torch.__file__).resolve().parent)})


def _audit(event: str, args: tuple) -> None:
    roots = _WATCH["roots"]
    if roots is None or event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.realpath(os.fsdecode(args[0]))
    # a root itself counts as inside: a directory is opened to list it
    if any(path == r or path.startswith(r + os.sep) for r in roots) or path.startswith(_ALLOWED_PREFIXES):
        return
    if path.endswith((".py", ".pyc", ".so")):  # a lazy import
        return
    _WATCH["outside"].append(path)


@contextmanager
def opened_outside(*roots: str | os.PathLike) -> Iterator[list[str]]:
    """The list (filled as the block runs) of the files opened inside the block outside ``roots``."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    outside: list[str] = []
    _WATCH["roots"], _WATCH["outside"] = tuple(os.path.realpath(r) for r in roots), outside
    try:
        yield outside
    finally:
        _WATCH["roots"] = None
