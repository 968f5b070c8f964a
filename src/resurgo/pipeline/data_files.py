"""A checkpoint's data files: its own, and those it references in other checkpoints of its root.

A checkpoint that reuses an earlier one's bytes lists the earlier data files under ``references``
(``<checkpoint>/data/<name>.safetensors``); they are opened through the sibling checkpoint of
that name, the one in the same directory or under the same URL prefix. A referenced file that is
gone makes the referencing checkpoint corrupt: the message names both. A checkpoint made by an
import in place (format version 5) also reads foreign files under its external root, opened
through :mod:`resurgo.storage.external` once the load is allowed to follow them there.
"""

from __future__ import annotations

from resurgo.errors import CorruptCheckpointError
from resurgo.format.manifest import EXTERNAL_PREFIX, Manifest, is_external, split_reference
from resurgo.storage import external
from resurgo.storage.base import Checkpoint, ReadHandle


def allow_external(ckpt: Checkpoint, manifest: Manifest) -> None:
    """ExternalFilesError unless this load may read the foreign files ``manifest`` names (none: nothing to allow)."""
    ext = manifest.external
    if ext is not None and ext.files:
        external.check_allowed(ckpt.path, ext.root, ext.tagged_body(), ext.tag)


def _missing(ckpt: Checkpoint, name: str, error: CorruptCheckpointError) -> CorruptCheckpointError:
    owner, rel = split_reference(name)
    return CorruptCheckpointError(
        f"{ckpt.path}: references data file {rel} of checkpoint {owner!r} in the same root "
        f"({ckpt.sibling(owner).describe(rel)}), which is missing or damaged ({error}); that checkpoint "
        f"was deleted or altered by something other than resurgo's retention or gc")


def open_data_file(ckpt: Checkpoint, manifest: Manifest, name: str) -> ReadHandle:
    """Open the data file ``name`` a chunk of ``manifest`` names, own, referenced or foreign."""
    if name in manifest.files:
        return ckpt.open_read(name)
    if is_external(name) and manifest.external is not None:
        allow_external(ckpt, manifest)
        return external.open_read(ckpt.path, manifest.external.root, name[len(EXTERNAL_PREFIX):])  # type: ignore[return-value]
    owner, rel = split_reference(name)
    try:
        return ckpt.sibling(owner).open_read(rel)
    except CorruptCheckpointError as e:
        raise _missing(ckpt, name, e) from None


def check_sizes(ckpt: Checkpoint, manifest: Manifest) -> None:
    """Every data file the manifest lists or references exists with its declared size; else
    CorruptCheckpointError. Called before anything is allocated."""
    ckpt.check_sizes({name: f.bytes for name, f in manifest.files.items()})
    if manifest.external is not None and manifest.external.files:
        allow_external(ckpt, manifest)
        for rel, ef in sorted(manifest.external.files.items()):
            external.check_size(ckpt.path, manifest.external.root, rel, ef.bytes)
    by_owner: dict[str, dict[str, tuple[str, int]]] = {}
    for name, f in manifest.references.items():
        owner, rel = split_reference(name)
        by_owner.setdefault(owner, {})[rel] = (name, f.bytes)
    for owner, files in sorted(by_owner.items()):
        sibling = ckpt.sibling(owner)
        for rel, (name, size) in sorted(files.items()):
            try:
                sibling.check_sizes({rel: size})
            except CorruptCheckpointError as e:
                raise _missing(ckpt, name, e) from None
