"""What is in a checkpoint directory tree, read-only: each entry's status, step, time and metrics.

Statuses: ``committed`` (a manifest that validates and data files of the sizes it lists),
``incomplete`` (no manifest: a save that never committed, or the remains of a deletion),
``temporary`` (a ``.NAME.resurgo-tmp-*`` directory: an interrupted save, or a checkpoint being
deleted) and ``corrupt`` (a manifest that does not validate, or data files of other sizes; with
a checksum pass, also bad bytes). Classifying reads manifests and stats files, never data.

A manager root holds one directory per checkpoint named ``step_000000123`` (zero-padded, so names
sort by step) and the temporary directories of its saves and deletions beside them.
:func:`scan_root` lists such a root; :func:`list_checkpoints` finds every checkpoint below a
directory or URL prefix (``resurgo ls``).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from resurgo.errors import CheckpointNotFoundError, NotACheckpointError, ResurgoError
from resurgo.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest
from resurgo.storage.local import TMP_MARKER, CheckpointDir, is_temporary

COMMITTED, INCOMPLETE, TEMPORARY, CORRUPT = "committed", "incomplete", "temporary", "corrupt"
STEP_PREFIX = "step_"
STEP_DIGITS = 9
TRASH_TAG = "trash-"  # after TMP_MARKER: a checkpoint renamed away to be deleted
_STEP_NAME = re.compile(r"^step_(\d+)$")


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


def temporary_target(name: str) -> str | None:
    """For ``.step_000000123.resurgo-tmp-...``, the checkpoint name it belongs to."""
    if not name.startswith(".") or TMP_MARKER not in name:
        return None
    return name[1:name.index(TMP_MARKER)]


def trash_name(name: str) -> str:
    """The name a checkpoint is renamed to before it is deleted: a temporary directory."""
    return f".{name}{TMP_MARKER}{TRASH_TAG}{uuid.uuid4().hex[:12]}"


@dataclass
class Entry:
    path: Path
    status: str
    step: int | None
    created_at: str | None
    detail: str
    metadata: dict[str, Any] = field(default_factory=dict)  # a committed checkpoint's manifest metadata
    save_info: dict[str, Any] = field(default_factory=dict)  # and its save_info (the manager's retention rules)
    url: str | None = None  # on an object store: its URL (``path`` is then its name)
    newest: float = 0.0  # on an object store: the latest modification time of its objects
    nbytes: int = 0  # on an object store: the bytes of its objects

    @property
    def location(self) -> str:
        """How messages name it: its URL or its path."""
        return self.url or str(self.path)

    @property
    def metrics(self) -> dict[str, Any]:
        """The metrics the manager stored with this checkpoint (``metadata["metrics"]``)."""
        m = self.metadata.get("metrics")
        return dict(m) if isinstance(m, dict) else {}


def file_size_problems(path: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Data files that are missing or of another size than the manifest says (a stat, no reads)."""
    ckpt = CheckpointDir(path)
    problems = []
    for name, entry in manifest.files.items():
        try:
            size = ckpt.resolve(name).stat().st_size
        except ResurgoError as e:
            problems.append(str(e))
            continue
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if size != entry.bytes:
            problems.append(f"{name}: {size} bytes on disk, the manifest says {entry.bytes}")
    return problems


def dir_bytes(d: Path) -> int:
    """Every file under ``d``, as found on disk (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(d, onerror=lambda e: None):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def newest_mtime(d: Path) -> float:
    """The latest modification time of ``d`` or anything under it (a save in progress keeps it fresh)."""
    newest = 0.0
    for root, dirs, files in os.walk(d, onerror=lambda e: None):
        for name in [*dirs, *files, ""]:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name) if name else root).st_mtime)
            except OSError:
                pass
    return newest


def _lenient_manifest_fields(d: Path) -> tuple[int | None, str | None]:
    """step and created_at from a manifest that may not validate (best effort, for display)."""
    try:
        raw = (d / MANIFEST_NAME).read_bytes()
        doc = json.loads(raw) if len(raw) <= MAX_MANIFEST_BYTES else None
    except (OSError, ValueError, RecursionError):
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


def classify(d: Path) -> Entry | None:
    """What ``d`` is, when it is a checkpoint or the remains of a save; None otherwise."""
    has_manifest = (d / MANIFEST_NAME).exists()
    if is_temporary(d):
        step, created = _lenient_manifest_fields(d) if has_manifest else (None, None)
        if step is None:  # a manager's: the step is in the name
            step = step_of(temporary_target(d.name) or "")
        return Entry(d, TEMPORARY, step, created, _temporary_detail(d.name))
    if not has_manifest:
        if (d / "data").is_dir():
            return Entry(d, INCOMPLETE, None, None, f"data/ but no {MANIFEST_NAME}: the save never committed")
        return None
    try:
        manifest = parse_manifest(CheckpointDir(d).read_manifest_bytes(), MANIFEST_NAME)
    except ResurgoError as e:
        step, created = _lenient_manifest_fields(d)
        return Entry(d, CORRUPT, step, created, str(e))
    problems = file_size_problems(d, manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Entry(d, CORRUPT, manifest.step, manifest.created_at, problems[0] + more)
    return Entry(d, COMMITTED, manifest.step, manifest.created_at, "", dict(manifest.metadata),
                 dict(manifest.save_info))


def classify_step_dir(d: Path, step: int) -> Entry:
    """What the directory of ``step`` in a manager root is (it exists)."""
    if not d.is_dir() or d.is_symlink():
        return Entry(d, CORRUPT, step, None, "not a directory: a checkpoint is a directory")
    entry = classify(d) or Entry(d, INCOMPLETE, None, None, f"no {MANIFEST_NAME}: the save never committed")
    if entry.status == COMMITTED and entry.step != step:
        return Entry(d, CORRUPT, step, entry.created_at,
                     f"its manifest says step {entry.step}, its name says step {step}")
    entry.step = step
    return entry


def scan_root(root: Path) -> list[Entry]:
    """The checkpoints of a manager root and the temporary directories of its saves and
    deletions, sorted by step. Other entries of the root are not the manager's: left out."""
    found = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    for name in names:
        step = step_of(name)
        if step is not None:
            found.append(classify_step_dir(root / name, step))
            continue
        target = temporary_target(name)
        if target is not None and step_of(target) is not None and (root / name).is_dir():
            found.append(Entry(root / name, TEMPORARY, step_of(target), None, _temporary_detail(name)))
    found.sort(key=lambda e: (e.step, e.status != COMMITTED, e.path.name))
    return found


def require_directory(path: Path, expected: str = "a directory") -> None:
    """CheckpointNotFoundError when ``path`` does not exist, NotACheckpointError when it is a file."""
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such directory")
    if not path.is_dir():
        raise NotACheckpointError(f"{path}: is a file, expected {expected}")


def _walk(root: Path) -> list[Entry]:
    """Every checkpoint (or leftover of a save) at or below the directory ``root``; an entry's path
    is relative to ``root``, its ``nbytes`` every file under it. Does not descend into a
    checkpoint, an incomplete save or a temporary directory, nor follow links to directories."""
    require_directory(root)
    found: list[Entry] = []
    stack = [root]
    while stack:
        d = stack.pop()
        c = classify(d)
        if c is not None:
            found.append(replace(c, path=d.relative_to(root), nbytes=dir_bytes(d)))
            continue
        try:
            with os.scandir(d) as it:
                stack.extend(Path(entry.path) for entry in it if entry.is_dir(follow_symlinks=False))
        except OSError:
            continue
    found.sort(key=lambda e: e.path.parts)  # "." (the root itself) has no parts: first
    return found


def list_checkpoints(location: str | os.PathLike, *, verify: bool = False) -> list[Entry]:
    """Every checkpoint (or leftover of a save) at or below a directory or a URL prefix (one
    listing), sorted by path; an entry's ``path`` is relative to ``location`` (``.`` for itself)
    and ``nbytes`` is its size as stored. ``verify``: also check every checksum of the committed
    ones; one that fails (or changed since it was listed) becomes corrupt, its first problem the detail.
    """
    from resurgo.storage.open import is_url, join

    if is_url(location):
        from resurgo.manager.roots import list_object_checkpoints

        entries = list_object_checkpoints(str(location))
    else:
        entries = _walk(Path(location))
    if verify:
        from resurgo.pipeline.verify import verify_checkpoint

        for e in entries:
            if e.status != COMMITTED:
                continue
            try:
                report = verify_checkpoint(location if e.path == Path(".") else join(location, e.path.as_posix()))
            except ResurgoError as err:
                e.status, e.detail = CORRUPT, str(err)
                continue
            if not report.ok:
                more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
                e.status, e.detail = CORRUPT, report.problems[0] + more
    return entries
