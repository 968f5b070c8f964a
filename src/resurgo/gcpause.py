"""Pausing Python's cyclic garbage collector while we build many long-lived objects at once.

Parsing a large manifest or planning for thousands of ranks creates an object per value or
chunk and keeps them all; with the collector on, every full collection rescans each of them (and
every live object of the training process), so the work grows quadratically.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
