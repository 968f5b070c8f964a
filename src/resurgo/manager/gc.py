"""What ``resurgo gc`` removes from a manager root: a pure plan over the catalog's entries
(:func:`plan_gc`), and its execution on a directory or an object store (:func:`run_gc`).

Committed checkpoints go by the retention policy (never the newest): by default the rules the
manager recorded in the newest committed checkpoint's ``save_info`` (:func:`gc_policy`), each of
which the command line may replace. Incomplete checkpoints and
temporary directories go once nothing under them has changed for ``stale_after`` seconds (a save
in progress keeps its directory fresh). Corrupt checkpoints are kept: they may be worth a look,
and removing them is a decision for a person.

Checkpoints are those of any ``step_<digits>`` name, the manager's ``step_000000123`` and a
script's ``step_123`` alike (``scan(any_padding=True)``). Two committed ones of one step are both
kept, and count for no retention rule: which one the rules meant is a decision for a person too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resurgo.errors import ForeignFilesError, UnsupportedValueError
from resurgo.manager.catalog import COMMITTED, CORRUPT, Entry, references_by_step, remove, scan
from resurgo.storage.open import open_root
from resurgo.manager.retention import (
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    Kept,
    RetentionPolicy,
    describe,
    policy_from_spec,
    policy_parts,
    referencing,
    steps_to_delete,
)

DELETE, KEEP = "delete", "keep"


@dataclass
class GcItem:
    entry: Entry
    action: str  # delete | keep
    reason: str
    nbytes: int = 0  # its size as stored (set by run_gc)
    turn: int = 0  # deletions run by turn: no checkpoint goes before one that references it


@dataclass
class GcRun:
    """What :func:`run_gc` did (or, in a dry run, would do)."""

    plan: list[GcItem]  # one item per entry of the root, in step order
    rules: str  # the retention rules applied, in words
    source: str  # where they come from
    refused: list[str] = field(default_factory=list)  # deletions refused: files resurgo did not write

    @property
    def deleted(self) -> list[GcItem]:
        return [item for item in self.plan if item.action == DELETE]


def _recorded_spec(newest: Entry, root: str) -> tuple[bool, Any]:
    """(found, spec) of the retention rules ``newest``'s save_info records for ``root``."""
    info = newest.save_info
    if "tiers" in info:  # a manager with durable tiers: each tier has its own rules
        for tier in info["tiers"] if isinstance(info["tiers"], list) else ():
            if isinstance(tier, dict) and tier.get("root") == root:
                return True, tier.get("retention")
        return False, None
    if "retention" in info:
        return True, info["retention"]
    return False, None


def gc_policy(entries: Sequence[Entry], root: str, *, keep_last: int | None = None, keep_every: int | None = None,
              keep_best: tuple | None = None, no_keep_best: bool = False,
              ignore_recorded: bool = False) -> tuple[RetentionPolicy | None, str]:
    """The policy gc applies to a root, and where its rules come from (for the user).

    The rules the manager recorded in the newest committed checkpoint (for this ``root``: an
    absolute path or a URL), with each rule given here replacing the recorded rule of that name
    (``no_keep_best`` drops keep_best). ``ignore_recorded``: the given rules only. No rules at all
    means keep every committed checkpoint. Raises :class:`UnsupportedValueError` when the record
    cannot be used (none, or a custom policy) and no rule replaces it.
    """
    committed = [e for e in entries if e.status == COMMITTED and e.step is not None]
    given = keep_last is not None or keep_every is not None or keep_best is not None or no_keep_best
    parts: list[RetentionPolicy] = []
    source = "the command line"
    if committed and not ignore_recorded:
        newest = max(committed, key=lambda e: e.step or 0)
        found, spec = _recorded_spec(newest, root)
        where = f"{newest.location}: save_info retention"
        if found:
            try:
                parts = policy_parts(policy_from_spec(spec, where))
            except UnsupportedValueError as e:
                raise UnsupportedValueError(f"{e}; pass --ignore-recorded with the rules to apply "
                                            "(--keep-last, --keep-every, --keep-best)") from None
            source = f"recorded by the manager at step {newest.step}" + (" and the command line" if given else "")
        elif not given:
            raise UnsupportedValueError(
                f"{root}: the newest checkpoint ({newest.location}) records no retention rules for this root (it was "
                "not saved by a CheckpointManager, or the root moved); give them: --keep-last N, --keep-every N, "
                "--keep-best METRIC:min|max")
    if keep_last is not None:
        parts = [p for p in parts if not isinstance(p, KeepLast)] + [KeepLast(keep_last)]
    if keep_every is not None:
        parts = [p for p in parts if not isinstance(p, KeepEvery)] + [KeepEvery(keep_every)]
    if keep_best is not None or no_keep_best:
        parts = [p for p in parts if not isinstance(p, KeepBest)]
        if keep_best is not None:
            parts.append(KeepBest(*keep_best))
    policy = None if not parts else parts[0] if len(parts) == 1 else KeepAny(*parts)
    return policy, source


def plan_gc(entries: Sequence[Entry], policy: RetentionPolicy | None, *, now: float, stale_after: float,
            mtime: Callable[[Any], float]) -> list[GcItem]:
    """One item per entry, in the entries' order. ``mtime(path)``: when ``path`` last changed.

    A kept committed checkpoint's reason names every rule that keeps it."""
    claims = Counter(e.step for e in entries if e.status == COMMITTED and e.step is not None)
    shared = {step for step, n in claims.items() if n > 1}  # step_5 beside step_000000005
    committed = [Kept(e.step, e.metrics) for e in entries
                 if e.status == COMMITTED and e.step is not None and e.step not in shared]
    refs = references_by_step(list(entries))
    # A corrupt checkpoint is never removed, nor one whose step another claims: what they
    # reference stays with them.
    protect = [e.step for e in entries if e.status == CORRUPT and e.step is not None] + sorted(shared)
    order = steps_to_delete(committed, policy, protect, refs)
    doomed = set(order)
    newest = max((k.step for k in committed), default=None)
    keeps = [(describe(p), p.keep(committed)) for p in policy_parts(policy)]
    plan = []
    for e in entries:
        if e.status == COMMITTED and e.step in shared:
            others = ", ".join(o.name for o in entries if o.status == COMMITTED and o.step == e.step and o is not e)
            plan.append(GcItem(e, KEEP, f"step {e.step} is also the step of {others}: gc keeps both; rename or "
                                        "remove one to let the retention rules count it"))
        elif e.status == COMMITTED:
            if e.step in doomed:
                plan.append(GcItem(e, DELETE, "kept by no retention rule"))
            else:
                rules = [name for name, kept in keeps if e.step in kept]
                why = ["the newest committed checkpoint"] if e.step == newest else []
                if rules:
                    why.append("kept by " + ", ".join(rules))
                users = sorted(s for s, r in refs.items() if e.step in r and s not in doomed)
                if users:
                    why.append("its data files are referenced by step " + ", ".join(map(str, users)))
                if policy is None:
                    why.append("no retention rule: every checkpoint is kept")
                plan.append(GcItem(e, KEEP, "; ".join(why)))
        elif e.status == CORRUPT:
            plan.append(GcItem(e, KEEP, "corrupt: examine it with `resurgo verify`; gc never removes it"))
        else:
            age = now - mtime(e.path)
            if age >= stale_after:
                plan.append(GcItem(e, DELETE, f"{e.status}, unchanged for {age:.0f} s"))
            else:
                plan.append(GcItem(e, KEEP, f"{e.status}, changed {age:.0f} s ago (a save may be running; "
                                            f"stale after {stale_after:g} s)"))
    for item in plan:  # a checkpoint is deleted before the ones it references (crash-safe)
        if item.action == DELETE and item.entry.status == COMMITTED:
            item.turn = order.index(item.entry.step or 0)
    return plan


def run_gc(root: str | os.PathLike, *, keep_last: int | None = None, keep_every: int | None = None,
           keep_best: tuple | None = None, no_keep_best: bool = False, ignore_recorded: bool = False,
           stale_after: float = 3600.0, dry_run: bool = False) -> GcRun:
    """Plan gc for a manager root (a directory or a URL; rules as in :func:`gc_policy`) and delete
    what the plan deletes, or in a ``dry_run`` only check that it may be deleted. An item holding
    files resurgo did not write is kept: its reason and :attr:`GcRun.refused` say why."""
    store = open_root(root)
    store.require("a CheckpointManager root directory")
    # any_padding: a script's step_300 is a checkpoint to gc as to ls. An incomplete save's age
    # is that of the newest thing stored under it.
    entries = scan(store, any_padding=True)
    policy, source = gc_policy(entries, store.name, keep_last=keep_last, keep_every=keep_every,
                               keep_best=keep_best, no_keep_best=no_keep_best, ignore_recorded=ignore_recorded)
    by_path: dict[Path, Entry] = {e.path: e for e in entries}
    plan = plan_gc(entries, policy, now=time.time(), stale_after=stale_after, mtime=lambda path: by_path[path].newest)
    run = GcRun(plan, describe(policy) if policy is not None else "none (every committed checkpoint is kept)", source)
    refs = references_by_step(entries)
    kept_steps = {item.entry.step for item in plan if item.action == KEEP and item.entry.step is not None}
    for item in sorted(plan, key=lambda item: item.turn):
        item.nbytes = item.entry.nbytes
        if item.action == DELETE:
            users = referencing(item.entry.step, kept_steps, refs)
            if users and item.entry.status == COMMITTED and item.entry.step is not None:  # a refused one needs it
                item.action, item.reason = KEEP, f"its data files are referenced by step {users[0]}, which is kept"
                kept_steps.add(item.entry.step)
                continue
            try:
                remove(store, item.entry.name, dry_run=dry_run)
            except ForeignFilesError as e:
                item.action, item.reason = KEEP, f"refused: {e}"
                run.refused.append(str(e))
                if item.entry.step is not None:
                    kept_steps.add(item.entry.step)
    return run

