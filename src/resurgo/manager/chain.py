"""The incremental chain of a manager: which checkpoint the next save references (its base), and
how many incremental saves came since the last full one, which the full-save policy weighs.

The base is the checkpoint this manager last committed or restored in its first tier. Each save
records ``saves_since_full`` in its save_info, so that a restarted job continues the count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from resurgo.errors import ResurgoError, UnsupportedValueError
from resurgo.manager.full_policy import FullEvery, FullSavePolicy, IncrementalContext
from resurgo.pipeline.save import read_base_manifest

log = logging.getLogger("resurgo.manager")


def full_save_policy(incremental: bool | FullSavePolicy, memory_tier: bool) -> FullSavePolicy | None:
    """The full-save policy of ``CheckpointManager(incremental=...)``: None for full saves only."""
    if not (isinstance(incremental, bool) or isinstance(incremental, FullSavePolicy)):
        raise TypeError(f"incremental must be True, False or a full-save policy (full(ctx) -> bool), "
                        f"not {incremental!r}")
    policy = FullEvery() if incremental is True else incremental or None
    if policy is not None and memory_tier:
        raise UnsupportedValueError("incremental saves do not go to a MemoryTier (each node holds its own "
                                    "directory, which a later save cannot reference); pass incremental=False")
    return policy


class IncrementalChain:
    """The base of the next save and the count of incremental saves since the last full one.
    Without a full-save policy every save is full, but the base is still tracked: retention keeps
    it while a save may be reading it."""

    def __init__(self, full_policy: FullSavePolicy | None) -> None:
        self.full_policy = full_policy
        self._base_step: int | None = None  # the checkpoint the next incremental save references
        self._since_full = 0  # incremental saves since the base's last full save
        self._pending_chain = 0  # the next value of _since_full, once the pending save commits

    @property
    def base_step(self) -> int | None:
        return self._base_step

    @property
    def incremental(self) -> bool:
        return self.full_policy is not None

    def choose_base(self, step: int, path_for: Callable[[int], Path | str], storage_options: dict | None,
                    unreadable: Collection[int]) -> Path | str | None:
        """The base of an incremental save of ``step``: the checkpoint this manager last committed
        or restored in its first tier, unless the full-save policy asks for a full save."""
        base = self._base_step
        if self.full_policy is None or base is None or base == step or base in unreadable:
            return None
        path = path_for(base)
        try:
            manifest = read_base_manifest(path, storage_options)
        except ResurgoError as e:  # gone or damaged since: a full save does not need it
            log.warning("not using step %d as a base (%s): saving step %d in full", base, e, step)
            return None
        ctx = IncrementalContext(self._since_full, manifest.tensor_bytes, sum(manifest.referenced_bytes.values()))
        return None if self.full_policy.full(ctx) else path

    def begin(self, base: Path | str | None) -> dict[str, Any] | None:
        """A save with ``base`` (None: in full) starts: what its save_info records of the chain
        (None without a full-save policy)."""
        if self.full_policy is None:
            return None
        self._pending_chain = 0 if base is None else self._since_full + 1
        return {"saves_since_full": self._pending_chain}

    def committed(self, step: int) -> None:
        """The save begun last is committed as ``step``: the base of the next."""
        self._base_step, self._since_full = step, self._pending_chain

    def restored(self, step: int, save_info: dict[str, Any]) -> None:
        """``step`` was restored from the first tier: the base of the next save, its count read
        from what its save recorded."""
        chain = save_info.get("incremental", {})
        since = chain.get("saves_since_full") if isinstance(chain, dict) else None
        self._base_step = step
        self._since_full = since if type(since) is int and since >= 0 else 0
