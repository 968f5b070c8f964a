"""A manager's configuration from its keyword arguments: the tiers, the save policy its shortcuts
compose (with the mean time between failures that ``interval="auto"`` needs), the retention policy,
and what each checkpoint records of the retention rules.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from resurgo.errors import UnsupportedValueError
from resurgo.manager.memory import MemoryTier
from resurgo.manager.policies import AnyOf, AtSteps, DalyInterval, EveryNSteps, EverySeconds, SavePolicy
from resurgo.manager.retention import KeepAny, KeepLast, RetentionPolicy, policy_spec, shortcut_policy
from resurgo.manager.tiers import Tier
from resurgo.storage.base import Root

MTBF_ENV = "RESURGO_MTBF_SECONDS"


def mtbf_from(mtbf: float | None) -> float:
    if mtbf is not None:
        return mtbf
    raw = os.environ.get(MTBF_ENV)
    if raw is None:
        raise ValueError(f"interval='auto' needs the mean time between failures: pass mtbf= (seconds) or set {MTBF_ENV}")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{MTBF_ENV}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{MTBF_ENV}={raw!r}: must be a positive number of seconds")
    return value


def compose_tiers(root: str | os.PathLike | None, storage_options: dict | None,
                  tiers: Iterable[Tier | MemoryTier] | None) -> list[Any]:
    if tiers is None:
        if root is None:
            raise ValueError("CheckpointManager needs a root (a directory or a URL) or tiers=[...]")
        return [Tier(root, storage_options=storage_options)]
    if root is not None or storage_options is not None:
        raise ValueError("pass either root (and storage_options) or tiers=[...], not both")
    found = list(tiers)
    if not found or not all(isinstance(t, Tier) or (i == 0 and isinstance(t, MemoryTier))
                            for i, t in enumerate(found)):
        raise ValueError(f"tiers must be a non-empty list of resurgo.manager.Tier (a MemoryTier first, if "
                         f"any), not {found!r}")
    if found[0].copy_every_steps is not None:
        raise ValueError("the first tier takes every save: copy_every_steps applies to the later tiers only")
    return found


def _refuse_both(name: str, policy: Any, shortcuts: dict[str, Any], what: str, combinator: str, example: str) -> None:
    """A policy object (``name=``) and shortcuts of the same rule are two ways of writing it: both
    at once is refused, naming both."""
    given = [n for n, value in shortcuts.items() if value is not None]
    if policy is not None and given:
        raise UnsupportedValueError(
            f"CheckpointManager: {name}={policy!r} and {', '.join(f'{n}=' for n in given)} both say {what}; "
            f"give one of them: the shortcuts alone, or one policy object that includes them "
            f"(resurgo.manager.{combinator}({policy!r}, {example}, ...))")


def compose_policy(policy: SavePolicy | None, every_steps: int | None, every_seconds: float | None,
                   at_steps: Iterable[int] | None, interval: str | None,
                   mtbf: float | None) -> tuple[SavePolicy | None, DalyInterval | None]:
    """The save policy (None: saves happen on preemption and by save() only) and, with
    ``interval="auto"``, the Daly interval among its parts. The shortcuts build the policy
    objects; ``policy=`` is the other way of writing the same rule, so both at once is refused."""
    _refuse_both("policy", policy, {"every_steps": every_steps, "every_seconds": every_seconds, "at_steps": at_steps,
                                    "interval": interval}, "when to save", "AnyOf", "EveryNSteps(n)")
    parts: list[SavePolicy] = [policy] if policy is not None else []
    if every_steps is not None:
        parts.append(EveryNSteps(every_steps))
    if every_seconds is not None:
        parts.append(EverySeconds(every_seconds))
    if at_steps is not None:
        parts.append(AtSteps(at_steps))
    daly: DalyInterval | None = None
    if interval is not None:
        if interval != "auto":
            raise ValueError(f"interval must be 'auto' or None, not {interval!r} (for a fixed time use every_seconds=)")
        daly = DalyInterval(mtbf_from(mtbf))
        parts.append(daly)
    elif mtbf is not None:
        raise ValueError("mtbf= is used with interval='auto' only")
    if not parts:
        return None, daly
    return (parts[0] if len(parts) == 1 else AnyOf(*parts)), daly


def compose_retention(retention: RetentionPolicy | None, keep_last: int | None, keep_every: int | None,
                      keep_best: tuple | None, first_tier: Any) -> RetentionPolicy | None:
    """The first tier's retention. The shortcuts build the policy objects (any of them keeping a
    checkpoint keeps it); ``retention=`` is the other way of writing them, so both at once is
    refused. The first tier's own ``keep_last`` is a rule of that tier, kept with the others; the
    manager's ``keep_last=`` would say the same thing again, so both at once is refused too."""
    _refuse_both("retention", retention, {"keep_last": keep_last, "keep_every": keep_every, "keep_best": keep_best},
                 "what to keep", "KeepAny", "KeepLast(k)")
    tier_keep = first_tier.keep_last
    if keep_last is not None and tier_keep is not None:
        kind = type(first_tier).__name__
        raise UnsupportedValueError(
            f"CheckpointManager: keep_last={keep_last} and the first tier's {kind}(keep_last={tier_keep}) both say "
            f"how many checkpoints the first tier keeps{' (a MemoryTier keeps 1 unless told)' if kind == 'MemoryTier' else ''}"
            f"; give it once, at the tier: {kind}(..., keep_last={keep_last}) without the manager's keep_last=")
    shortcuts_policy = shortcut_policy(tier_keep if keep_last is None else keep_last, keep_every, keep_best)
    parts = [p for p in (retention, shortcuts_policy) if p is not None]
    return parts[0] if len(parts) == 1 else KeepAny(*parts) if parts else None


def describe_retention(retention: RetentionPolicy | None, tiers: list[Any], roots: list[Root]) -> dict[str, Any]:
    """What each checkpoint's save_info records of the retention rules, for `resurgo gc`. The
    copies in durable tiers are byte copies, so every tier's rules are recorded with its root."""
    record: dict[str, Any] = {"retention": policy_spec(retention)}
    if len(tiers) > 1:
        record["tiers"] = [{"root": store.name, "retention": policy_spec(retention) if i == 0 else
                            policy_spec(KeepLast(t.keep_last) if t.keep_last is not None else None)}
                           for i, (store, t) in enumerate(zip(roots, tiers))]
    return record
