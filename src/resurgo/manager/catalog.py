"""What is in a root of checkpoints (a directory or a URL prefix), read-only: each entry's
status, step, time and metrics; and the one way the manager deletes an entry.

Statuses: ``committed`` (a manifest that validates and data files of the sizes it lists),
``incomplete`` (no manifest: a save that never committed, or the remains of a deletion),
``temporary`` (a ``.NAME.resurgo-tmp-*`` directory: an interrupted save, or a checkpoint being
deleted) and ``corrupt`` (a manifest that does not validate, or data files of other sizes; with
a checksum pass, also bad bytes). :func:`classify_listing` decides it for both backends from the
root's listing of the entry and its manifest: it reads manifests, never data.

A manager root holds one checkpoint per step named ``step_000000123`` (zero-padded, so names
sort by step) and the temporary directories of its saves and deletions beside them.
:func:`scan` lists such a root; ``scan(root, any_padding=True)`` (``resurgo gc``) also takes
checkpoints a training script named ``step_123`` or ``step_00000123``. :func:`list_checkpoints`
finds every checkpoint below a directory or URL prefix (``resurgo ls``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resurgo.errors import ResurgoError
from resurgo.format.index import declared_names, index_file_name
from resurgo.format.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    TMP_MARKER,
    Manifest,
    declared_files,
    parse_manifest,
    split_reference,
)
from resurgo.storage.base import Listing, Root
from resurgo.storage.local import TRASH_TAG
from resurgo.storage.open import open_root

COMMITTED, INCOMPLETE, TEMPORARY, CORRUPT = "committed", "incomplete", "temporary", "corrupt"
STEP_PREFIX = "step_"
STEP_DIGITS = 9
_STEP_NAME = re.compile(r"^step_(\d+)$")
_ANY_STEP_NAME = re.compile(r"step_([0-9]+)", re.ASCII)  # fullmatch: no trailing newline, ASCII digits only


def checkpoint_name(step: int) -> str:
    """``step_000000123``: zero-padded so that names sort by step."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint step must be an int >= 0, not {step!r}")
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint directory name stands for, or None if it is not one."""
    m = _STEP_NAME.match(name)
    if m is None or name != checkpoint_name(int(m.group(1))):  # one name per step: zero-padded
        return None
    return int(m.group(1))


def step_in_name(name: str) -> int | None:
    """The step of any ``step_<digits>`` name, padded or not (``step_300``, ``step_00000300``),
    or None. What ``resurgo gc`` reads; the manager reads only its own names (:func:`step_of`)."""
    m = _ANY_STEP_NAME.fullmatch(name)
    return None if m is None else int(m.group(1))


def temporary_target(name: str) -> str | None:
    """For ``.step_000000123.resurgo-tmp-...``, the checkpoint name it belongs to."""
    if not name.startswith(".") or TMP_MARKER not in name:
        return None
    return name[1:name.index(TMP_MARKER)]


@dataclass
class Entry:
    path: Path  # its name relative to the root ("." for the root itself)
    status: str
    step: int | None
    created_at: str | None
    detail: str
    metadata: dict[str, Any] = field(default_factory=dict)  # a committed checkpoint's manifest metadata
    save_info: dict[str, Any] = field(default_factory=dict)  # and its save_info (the manager's retention rules)
    where: Path | str | None = None  # its path or URL (None: ``path``)
    newest: float = 0.0  # the latest modification time of what is stored under it
    nbytes: int = 0  # the bytes stored under it
    references: dict[str, int] = field(default_factory=dict)  # files of other checkpoints it reads -> their sizes

    @property
    def referenced(self) -> frozenset[str]:
        """The names of the checkpoints of its root whose data files it references."""
        return frozenset(split_reference(r)[0] for r in self.references)

    @property
    def name(self) -> str:
        """Its name in its root, as :class:`~resurgo.storage.base.Root` methods take it."""
        return self.path.as_posix()

    @property
    def location(self) -> str:
        """How messages name it: its path or URL."""
        return str(self.where if self.where is not None else self.path)

    @property
    def metrics(self) -> dict[str, Any]:
        """The metrics the manager stored with this checkpoint (``metadata["metrics"]``)."""
        m = self.metadata.get("metrics")
        return dict(m) if isinstance(m, dict) else {}


def size_problems_in(stored: Mapping[str, int], manifest: Manifest, size_words: str = "stored") -> list[str]:
    """Data files missing from ``stored`` (name -> bytes, as listed) or of another size than the
    manifest says; ``size_words`` names where the sizes come from ("on disk", "stored"). Of a
    version 4 manifest: every rank's data files are there, and its index of the size recorded
    (the data files' sizes are in the indexes, which a listing does not read)."""
    if manifest.indexed:
        return _indexed_size_problems(stored, manifest, size_words)
    return [f"{name}: missing" if name not in stored else
            f"{name}: {stored[name]} bytes {size_words}, the manifest says {e.bytes}"
            for name, e in manifest.files.items() if name not in stored or stored[name] != e.bytes]


MAX_MISSING_LISTED = 20


def _indexed_size_problems(stored: Mapping[str, int], manifest: Manifest, size_words: str) -> list[str]:
    """:func:`size_problems_in` of a version 4 core, at a cost in what is stored, not in what the
    core declares (a few KB may declare millions of files): the stored names are counted against
    the naming rule, and the declared ones are walked only up to the first few missing."""
    assert manifest.ranks is not None and manifest.file_tag is not None
    declared = declared_names(manifest)
    missing = len(declared) - sum(1 for name in stored if name in declared)
    problems = []
    if missing:
        for name in declared:  # builds at most the stored names plus the ones listed
            if name not in stored:
                problems.append(f"{name}: missing")
                if len(problems) == min(missing, MAX_MISSING_LISTED):
                    break
        if missing > len(problems):
            problems.append(f"and {missing - len(problems)} more of the {len(declared)} files the manifest lists are missing")
    for r, size in enumerate(manifest.ranks.index_bytes):
        name = index_file_name(r, manifest.file_tag)
        if name in stored and stored[name] != size:
            problems.append(f"{name}: {stored[name]} bytes {size_words}, the manifest says {size}")
    return problems


def size_problems(location: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Data files (or objects, at a URL) missing or of another size than ``manifest`` says: one
    listing; no data is read."""
    root = open_root(location)
    found = root.listing(".")
    return size_problems_in(found.files if found is not None else {}, manifest, root.size_words)


def reference_problems(root: Root, name: str, manifest: Manifest) -> list[str]:
    """The files ``manifest`` (of the entry ``name``) references in other checkpoints of ``root``
    that are missing or of another size: one listing per referenced checkpoint."""
    problems = []
    parent = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    listings: dict[str, Listing | None] = {}
    for ref, entry in sorted(manifest.references.items()):
        owner, rel = split_reference(ref)
        if owner not in listings:
            listings[owner] = root.listing(parent + owner)
        found = listings[owner]
        size = found.files.get(rel) if found is not None else None
        if size != entry.bytes:
            problems.append(f"{ref} (referenced): " + ("missing" if size is None else
                            f"{size} bytes {root.size_words}, the manifest says {entry.bytes}"))
    return problems


def _lenient_manifest_fields(raw: bytes | None) -> tuple[int | None, str | None]:
    """step and created_at from a manifest that may not validate (best effort, for display)."""
    try:
        doc = json.loads(raw) if raw is not None and len(raw) <= MAX_MANIFEST_BYTES else None
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(doc, dict):
        return None, None
    step, created = doc.get("step"), doc.get("created_at")
    return (step if type(step) is int else None), (created if isinstance(created, str) else None)


def _temporary_detail(name: str) -> str:
    suffix = name[name.index(TMP_MARKER) + len(TMP_MARKER):]
    if suffix.startswith(TRASH_TAG):
        return "a checkpoint whose deletion was interrupted"
    if suffix.startswith("old-"):
        return "the old copy of an overwritten checkpoint whose deletion was interrupted"
    return "temporary directory left by an interrupted save"


def classify_listing(root: Root, found: Listing, step: int | None = None, *,
                     unrecorded_step_ok: bool = False) -> Entry | None:
    """What the entry ``found`` of ``root`` is, when it is a checkpoint or the remains of a save;
    None otherwise. ``step``: the step its name says (a manager's checkpoint, which is then never
    None), which the manifest must agree with. ``unrecorded_step_ok``: a manifest that records no
    step agrees with any (``resurgo.save`` without one, under a name a script chose); else it is
    corrupt. Reads the manifest, compares the listed sizes."""
    base = Path(found.name).name
    here: dict[str, Any] = {"where": root.location(found.name), "newest": found.newest, "nbytes": found.total_bytes}
    if not found.is_dir:
        return Entry(Path(found.name), CORRUPT, step, None, "not a directory: a checkpoint is a directory", **here)
    target = temporary_target(base)
    if target is not None:
        return Entry(Path(found.name), TEMPORARY, step if step is not None else step_of(target), None,
                     _temporary_detail(base), **here)
    if not found.has_manifest:
        running = " (or is still running)" if root.saves_in_place else ""
        if found.has_data or found.writers:
            what = "a writer token" if found.writers and not found.has_data else "data/"
            return Entry(Path(found.name), INCOMPLETE, step, None,
                         f"{what} but no {MANIFEST_NAME}: the save never committed{running}", **here)
        if step is None:
            return None
        return Entry(Path(found.name), INCOMPLETE, step, None,
                     f"no {MANIFEST_NAME}: the save never committed{running}", **here)
    ckpt, raw = root.open(found.name), None
    try:
        raw = ckpt.read_manifest_bytes()
        manifest = parse_manifest(raw, ckpt.describe(MANIFEST_NAME))
    except ResurgoError as e:
        lenient_step, created = _lenient_manifest_fields(raw)
        return Entry(Path(found.name), CORRUPT, step if step is not None else lenient_step, created, str(e), **here)
    problems = size_problems_in(found.files, manifest, root.size_words)
    problems += reference_problems(root, found.name, manifest)
    if step is not None and manifest.step != step and not (unrecorded_step_ok and manifest.step is None):
        problems.append(f"its manifest says step {manifest.step}, its name says step {step}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Entry(Path(found.name), CORRUPT, manifest.step if step is None else step, manifest.created_at,
                     problems[0] + more, **here)
    return Entry(Path(found.name), COMMITTED, manifest.step if step is None else step, manifest.created_at, "",
                 dict(manifest.metadata),
                 dict(manifest.save_info), references={r: e.bytes for r, e in manifest.references.items()}, **here)


def _root(root: Root | str | os.PathLike) -> Root:
    return open_root(root) if isinstance(root, (str, os.PathLike)) else root


def _manager_step(name: str, any_padding: bool = False) -> int | None:
    """The step of an entry of a manager root: a checkpoint, or a temporary directory of one."""
    parse = step_in_name if any_padding else step_of
    step = parse(name)
    return step if step is not None else parse(temporary_target(name) or "")


def scan(root: Root | str | os.PathLike, *, any_padding: bool = False) -> list[Entry]:
    """The checkpoints of a manager root and the temporary directories of its saves and
    deletions, sorted by step. Other entries of the root are not the manager's: left out.
    ``any_padding``: also checkpoints named ``step_<digits>`` with another padding than the
    manager's (whose manifest may record no step: the name's is theirs), and their temporary
    directories; two of them may then stand for one step."""
    store = _root(root)
    found = []
    for listing in store.listings(select=lambda name: _manager_step(name, any_padding) is not None):
        if temporary_target(listing.name) is not None and not listing.is_dir:
            continue  # a file named like a temporary directory is not the manager's
        entry = classify_listing(store, listing, _manager_step(listing.name, any_padding),
                                 unrecorded_step_ok=any_padding)
        if entry is not None:
            found.append(entry)
    found.sort(key=lambda e: (e.step, e.status != COMMITTED, e.path.name))
    return found


def classify(root: Root | str | os.PathLike, step: int) -> Entry | None:
    """What the checkpoint of ``step`` in a manager root is; None when nothing is there."""
    store = _root(root)
    listing = store.listing(checkpoint_name(step))
    return None if listing is None else classify_listing(store, listing, step)


def remove(root: Root, name: str, *, dry_run: bool = False) -> bool:
    """Delete the entry ``name`` of ``root`` (a checkpoint, an incomplete one or a temporary
    directory) crash-safely, if resurgo wrote all of it (else ForeignFilesError, nothing
    deleted); False when nothing is there. ``dry_run``: only check."""
    return root.remove(name, declared_files, dry_run=dry_run)


def references_by_step(entries: list[Entry]) -> dict[int, set[int]]:
    """For each checkpoint of a manager root (by step), the steps whose data files it references."""
    step_of_name = {e.name: e.step for e in entries if e.step is not None}
    return {e.step: {step_of_name[n] for n in e.referenced if step_of_name.get(n) is not None}
            for e in entries if e.step is not None and e.references}


def list_checkpoints(location: str | os.PathLike, *, verify: bool = False) -> list[Entry]:
    """Every checkpoint (or leftover of a save) at or below a directory or a URL prefix (one
    listing), sorted by path; an entry's ``path`` is relative to ``location`` (``.`` for itself)
    and ``nbytes`` is its size as stored. ``verify``: also check every checksum of the committed
    ones; one that fails (or changed since it was listed) becomes corrupt, its first problem the detail.
    """
    root = open_root(location)
    root.require("a directory")
    entries = [e for e in (classify_listing(root, found) for found in root.walk()) if e is not None]
    entries.sort(key=lambda e: e.path.parts)  # "." (the root itself) has no parts: first
    if verify:
        from resurgo.pipeline.verify import verify_checkpoint

        for e in entries:
            if e.status != COMMITTED:
                continue
            try:
                report = verify_checkpoint(e.location, storage_options=root.storage_options)
            except ResurgoError as err:
                e.status, e.detail = CORRUPT, str(err)
                continue
            if not report.ok:
                more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
                e.status, e.detail = CORRUPT, report.problems[0] + more
    return entries
