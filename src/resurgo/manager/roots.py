"""A manager root on any backend: list its checkpoints, classify one, delete one.

:class:`LocalRoot` is a directory (the catalog and crash-safe deletion of
:mod:`resurgo.manager.catalog` and :mod:`resurgo.manager.removal`); :class:`ObjectRoot` is a URL
prefix on an object store, listed in one request. There, a checkpoint is ``<root>/step_N/`` with
its ``manifest.json``; a prefix with data objects or a writer token but no manifest is an
incomplete save (one that died, or one still running); deletion removes the manifest first, so a
deletion cut short leaves an incomplete checkpoint, never a committed one with objects missing.
On both, ``remove`` deletes only what resurgo can prove it wrote (:mod:`resurgo.storage.ownership`),
else raises ForeignFilesError and deletes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from resurgo.errors import ResurgoError
from resurgo.format.manifest import MANIFEST_NAME, Manifest, declared_files
from resurgo.pipeline.manifest_read import read_manifest_of
from resurgo.manager.catalog import (
    COMMITTED,
    CORRUPT,
    INCOMPLETE,
    Entry,
    checkpoint_name,
    classify_step_dir,
    dir_bytes,
    file_size_problems,
    newest_mtime,
    scan_root,
    step_of,
)
from resurgo.manager.removal import remove_checkpoint, remove_temporary
from resurgo.storage.open import is_url

if TYPE_CHECKING:
    from resurgo.storage.fsspec_store import PrefixListing


class LocalRoot:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.storage_options: dict | None = None

    def __str__(self) -> str:
        return str(self.root)

    def location(self, step: int) -> Path:
        return self.root / checkpoint_name(step)

    def scan(self) -> list[Entry]:
        return scan_root(self.root)

    def classify(self, step: int) -> Entry | None:
        path = self.location(step)
        if not (path.exists() or path.is_symlink()):
            return None
        return classify_step_dir(path, step)

    def remove(self, step: int, *, dry_run: bool = False) -> bool:
        """Delete the checkpoint of ``step`` if it is resurgo's (else ForeignFilesError); False when
        there is none. ``dry_run``: only check."""
        return remove_checkpoint(self.location(step), dry_run=dry_run)

    def remove_leftover(self, entry: Entry) -> None:
        remove_temporary(entry.path)

    def remove_entry(self, entry: Entry, *, dry_run: bool = False) -> bool:
        """Delete what :meth:`scan` listed as ``entry`` (a checkpoint, an incomplete one or a
        temporary directory) if it is resurgo's (else ForeignFilesError); False when it is gone."""
        return remove_checkpoint(entry.path, dry_run=dry_run)

    def entry_bytes(self, entry: Entry) -> int:
        return dir_bytes(entry.path)

    def changed_at(self, entry: Entry) -> float:
        """When anything under ``entry`` last changed (a save in progress keeps it fresh)."""
        return newest_mtime(entry.path)


class ObjectRoot:
    def __init__(self, url: str, storage_options: dict | None = None):
        from resurgo.storage.fsspec_store import split_url

        self.url = url.rstrip("/")
        self.storage_options: dict | None = dict(storage_options or {})
        self.fs, self.prefix = split_url(self.url, self.storage_options)

    def __str__(self) -> str:
        return self.url

    def location(self, step: int) -> str:
        return f"{self.url}/{checkpoint_name(step)}"

    def _entries(self, only: str | None = None) -> list[Entry]:
        from resurgo.storage.fsspec_store import list_prefix, listing_of

        objects = list_prefix(self.fs, self.prefix if only is None else f"{self.prefix}/{only}", self.url)
        if only is not None:
            objects = {f"{only}/{rel}": info for rel, info in objects.items()}
        groups: dict[str, dict[str, dict]] = {}
        for rel, info in objects.items():
            name, _, inner = rel.partition("/")
            if inner and step_of(name) is not None:
                groups.setdefault(name, {})[inner] = info
        entries = [self._classify(name, listing_of(objs)) for name, objs in groups.items()]
        return sorted(entries, key=lambda e: (e.step, e.status != COMMITTED))

    def _classify(self, name: str, found: "PrefixListing") -> Entry:
        return classify_prefix(f"{self.url}/{name}", name, found, self.storage_options, step_of(name))

    def scan(self) -> list[Entry]:
        return self._entries()

    def classify(self, step: int) -> Entry | None:
        found = self._entries(only=checkpoint_name(step))
        return found[0] if found else None

    def remove(self, step: int, *, dry_run: bool = False) -> bool:
        """Delete the objects of ``step`` if all are resurgo's (else ForeignFilesError, nothing
        deleted); False when there are none. ``dry_run``: only check."""
        from resurgo.storage.fsspec_store import ObjectCheckpoint, list_prefix, listing_of, remove_prefix

        name = checkpoint_name(step)
        objects = list_prefix(self.fs, f"{self.prefix}/{name}", self.url)
        if not objects:
            return False
        ObjectCheckpoint(self.location(step), self.storage_options).prove(listing_of(objects), declared_files,
                                                                        "delete it")
        if not dry_run:
            remove_prefix(self.fs, f"{self.prefix}/{name}", f"{self.url}/{name}", sorted(objects))
        return True

    def remove_leftover(self, entry: Entry) -> None:
        self.remove_entry(entry)

    def remove_entry(self, entry: Entry, *, dry_run: bool = False) -> bool:
        """Delete the objects of what :meth:`scan` listed as ``entry`` if all are resurgo's (else
        ForeignFilesError); False when there are none."""
        return entry.step is not None and self.remove(entry.step, dry_run=dry_run)

    def entry_bytes(self, entry: Entry) -> int:
        return entry.nbytes  # from the listing

    def changed_at(self, entry: Entry) -> float:
        """The latest modification time of its objects (from the listing)."""
        return entry.newest


def classify_prefix(url: str, name: str, found: "PrefixListing", storage_options: dict | None,
                    step: int | None = None) -> Entry:
    """What the objects under ``url`` (listed in ``found``) are; ``step``: the step its name says
    (a manager's checkpoint), which the manifest must agree with."""
    path = Path(name)
    if not found.has_manifest:
        what = "a writer token" if found.writers and not found.has_data else "data objects"
        return Entry(path, INCOMPLETE, step, None, f"{what} but no {MANIFEST_NAME}: the save never committed "
                     "(or is still running)", url=url, newest=found.newest, nbytes=found.total_bytes)
    from resurgo.storage.fsspec_store import ObjectCheckpoint

    try:
        manifest = read_manifest_of(ObjectCheckpoint(url, storage_options))
    except ResurgoError as e:
        return Entry(path, CORRUPT, step, None, str(e), url=url, newest=found.newest, nbytes=found.total_bytes)
    problems = stored_size_problems(found.files, manifest)
    if step is not None and manifest.step != step:
        problems.append(f"its manifest says step {manifest.step}, its name says step {step}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Entry(path, CORRUPT, step, manifest.created_at, problems[0] + more, url=url,
                     newest=found.newest, nbytes=found.total_bytes)
    return Entry(path, COMMITTED, manifest.step if step is None else step, manifest.created_at, "",
                 dict(manifest.metadata), dict(manifest.save_info), url=url, newest=found.newest,
                 nbytes=found.total_bytes)


def stored_size_problems(stored: Mapping[str, int], manifest: Manifest) -> list[str]:
    """Data objects missing from ``stored`` (name -> bytes) or of another size than the manifest says."""
    return [f"{name}: missing" if name not in stored else f"{name}: {stored[name]} bytes stored, the manifest says {e.bytes}"
            for name, e in manifest.files.items() if stored.get(name) != e.bytes]


def size_problems(location: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Data files (or objects, at a URL) missing or of another size than ``manifest`` says: one
    stat per file, or one listing; no data is read."""
    if not is_url(location):
        return file_size_problems(location, manifest)
    from resurgo.storage.fsspec_store import ObjectCheckpoint

    return stored_size_problems(ObjectCheckpoint(str(location)).listing().files, manifest)


def list_object_checkpoints(url: str, storage_options: dict | None = None) -> list[Entry]:
    """Every checkpoint (or incomplete save) at or below ``url``, from one listing; an entry's
    ``path`` is its prefix relative to ``url`` (``.`` for ``url`` itself)."""
    from resurgo.storage.fsspec_store import DATA_DIR, WRITERS_DIR, list_prefix, listing_of, split_url

    url = url.rstrip("/")
    fs, root = split_url(url, storage_options)
    groups: dict[str, dict[str, dict]] = {}
    for rel, info in list_prefix(fs, root, url).items():
        parts = rel.split("/")
        for i, part in enumerate(parts):
            if part in (DATA_DIR, WRITERS_DIR) and i < len(parts) - 1 or (part == MANIFEST_NAME and i == len(parts) - 1):
                groups.setdefault("/".join(parts[:i]), {})["/".join(parts[i:])] = info
                break
    entries = []
    for prefix, objects in groups.items():
        name = prefix or "."
        entries.append(classify_prefix(f"{url}/{prefix}" if prefix else url, name, listing_of(objects), storage_options))
    return sorted(entries, key=lambda e: str(e.path))


ManagerRoot = LocalRoot | ObjectRoot  # the same methods: location, scan, classify, remove, remove_leftover,
# remove_entry, entry_bytes, changed_at


def root_name(store: ManagerRoot) -> str:
    """How a root is named in a manifest's record of the tiers: an absolute path, or its URL."""
    return str(store.root.absolute()) if isinstance(store, LocalRoot) else store.url


def open_root(root: str | os.PathLike, storage_options: dict | None = None) -> ManagerRoot:
    if is_url(root):
        return ObjectRoot(str(root), storage_options)
    if storage_options:
        from resurgo.errors import UnsupportedValueError

        raise UnsupportedValueError(f"{root}: storage_options apply to URLs (s3://...), not to a local path")
    return LocalRoot(root)
