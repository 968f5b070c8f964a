"""The manager's deprecated call forms: each still works for one release, with a
DeprecationWarning naming the form that replaces it.
"""

from __future__ import annotations

import warnings
from typing import Any


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def state_first(method: str, state: Any, step: Any) -> tuple[Any, int]:
    """``(state, step)`` of a call of ``CheckpointManager.<method>``. A step given first and a
    state second (the order before the state came first everywhere) is swapped, with a warning;
    two ints are read in the current order, as no state is an int."""
    if _is_step(state) and not _is_step(step):
        warnings.warn(f"CheckpointManager.{method}(step, state) is deprecated: call {method}(state, step), the state "
                      "first as in resurgo.save(state, path) and restore(state, step)", DeprecationWarning,
                      stacklevel=3)
        return step, state
    return state, step
