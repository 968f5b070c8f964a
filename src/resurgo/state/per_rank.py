"""Values that differ between ranks (RNG states, rank-local counters): saved once per rank.

Wrap such a value in :class:`PerRank` to have every rank's copy kept; plain values that differ
between ranks are detected and kept per rank anyway (see docs/distributed.md). On load by the same
number of ranks, each rank gets its own value back. With another number of ranks, ``on_resize``
decides: it receives every saved rank's value, the new rank and the new world size and returns
this rank's value; without it the load raises WorldSizeMismatchError (nothing silently reused or
dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ResizePolicy = Callable[[list[Any], int, int], Any]


class PerRank:
    """``value`` is this rank's own; after a load, ``saved`` holds every saved rank's value when
    the load had to build them all (another world size, or ``load_dict``)."""

    def __init__(self, value: Any, on_resize: ResizePolicy | None = None):
        self.value = value
        self.on_resize = on_resize
        self.saved: list[Any] | None = None

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"
