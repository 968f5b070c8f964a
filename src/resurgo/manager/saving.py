"""The pieces of one save of the manager: its metrics as JSON numbers, and making way for it where
its step is already saved (replacing what resurgo wrote, refusing what later checkpoints reference).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resurgo.errors import CheckpointExistsError, ForeignFilesError, UnsupportedValueError
from resurgo.manager.catalog import COMMITTED, INCOMPLETE, classify, remove, scan
from resurgo.manager.janitor import Janitor
from resurgo.storage.base import Root


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


def make_way(store: Root, path: Path | str, step: int, rank: int, janitor: Janitor) -> bool:
    """Whether the save of ``step`` must replace something already at ``path`` (it warns what). Something
    resurgo cannot prove it wrote is not warned about: the save's staging refuses it, on every
    rank (ForeignFilesError), before anything is written."""
    if classify(store, step) is None:
        return False
    janitor.join()  # no deletion of this very path may still be running
    entry = classify(store, step)
    if entry is None:
        return False
    users = [e.location for e in scan(store) if e.status == COMMITTED and entry.name in e.referenced]
    if users:
        raise CheckpointExistsError(
            f"{path}: step {step} is already saved, and {users[0]}" + (f" (and {len(users) - 1} more)" if len(users) > 1 else "")
            + " references its data files: replacing it would break them. Delete the later checkpoints "
            "(resurgo gc --keep-last, or by hand) or save to another root")
    try:
        remove(store, entry.name, dry_run=True)
    except ForeignFilesError:
        return True
    if entry.status == INCOMPLETE and store.saves_in_place:
        if rank == 0:  # who stages the save; a save of ours that died: its token would refuse it
            remove(store, entry.name)
        return False
    detail = f": {entry.detail}" if entry.detail else ""
    warnings.warn(f"resurgo: replacing {path} ({entry.status}{detail}) with a new save of step {step}; "
                  "the replacement is atomic", stacklevel=4)
    return True
