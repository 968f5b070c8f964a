"""Which checkpoints to keep: preservation policies as pure functions over (step, metrics).

A retention policy is any object with ``keep(checkpoints) -> set[int]`` (the steps it wants
kept). ``KeepAny`` keeps what any of its policies keeps. :func:`steps_to_delete` adds the rules no
policy can override: the newest checkpoint and any protected step (the one just committed) are
always kept. No I/O here; :func:`resurgo.manager.catalog.remove` deletes.

Each built-in policy has a plain-data form (``to_spec()``, :func:`policy_from_spec`): the manager
records its policy in every checkpoint's ``save_info``, so that ``resurgo gc`` applies the same
rules. A policy of another class is recorded as ``{"type": "custom", "class": ...}``, which gc
cannot apply.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from resurgo.errors import UnsupportedValueError
from resurgo.manager.checks import positive_int


@dataclass(frozen=True)
class Kept:
    """One committed checkpoint as retention sees it."""

    step: int
    metrics: Mapping[str, float | None] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, checkpoints: Sequence[Kept]) -> set[int]: ...


@dataclass(frozen=True)
class _CountPolicy:
    """A policy of one positive whole number ``n``: its spec is ``{"type": KIND, "n": n}``, its
    name ``KIND n``."""

    n: int
    KIND: ClassVar[str]

    def __post_init__(self) -> None:
        positive_int(f"{type(self).__name__}.n", self.n)

    def to_spec(self) -> dict[str, Any]:
        return {"type": self.KIND, "n": self.n}

    def __str__(self) -> str:
        return f"{self.KIND} {self.n}"


@dataclass(frozen=True)
class KeepLast(_CountPolicy):
    """The ``n`` newest checkpoints (by step)."""

    KIND = "keep_last"

    def keep(self, checkpoints: Sequence[Kept]) -> set[int]:
        return set(sorted(c.step for c in checkpoints)[-self.n:])


@dataclass(frozen=True)
class KeepEvery(_CountPolicy):
    """Every checkpoint whose step is a multiple of ``n`` (a permanent thinned history)."""

    KIND = "keep_every"

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
        positive_int("KeepBest.k", self.k)

    def keep(self, checkpoints: Sequence[Kept]) -> set[int]:
        scored = []
        for c in checkpoints:
            v = c.metrics.get(self.metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                scored.append((v if self.mode == "min" else -v, -c.step))
        return {-neg_step for _, neg_step in sorted(scored)[: self.k]}

    def to_spec(self) -> dict[str, Any]:
        return {"type": "keep_best", "metric": self.metric, "mode": self.mode, "k": self.k}

    def __str__(self) -> str:
        return f"keep_best {self.metric}:{self.mode}" + (f":{self.k}" if self.k != 1 else "")


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

    def to_spec(self) -> dict[str, Any]:
        return {"type": "keep_any", "policies": [policy_spec(p) for p in self.policies]}

    def __str__(self) -> str:
        return " or ".join(describe(p) for p in self.policies)


CUSTOM = "custom"  # the spec type of a policy that has no plain-data form


def policy_spec(policy: RetentionPolicy | None) -> dict[str, Any] | None:
    """``policy`` as plain JSON data (None: keep everything); see :func:`policy_from_spec`."""
    if policy is None:
        return None
    to_spec = getattr(policy, "to_spec", None)
    if callable(to_spec):
        return to_spec()
    return {"type": CUSTOM, "class": f"{type(policy).__module__}.{type(policy).__qualname__}"}


def describe(policy: RetentionPolicy) -> str:
    """A short name of ``policy`` for messages: ``keep_last 3``, ``keep_best loss:min``."""
    if getattr(policy, "to_spec", None) is None:
        return f"custom {type(policy).__qualname__}"
    return str(policy)


def policy_from_spec(spec: Any, where: str = "retention") -> RetentionPolicy | None:
    """The policy a :func:`policy_spec` stands for (None: keep everything). A custom policy, an
    unknown type or invalid fields raise :class:`UnsupportedValueError` naming ``where``."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise UnsupportedValueError(f"{where}: expected a retention spec {{'type': ...}}, got {spec!r}")
    kind = spec["type"]
    fields = {k: v for k, v in spec.items() if k != "type"}
    try:
        if kind == "keep_last" and set(fields) == {"n"}:
            return KeepLast(fields["n"])
        if kind == "keep_every" and set(fields) == {"n"}:
            return KeepEvery(fields["n"])
        if kind == "keep_best" and set(fields) == {"metric", "mode", "k"}:
            return KeepBest(fields["metric"], fields["mode"], fields["k"])
        if kind == "keep_any" and set(fields) == {"policies"} and isinstance(fields["policies"], list):
            parts = [policy_from_spec(p, f"{where}.policies[{i}]") for i, p in enumerate(fields["policies"])]
            return KeepAny(*[p for p in parts if p is not None])
    except (TypeError, ValueError) as e:
        raise UnsupportedValueError(f"{where}: {e}") from None
    if kind == CUSTOM:
        raise UnsupportedValueError(f"{where}: a custom retention policy ({spec.get('class')}) cannot be rebuilt "
                                    "from its record; give the rules explicitly")
    raise UnsupportedValueError(f"{where}: unknown retention spec {spec!r} (known types: keep_last, keep_every, "
                                "keep_best, keep_any)")


def policy_parts(policy: RetentionPolicy | None) -> list[RetentionPolicy]:
    """The policies ``policy`` is made of (a KeepAny flattened, recursively)."""
    if policy is None:
        return []
    if isinstance(policy, KeepAny):
        return [q for p in policy.policies for q in policy_parts(p)]
    return [policy]


def steps_to_delete(checkpoints: Sequence[Kept], policy: RetentionPolicy | None,
                    protect: Iterable[int] = (), references: Mapping[int, Collection[int]] | None = None) -> list[int]:
    """Steps to delete, in the order to delete them: those ``policy`` does not keep, never the
    newest checkpoint nor a step in ``protect``, nor one that a step kept references.
    ``policy=None`` keeps everything.

    ``references``: the steps whose data files each checkpoint references (every committed one,
    those left out of ``checkpoints`` too). A kept checkpoint keeps what it references, and so on
    (it stays readable). A step is deleted only once no step still there references it, so a
    deletion cut short never leaves a checkpoint with missing bytes; otherwise oldest first.
    """
    if policy is None or not checkpoints:
        return []
    refs = references or {}
    kept = policy.keep(checkpoints) | {max(c.step for c in checkpoints)} | set(protect)
    pending = list(kept)
    while pending:  # what kept checkpoints reference is kept too, transitively
        for s in refs.get(pending.pop(), ()):
            if s not in kept:
                kept.add(s)
                pending.append(s)
    doomed = sorted(c.step for c in checkpoints if c.step not in kept)
    order: list[int] = []
    while doomed:
        free = [s for s in doomed if not any(s in refs.get(o, ()) for o in doomed if o != s)]
        if not free:  # a cycle (not written by resurgo: references point at earlier saves) is kept
            break
        order.extend(free)
        doomed = [s for s in doomed if s not in free]
    return order


def referencing(step: int | None, steps: Collection[int], refs: Mapping[int, Collection[int]]) -> list[int]:
    """Those of ``steps`` whose checkpoints reference the data files of ``step``'s."""
    return sorted(s for s in steps if s != step and step in refs.get(s, ()))


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
