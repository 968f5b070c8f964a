"""What resurgo may replace or delete: only what it can prove it wrote.

Every path that replaces or deletes a location (``save``/``async_save`` with ``overwrite=True``,
the manager's retention and leftover clean-up, ``resurgo gc``, tier copies, object-store
overwrites, ``convert --overwrite``) first lists what is there and refuses, touching nothing,
when any entry is not one resurgo writes (:class:`~resurgo.errors.ForeignFilesError`, naming one
such entry and how many more). What counts as resurgo's, for a checkpoint location:

- ``manifest.json``, when it verifies (it parses and matches its own seal); in a staging
  directory (``.<name>.resurgo-tmp-<id>``) any ``manifest.json``, which a save cut short writes;
- the ``data/`` folder, and the data files a verifying manifest lists;
- where there is no verifying manifest to list them (an incomplete checkpoint, a staging
  directory) and on object stores (where aborted saves leave objects beside a checkpoint): data
  files named as resurgo names them (``data/[<save id>-]rank<R>-<I>.safetensors``) and, on object
  stores, writer tokens (``.resurgo-writers/<save id>``).

Anything else (a file of another name, a folder, a symbolic link, a manifest that does not verify)
is foreign. Storage does not parse manifests: the caller passes a :data:`DeclaredFiles` function
(:func:`resurgo.format.manifest.declared_files`) that turns a manifest's bytes into the data files it
lists, or raises when the manifest does not verify. Deletion then removes the entries this proof
accepted one by one (never a recursive delete of a folder), so a file that appears meanwhile stays.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from resurgo.errors import ForeignFilesError, ResurgoError

MANIFEST = "manifest.json"  # format.manifest.MANIFEST_NAME (asserted equal in local.py)
DATA = "data"
DIR, FILE, OTHER = "dir", "file", "other"  # kinds of entries: symbolic links and devices are OTHER

DeclaredFiles = Callable[[bytes, str], Collection[str]]
"""``(manifest bytes, how to name it) -> the data files it lists``; raises a ResurgoError when the
manifest does not verify. Supplied by the layers that may parse manifests."""

Owned = Callable[[str, str], bool]
"""``(relative path, kind) -> True when resurgo wrote it``; a folder it accepts is looked into."""

_RESURGO_DATA_FILE = re.compile(r"data/(?:[0-9a-f]{12}-)?rank\d{5,}-(?:\d{3,}|index)\.safetensors")  # data files, indexes
_WRITER_TOKEN = re.compile(r"\.resurgo-writers/[0-9a-f]{12}")


class Claim:
    """Which entries of a checkpoint location are resurgo's (an :data:`Owned` predicate), given the
    bytes of its manifest (None: it has none). ``leftovers``: also resurgo-named data files and
    writer tokens no manifest lists (always so where there is no manifest). ``staging``: a staging
    directory, whose manifest is resurgo's even unverified. ``declared``: the data files the
    manifest lists; ``why``: why ``manifest.json`` is not resurgo's ("" when it is)."""

    def __init__(self, manifest: bytes | None, declared_files: DeclaredFiles | None, where: str, *,
                 leftovers: bool, staging: bool = False):
        self.declared: frozenset[str] = frozenset()
        self.manifest_ok, self.why = staging, ""
        if manifest is not None:
            if declared_files is None:
                self.why = "its manifest was not checked"
            else:
                try:
                    self.declared = frozenset(declared_files(manifest, f"{where}/{MANIFEST}"))
                    self.manifest_ok = True
                except ResurgoError as e:
                    self.why = f"it does not verify: {e}"
        self.loose = leftovers or manifest is None

    def __call__(self, rel: str, kind: str) -> bool:
        if kind == DIR:
            return rel == DATA
        if kind != FILE:
            return False
        if rel == MANIFEST:
            return self.manifest_ok
        return rel in self.declared or (self.loose and (_RESURGO_DATA_FILE.fullmatch(rel) is not None
                                                        or _WRITER_TOKEN.fullmatch(rel) is not None))


def foreign(entries: Iterable[tuple[str, str]], owned: Owned) -> list[str]:
    """The entries (``(relative path, kind)``) that ``owned`` does not accept, sorted."""
    return sorted(rel for rel, kind in entries if not owned(rel, kind))


def dir_entries(path: Path, owned: Owned) -> list[tuple[str, str]]:
    """Every entry under the directory ``path`` as ``(relative path, kind)``, looking into the
    folders ``owned`` accepts only (a foreign folder is one entry). Links are never followed."""
    out: list[tuple[str, str]] = []
    pending = [""]
    while pending:
        prefix = pending.pop()
        with os.scandir(path / prefix if prefix else path) as it:
            for e in it:
                rel = f"{prefix}{e.name}"
                kind = DIR if e.is_dir(follow_symlinks=False) else FILE if e.is_file(follow_symlinks=False) else OTHER
                out.append((rel, kind))
                if kind == DIR and owned(rel, kind):
                    pending.append(rel + "/")
    return out


def refuse_foreign(where: object, found: list[str], doing: str, why_manifest: str = "") -> None:
    """Raise ForeignFilesError for ``found`` (foreign entries of ``where``), if any."""
    if not found:
        return
    if MANIFEST in found:  # the cause: without a verifying manifest its data files are not listed
        found = [MANIFEST] + [f for f in found if f != MANIFEST]
    first = found[0]
    reason = f" ({why_manifest})" if first == MANIFEST and why_manifest else ""
    more = f" and {len(found) - 1} more" if len(found) > 1 else ""
    raise ForeignFilesError(
        f"{where}: holds {first!r}{reason}{more}, which resurgo did not write; refusing to {doing}, nothing "
        "was changed. resurgo replaces or deletes only what it wrote itself: move those files away or use "
        "another path.")


def prove_dir(path: Path, owned: Owned, doing: str, why_manifest: str = "") -> list[tuple[str, str]]:
    """Every entry of the directory ``path`` when all are resurgo's (else ForeignFilesError)."""
    entries = dir_entries(path, owned)
    refuse_foreign(path, foreign(entries, owned), doing, why_manifest)
    return entries


def remove_owned(path: Path, owned: Owned) -> list[str]:
    """Delete what ``owned`` accepts under the directory ``path``, entry by entry, then the folders
    once empty; returns the foreign entries left in place (then ``path`` stays too)."""
    try:
        entries = dir_entries(path, owned)
    except FileNotFoundError:
        return []  # removed meanwhile by someone else (another gc)
    left = foreign(entries, owned)
    for rel, kind in sorted(entries, key=lambda e: -e[0].count("/")):  # files before their folder
        if not owned(rel, kind):
            continue
        try:
            if kind == DIR:
                os.rmdir(path / rel)
            else:
                os.unlink(path / rel)
        except FileNotFoundError:
            pass
        except OSError as e:
            if kind != DIR:
                raise
            left.append(f"{rel}/ (not empty: {e.strerror})")
    if not left:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            left.append(f"(the folder itself: {e.strerror})")
    return left
