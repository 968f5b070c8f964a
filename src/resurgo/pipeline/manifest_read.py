"""Reading a checkpoint's manifest: its bytes from storage, checked and parsed by format/.

Storage returns bytes and knows nothing of their meaning; format/ parses and checks bytes and
knows nothing of where they came from. Every reader of a checkpoint joins the two here, so
messages name the manifest the same way everywhere.
"""

from __future__ import annotations

from resurgo.format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from resurgo.storage.base import Checkpoint


def read_manifest_and_bytes(ckpt: Checkpoint) -> tuple[Manifest, bytes]:
    """The checkpoint's manifest, validated and checked against its own checksum, and its bytes."""
    raw = ckpt.read_manifest_bytes()
    return parse_manifest(raw, ckpt.describe(MANIFEST_NAME)), raw


def read_manifest_of(ckpt: Checkpoint) -> Manifest:
    """The checkpoint's manifest, validated and checked against its own checksum."""
    return read_manifest_and_bytes(ckpt)[0]
