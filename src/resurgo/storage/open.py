"""Choosing the backend for a checkpoint or a root of checkpoints: a local path, or an fsspec URL
(``s3://...``). The one place that tells the two apart."""

from __future__ import annotations

import os

from resurgo.errors import UnsupportedValueError
from resurgo.storage.base import Checkpoint, Root
from resurgo.storage.local import CheckpointDir, LocalRoot

FILE_SCHEME = "file://"


def is_url(path: str | os.PathLike) -> bool:
    """True for a URL other than ``file://`` (which is a local path)."""
    return isinstance(path, str) and "://" in path and not path.startswith(FILE_SCHEME)


def local_path(path: str | os.PathLike) -> str | os.PathLike:
    return path[len(FILE_SCHEME):] if isinstance(path, str) and path.startswith(FILE_SCHEME) else path


def open_checkpoint(path: str | os.PathLike, storage_options: dict | None = None) -> Checkpoint:
    """The checkpoint at ``path``: a directory, or a prefix of an object store given as a URL.
    ``storage_options`` go to fsspec (credentials, ``endpoint_url``, ...); URLs only."""
    if is_url(path):
        from resurgo.storage.fsspec_store import ObjectCheckpoint  # fsspec is imported only when used

        return ObjectCheckpoint(str(path), storage_options)
    if storage_options:
        raise UnsupportedValueError(f"{path}: storage_options apply to URLs (s3://...), not to a local path")
    return CheckpointDir(local_path(path))


def open_root(path: str | os.PathLike, storage_options: dict | None = None) -> Root:
    """The root of checkpoints at ``path``: a directory, or a prefix of an object store given as
    a URL (``storage_options`` as for :func:`open_checkpoint`)."""
    if is_url(path):
        from resurgo.storage.fsspec_store import ObjectRoot  # fsspec is imported only when used

        return ObjectRoot(str(path), storage_options)
    if storage_options:
        raise UnsupportedValueError(f"{path}: storage_options apply to URLs (s3://...), not to a local path")
    return LocalRoot(local_path(path))


def join(base: str | os.PathLike, name: str) -> str | os.PathLike:
    """``base/name`` for a URL or a local path."""
    if is_url(base):
        return f"{str(base).rstrip('/')}/{name}"
    from pathlib import Path

    return Path(local_path(base)) / name
