"""What ``resurgo gc`` removes from a manager root: a pure plan over the catalog's entries.

Committed checkpoints go by the retention policy (never the newest). Incomplete checkpoints and
temporary directories go once nothing under them has changed for ``stale_after`` seconds (a save
in progress keeps its directory fresh). Corrupt checkpoints are kept: they may be worth a look,
and removing them is a decision for a person.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from resurgo.manager.catalog import COMMITTED, CORRUPT, Entry
from resurgo.manager.retention import Kept, RetentionPolicy, steps_to_delete

DELETE, KEEP = "delete", "keep"


@dataclass
class GcItem:
    entry: Entry
    action: str  # delete | keep
    reason: str


def plan_gc(entries: Sequence[Entry], policy: RetentionPolicy | None, *, now: float, stale_after: float,
            mtime: Callable[[Path], float]) -> list[GcItem]:
    """One item per entry, in the entries' order. ``mtime(path)``: when ``path`` last changed."""
    committed = [Kept(e.step, e.metrics) for e in entries if e.status == COMMITTED and e.step is not None]
    doomed = set(steps_to_delete(committed, policy))
    newest = max((k.step for k in committed), default=None)
    plan = []
    for e in entries:
        if e.status == COMMITTED:
            if e.step in doomed:
                plan.append(GcItem(e, DELETE, "not kept by the retention policy"))
            else:
                plan.append(GcItem(e, KEEP, "the newest committed checkpoint" if e.step == newest
                                   else "kept by the retention policy"))
        elif e.status == CORRUPT:
            plan.append(GcItem(e, KEEP, "corrupt: examine it with `resurgo verify`; gc never removes it"))
        else:
            age = now - mtime(e.path)
            if age >= stale_after:
                plan.append(GcItem(e, DELETE, f"{e.status}, unchanged for {age:.0f} s"))
            else:
                plan.append(GcItem(e, KEEP, f"{e.status}, changed {age:.0f} s ago (a save may be running; "
                                            f"stale after {stale_after:g} s)"))
    return plan
