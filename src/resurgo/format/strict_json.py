"""JSON of untrusted bytes (manifests, rank indexes, safetensors headers) with every object's keys
unique: Python's parser keeps the last of duplicate keys, other readers may keep the first, and two
readers of one file must never see two documents."""

from __future__ import annotations

import json
from typing import Any


class DuplicateKeyError(ValueError):
    """An object of the document has a key twice (``key``: the first such key)."""

    def __init__(self, key: str):
        super().__init__(f"the key {key[:200]!r} appears twice in one object")
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(k)
            seen.add(k)
    return out


def loads(raw: bytes | str) -> Any:
    """``json.loads`` refusing duplicate keys (DuplicateKeyError, a ValueError)."""
    return json.loads(raw, object_pairs_hook=_unique)
