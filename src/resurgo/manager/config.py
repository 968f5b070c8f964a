"""A manager's configuration from its keyword arguments: the tiers, and the mean time between
failures that ``interval="auto"`` needs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

from resurgo.manager.memory import MemoryTier
from resurgo.manager.tiers import Tier

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
    if found[0].every_steps is not None:
        raise ValueError("the first tier takes every save: every_steps applies to the later tiers only")
    return found
