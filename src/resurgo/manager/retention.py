"""Which checkpoints to keep: preservation policies as pure functions over (step, metrics).

A retention policy is any object with ``keep(checkpoints) -> set[int]`` (the steps it wants
kept). ``KeepAny`` keeps what any of its policies keeps. :func:`steps_to_delete` adds the rules no
policy can override: the newest checkpoint and any protected step (the one just committed) are
always kept. No I/O here; :mod:`resurgo.manager.removal` deletes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Kept:
    """One committed checkpoint as retention sees it."""

    step: int
    metrics: Mapping[str, float | None] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, checkpoints: Sequence[Kept]) -> set[int]: ...


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")
    return value


@dataclass(frozen=True)
class KeepLast:
    """The ``n`` newest checkpoints (by step)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("KeepLast.n", self.n)

    def keep(self, checkpoints: Sequence[Kept]) -> set[int]:
        return set(sorted(c.step for c in checkpoints)[-self.n:])


@dataclass(frozen=True)
class KeepEvery:
    """Every checkpoint whose step is a multiple of ``n`` (a permanent thinned history)."""

    n: int

    def __post_init__(self) -> None:
        _positive_int("KeepEvery.n", self.n)

    def keep(self, checkpoints: Sequence[Kept]) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.n == 0}


@dataclass(frozen=True)
class KeepBest:
    """The ``k`` checkpoints with the best value of ``metric`` ("min" or "max" is best).

    A checkpoint without a finite value of the metric is not a candidate (another policy, or the
    newest-is-kept rule, may still keep it). Of equal values the newer step wins.
    """

    metric: str
    mode: str
    k: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest.metric must be a metric name, not {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', not {self.mode!r}")
        _positive_int("KeepBest.k", self.k)

    def keep(self, checkpoints: Sequence[Kept]) -> set[int]:
        scored = []
        for c in checkpoints:
            v = c.metrics.get(self.metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                scored.append((v if self.mode == "min" else -v, -c.step))
        return {-neg_step for _, neg_step in sorted(scored)[: self.k]}


@dataclass(frozen=True)
class KeepAny:
    """What any of ``policies`` keeps."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy):
        for p in policies:
            if not isinstance(p, RetentionPolicy):
                raise TypeError(f"KeepAny: {p!r} is not a retention policy (it needs keep(checkpoints) -> set)")
        if not policies:
            raise ValueError("KeepAny needs at least one policy")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, checkpoints: Sequence[Kept]) -> set[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(checkpoints)
        return kept


def steps_to_delete(checkpoints: Sequence[Kept], policy: RetentionPolicy | None,
                    protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete, oldest first: those ``policy`` does not keep, never the newest
    checkpoint nor a step in ``protect``. ``policy=None`` keeps everything."""
    if policy is None or not checkpoints:
        return []
    kept = policy.keep(checkpoints) | {max(c.step for c in checkpoints)} | set(protect)
    return sorted(c.step for c in checkpoints if c.step not in kept)


def shortcut_policy(keep_last: int | None = None, keep_every: int | None = None,
                    keep_best: tuple | None = None) -> RetentionPolicy | None:
    """The policy the manager's and ``resurgo gc``'s keyword shortcuts stand for (None: keep all)."""
    parts: list[RetentionPolicy] = []
    if keep_last is not None:
        parts.append(KeepLast(keep_last))
    if keep_every is not None:
        parts.append(KeepEvery(keep_every))
    if keep_best is not None:
        if not isinstance(keep_best, tuple) or len(keep_best) not in (2, 3):
            raise ValueError(f"keep_best must be (metric, 'min'|'max') or (metric, 'min'|'max', k), not {keep_best!r}")
        parts.append(KeepBest(*keep_best))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else KeepAny(*parts)
