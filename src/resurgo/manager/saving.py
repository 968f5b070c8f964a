"""The pieces of one save of the manager: its metrics as JSON numbers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from resurgo.errors import UnsupportedValueError


def plain_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Metrics as JSON numbers (0-d tensors and numpy scalars too); NaN and inf become None."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics must be a mapping of names to numbers, not {type(metrics).__name__}")
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise UnsupportedValueError(f"metrics: names must be str, not {name!r}")
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            raise UnsupportedValueError(f"metrics[{name!r}]: expected a number, got {type(value).__name__}") from None
        out[name] = number if math.isfinite(number) else None
    return out
