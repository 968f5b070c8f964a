"""Foreign files outside a checkpoint that an import in place reads tensor bytes from.

A checkpoint made by ``import_checkpoint(..., in_place=True)`` (format version 5) names files under
a *source root* recorded in its manifest. A manifest is input like any other: one naming
``/etc/shadow`` or ``~/.ssh/id_ed25519`` as a source file would read them into a tensor. So a
load follows these names only when both hold:

1. the caller allows the root: either the checkpoint carries a valid *tag* (an HMAC-SHA256 of the
   root and the files' names and sizes under a key only this user can read, written by the import:
   "made by this user, for this root"), or the root lies under a directory the caller lists in the
   environment variable ``RESURGO_EXTERNAL_ROOTS`` (``os.pathsep``-separated; for a checkpoint
   received from elsewhere whose source the user has checked);
2. every file, its path resolved with symbolic links followed, lies inside the root, resolved the
   same way, and is a regular file; it is opened without following a link and checked to be the
   file resolved.

Anything else is :class:`~resurgo.errors.ExternalFilesError`, before a byte is read. The key is 32
random bytes in ``$RESURGO_KEY_FILE``, by default ``$XDG_CONFIG_HOME/resurgo/import.key``
(``~/.config/...``), created mode 0600 by the first import in place. Storage does not parse
manifests: callers pass the root, the tagged bytes and the tag.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from resurgo.errors import CorruptCheckpointError, ExternalFilesError, storage_error
from resurgo.storage.local_files import ReadHandle

KEY_ENV = "RESURGO_KEY_FILE"
ROOTS_ENV = "RESURGO_EXTERNAL_ROOTS"
KEY_BYTES = 32


def key_path() -> Path:
    """Where this user's key is (``$RESURGO_KEY_FILE``, else under the XDG config directory)."""
    explicit = os.environ.get(KEY_ENV)
    if explicit:
        return Path(explicit)
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "resurgo" / "import.key"


def _read_key(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        # A key others can read or replace proves nothing about who made a checkpoint.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    return key if len(key) == KEY_BYTES else None


def user_key(create: bool) -> bytes | None:
    """This user's key; made (mode 0600) when ``create`` and there is none. None where there is
    none, or it cannot be made, or it is not private to this user."""
    path = key_path()
    key = _read_key(path)
    if key is not None or not create:
        return key
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # another import made it meanwhile
        return _read_key(path)
    except OSError:
        return None
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    return _read_key(path)


def make_tag(body: bytes) -> str | None:
    """The tag of ``body`` (the root and files an import in place records) under this user's key,
    made if needed; None where no key can be had (loads then need ``RESURGO_EXTERNAL_ROOTS``)."""
    key = user_key(create=True)
    return None if key is None else hmac.new(key, body, hashlib.sha256).hexdigest()


def _allowed_roots() -> list[str]:
    out = []
    for entry in os.environ.get(ROOTS_ENV, "").split(os.pathsep):
        if entry:
            try:
                out.append(os.path.realpath(entry))
            except OSError:
                continue
    return out


def _within(path: str, area: str) -> bool:
    return path == area or path.startswith(area.rstrip(os.sep) + os.sep)


def check_allowed(where: object, root: str, body: bytes, tag: str | None) -> None:
    """ExternalFilesError unless this load may read files under ``root`` (module docstring)."""
    key = user_key(create=False)
    if key is not None and tag is not None and hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest(), tag):
        return
    try:
        real = os.path.realpath(root)
    except OSError:
        real = root
    if any(_within(real, area) for area in _allowed_roots()):
        return
    why = ("it carries no tag" if tag is None else
           "its tag does not match this user's key (it was made by another user or elsewhere, or edited)")
    raise ExternalFilesError(
        f"{where}: reads tensor bytes from files under {root[:300]!r}, outside the checkpoint (an import in place), "
        f"and {why}; a checkpoint from elsewhere may not read files of this machine unless allowed. If that "
        f"source is the one you expect, allow it: {ROOTS_ENV}={root[:300]} (or a directory above it), or import "
        f"the source again yourself")


def resolve(where: object, root: str, rel: str) -> Path:
    """The real path of the foreign file ``rel`` under ``root``; ExternalFilesError when it (or a
    symlink on its way) leads outside the root, CorruptCheckpointError when it is missing or not a
    regular file."""
    try:
        base = os.path.realpath(root)
        full = os.path.realpath(os.path.join(base, rel))
    except OSError as e:
        raise storage_error(e, os.path.join(root, rel), "could not be resolved") from None
    if os.path.isabs(rel) or not _within(full, base) or full == base:
        raise ExternalFilesError(f"{where}: foreign file {rel[:200]!r} under {root[:300]!r} leads to {full[:300]}, "
                                 f"outside that root; symlinks out of the source are not followed")
    try:
        mode = os.stat(full).st_mode
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: foreign file {os.path.join(root, rel)} (read in place by this "
                                     f"checkpoint) is missing: was the source moved or deleted?") from None
    except OSError as e:
        raise storage_error(e, full, "foreign file of an import in place") from None
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError(f"{where}: foreign file {os.path.join(root, rel)} is not a regular file")
    return Path(full)


def open_read(where: object, root: str, rel: str) -> ReadHandle:
    """A handle on the foreign file ``rel`` under ``root``, opened without following a link, checked
    to be the file :func:`resolve` found (ExternalFilesError when it was swapped meanwhile)."""
    path = resolve(where, root, rel)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: foreign file {path} is missing: was the source moved or deleted?") from None
    except OSError as e:
        raise storage_error(e, path, "foreign file of an import in place") from None
    try:
        now = os.readlink(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else str(path)
        if not stat.S_ISREG(os.fstat(fd).st_mode) or now != str(path):
            raise ExternalFilesError(f"{where}: foreign file {path} was replaced while it was opened (now {now})")
    except BaseException:
        os.close(fd)
        raise
    return ReadHandle(path, f"{root}/{rel}", fd=fd)


def check_size(where: object, root: str, rel: str, expected: int) -> None:
    """CorruptCheckpointError naming the foreign file when it is not ``expected`` bytes long."""
    path = resolve(where, root, rel)
    actual = os.stat(path).st_size
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where}: foreign file {path} has {actual} bytes, the manifest says {expected}: it changed after the "
            f"import in place (truncated or rewritten); import the source again")
