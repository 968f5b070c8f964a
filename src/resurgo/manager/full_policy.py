"""When an incremental manager makes a full save: small policies in the style of the save policies.

A manager with ``incremental=True`` saves each checkpoint with the previous one as its base
(unchanged bytes are referenced, not written). A *full* save (no base) bounds how long old
checkpoints stay on disk because later ones reference them (docs/format.md, section 3.4), and
how many files a load opens. The manager asks its policy before each save, with what it knows
in an :class:`IncrementalContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from resurgo.manager.checks import positive_int


@dataclass(frozen=True)
class IncrementalContext:
    """What the manager knows of the base before an incremental save."""

    saves_since_full: int  # incremental saves since the last full one (0: the base is full)
    base_tensor_bytes: int  # the base's tensor bytes
    base_referenced_bytes: int  # of those, the bytes held by data files of earlier checkpoints


@runtime_checkable
class FullSavePolicy(Protocol):
    def full(self, ctx: IncrementalContext) -> bool: ...


@dataclass(frozen=True)
class FullEvery:
    """A full save every ``saves`` saves (the others reference their base), and also when more
    than ``referenced_share`` of the base's tensor bytes lie in earlier checkpoints' files
    (None: no such rule)."""

    saves: int = 10
    referenced_share: float | None = None

    def __post_init__(self) -> None:
        positive_int("FullEvery.saves", self.saves)
        if self.referenced_share is not None and not 0.0 <= self.referenced_share <= 1.0:
            raise ValueError(f"FullEvery.referenced_share must be in [0, 1] or None, not {self.referenced_share!r}")

    def full(self, ctx: IncrementalContext) -> bool:
        if ctx.saves_since_full + 1 >= self.saves:
            return True
        return (self.referenced_share is not None and ctx.base_tensor_bytes > 0
                and ctx.base_referenced_bytes > self.referenced_share * ctx.base_tensor_bytes)
