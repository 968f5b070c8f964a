"""Retention applied to one root: list it, protect what is in use, delete what the policy drops.

Deletions never break a checkpoint that is kept (what it references stays, and a step goes only
once nothing still there references it); a deletion refused because the checkpoint holds files
resurgo did not write leaves it in place, the others still go, and the first refusal is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from resurgo.errors import ForeignFilesError
from resurgo.manager.catalog import COMMITTED, CORRUPT, checkpoint_name, references_by_step, remove, scan
from resurgo.manager.retention import Kept, RetentionPolicy, referencing, steps_to_delete
from resurgo.storage.base import Root

log = logging.getLogger("resurgo.manager")


def prune(store: Root, policy: RetentionPolicy | None, just_committed: int, *,
          unreadable: frozenset[int] = frozenset(), held: Callable[[], frozenset[int]] | None = None,
          in_use: Callable[[], Iterable[int]] | None = None, keep_damaged: bool = False) -> None:
    """Delete from ``store`` the checkpoints ``policy`` does not keep, never ``just_committed``.

    ``unreadable``: steps restore found damaged, not counted as checkpoints. ``held``: a memory
    tier's node directories committed with only the files its node holds (the listing calls them
    corrupt, they are not). ``in_use``: steps a running save or copy still reads, asked after the
    listing. ``keep_damaged``: unreadable and corrupt checkpoints are never deleted (nor what they
    reference).
    """
    entries = scan(store)
    held_steps = held() if held is not None else frozenset()
    committed = [Kept(e.step, e.metrics) for e in entries
                 if (e.status == COMMITTED or e.step in held_steps) and e.step is not None and e.step not in unreadable]
    protect: tuple[int, ...] = (just_committed,) + (tuple(in_use()) if in_use is not None else ())
    if keep_damaged:
        protect += tuple(e.step for e in entries if e.step is not None and (e.step in unreadable or (
            e.status == CORRUPT and e.step not in held_steps)))
    refused: list[ForeignFilesError] = []
    refs = references_by_step(entries)
    kept = {e.step for e in entries if e.step is not None}
    for s in steps_to_delete(committed, policy, protect=protect, references=refs):
        if referencing(s, kept, refs):  # one whose deletion was refused still references it
            continue
        log.info("deleting step %d (%s)", s, store.location(checkpoint_name(s)))
        try:
            if remove(store, checkpoint_name(s)):
                log.info("deleted step %d", s)
            kept.discard(s)
        except ForeignFilesError as e:  # left in place; the others still go
            refused.append(e)
    if refused:
        raise refused[0]
