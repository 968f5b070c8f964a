"""A checkpoint's data files: its own, and those it references in other checkpoints of its root.

A checkpoint that reuses an earlier one's bytes lists the earlier data files under ``references``
(``<checkpoint>/data/<name>.safetensors``); they are opened through the sibling checkpoint of
that name, the one in the same directory or under the same URL prefix. A referenced file that is
gone makes the referencing checkpoint corrupt: the message names both.
"""

from __future__ import annotations

from resurgo.errors import CorruptCheckpointError
from resurgo.format.manifest import Manifest, split_reference
from resurgo.storage.base import Checkpoint, ReadHandle


def _missing(ckpt: Checkpoint, name: str, error: CorruptCheckpointError) -> CorruptCheckpointError:
    owner, rel = split_reference(name)
    return CorruptCheckpointError(
        f"{ckpt.path}: references data file {rel} of checkpoint {owner!r} in the same root "
        f"({ckpt.sibling(owner).describe(rel)}), which is missing or damaged ({error}); that checkpoint "
        f"was deleted or altered by something other than resurgo's retention or gc")


def open_data_file(ckpt: Checkpoint, manifest: Manifest, name: str) -> ReadHandle:
    """Open the data file ``name`` a chunk of ``manifest`` names, own or referenced."""
    if name in manifest.files:
        return ckpt.open_read(name)
    owner, rel = split_reference(name)
    try:
        return ckpt.sibling(owner).open_read(rel)
    except CorruptCheckpointError as e:
        raise _missing(ckpt, name, e) from None


def check_sizes(ckpt: Checkpoint, manifest: Manifest) -> None:
    """Every data file the manifest lists or references exists with its declared size; else
    CorruptCheckpointError. Called before anything is allocated."""
    ckpt.check_sizes({name: f.bytes for name, f in manifest.files.items()})
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
