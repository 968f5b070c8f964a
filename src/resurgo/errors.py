"""Every error resurgo raises on purpose.

Each class names one failure a user can foresee; messages name the file, the key and what was
expected on both sides. Where a built-in exception type fits, the class derives from it too, so
``except FileNotFoundError`` keeps working for callers that do not know resurgo.
"""

from __future__ import annotations

import copy


class ResurgoError(Exception):
    """Base of every error resurgo raises on purpose."""


class ResurgoWarning(UserWarning):
    """Something went wrong that does not undo what the call did (a checkpoint committed, whose
    retention could not delete an older one): the job may carry on."""


class CheckpointNotFoundError(ResurgoError, FileNotFoundError):
    """The path does not exist."""


class NotACheckpointError(ResurgoError):
    """The path exists but is not a resurgo checkpoint (no manifest, no data)."""


class IncompleteCheckpointError(NotACheckpointError):
    """Data files exist but the manifest was never committed (a save that did not finish)."""


class CheckpointExistsError(ResurgoError, FileExistsError):
    """Saving onto an existing path without ``overwrite=True``."""


class ForeignFilesError(CheckpointExistsError):
    """Replacing or deleting a location would touch files resurgo did not write (a file or folder
    of another name, a manifest that does not verify): refused, nothing changed."""


class ManifestError(ResurgoError, ValueError):
    """The manifest is not valid: bad JSON, wrong schema, unsafe path, inconsistent sizes."""


class CorruptCheckpointError(ResurgoError):
    """Stored bytes do not match their checksum, or a data file is truncated.

    Raised by a load, ``loaded`` lists the keys of the target's tensors that this rank filled
    (every byte of them verified) and ``untouched`` those it left exactly as they were."""

    def __init__(self, message: str, loaded: list[str] | None = None, untouched: list[str] | None = None):
        super().__init__(message)
        self.loaded = list(loaded or [])
        self.untouched = list(untouched or [])


class KeyMismatchError(ResurgoError, KeyError):
    """Keys of the target state and of the checkpoint differ (``strict=True``)."""

    def __init__(self, message: str, missing: list[str] | None = None, unexpected: list[str] | None = None):
        super().__init__(message)
        self.missing = list(missing or [])
        self.unexpected = list(unexpected or [])

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DTypeMismatchError(ResurgoError, TypeError):
    """A tensor in the checkpoint and its destination have different dtypes (never cast)."""


class ShapeMismatchError(ResurgoError, ValueError):
    """A tensor in the checkpoint and its destination have different shapes."""


class TypeMismatchError(ResurgoError, TypeError):
    """A leaf has a different kind on each side (tensor vs value, list vs tuple)."""


class UnsupportedValueError(ResurgoError, TypeError):
    """A value cannot be stored as plain data (and pickling was not allowed), or a value or a
    combination of arguments is not supported (two ways of writing one rule, given together)."""


class PickleNotAllowedError(ResurgoError):
    """The checkpoint holds pickled values and ``allow_pickle=True`` was not given."""


class SaveInFlightError(ResurgoError):
    """A new save was asked for while an asynchronous save runs, with ``if_busy="raise"``."""


class MemoryBudgetError(ResurgoError, MemoryError):
    """An operation would need more memory than its bound allows: an asynchronous snapshot's
    staging copy (``staging_bytes``), the buffers of a conversion, an import or a diff
    (``buffer_bytes``), a memory tier's node (``node_bytes``). The message names the bound."""


class StorageError(ResurgoError, OSError):
    """The storage backend failed (disk full, permission denied, I/O error)."""


def storage_error(e: OSError, where: object, what: str, then: str = "") -> StorageError:
    """The StorageError to raise for the OSError ``e``, met at ``where`` (a path, a URL, a label
    naming the file) when ``what`` failed (``"cannot open"``, ``"fsync failed after 4096 bytes"``):
    the message ``<where>: <what>: <the system's reason>``, then ``; <then>`` (what to check or do)
    when given; ``e``'s errno, so the message reads ``[Errno N] ...`` as for any OSError."""
    reason = e.strerror or str(e) or type(e).__name__
    message = f"{where}: {what}: {reason}" + (f"; {then}" if then else "")
    return StorageError(e.errno, message) if e.errno is not None else StorageError(message)


class storage_errors:
    """Within this block, an OSError becomes :func:`storage_error`'s StorageError for ``where``
    and ``what`` (and ``then``); a ResurgoError, or an error of the ``passing`` types, goes
    through unchanged (a caller handles a missing file itself, say)."""

    def __init__(self, where: object, what: str, then: str = "",
                 passing: type[BaseException] | tuple[type[BaseException], ...] = ()):
        self.where, self.what, self.then, self.passing = where, what, then, passing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        if isinstance(e, OSError) and not isinstance(e, ResurgoError) and not isinstance(e, self.passing):
            raise storage_error(e, self.where, self.what, self.then) from None


class CheckpointReplacedError(StorageError):
    """The checkpoint was replaced (saved over) again and again while being read, so no complete
    version of it could be read; a single replacement is retried and never reported."""


class ShardingError(ResurgoError, ValueError):
    """The shards the ranks declared for a tensor do not tile it exactly once, or disagree on its
    dtype or global shape."""


class WorldSizeMismatchError(ResurgoError):
    """A value saved per rank cannot be loaded by this many ranks without a resize policy."""


class RankFailedError(ResurgoError):
    """Another rank of a collective operation failed, died or stalled; every rank raises this same
    error. ``ranks``: the ranks found failed (empty when not known); ``operation``, ``phase`` and
    ``checkpoint``: what this rank was doing (empty when not known)."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), operation: str = "", phase: str = "",
                 checkpoint: str = ""):
        super().__init__(message)
        self.ranks, self.operation, self.phase, self.checkpoint = tuple(ranks), operation, phase, checkpoint


class DataPositionError(ResurgoError, ValueError):
    """A sampler's arguments are invalid, or a saved data position does not fit the sampler or
    loader it is loaded into (another dataset length or shuffle flag, a count out of range)."""


class ImportSpecError(ResurgoError, ValueError):
    """An import spec is not valid: bad JSON or schema, an unknown dtype, an unsafe path, a
    destination outside its tensor, or pieces that leave a gap or overlap (the region is named)."""


class StudyError(ResurgoError, ValueError):
    """``resurgo study`` cannot run as asked: an unknown model or mechanism, unreadable data."""


def naming_checkpoint(error: ResurgoError, source: str, key: str) -> ResurgoError:
    """``error`` again, of the same class and fields, its message starting with the checkpoint
    ``source`` and the ``key`` it was raised for (unchanged if it names the checkpoint already,
    or is an OSError, whose message is its path and errno)."""
    message = str(error)
    if isinstance(error, OSError) or message.startswith(source):
        return error
    named = copy.copy(error)
    at = f"key {key!r}: " if key else ""  # the root: the message names its part already
    named.args = (f"{source}: {at}{message}",) + error.args[1:]
    return named


class ExpansionError(ResurgoError, ValueError):
    """A conversion would write many times the bytes its source stores (chunks that share bytes):
    refused unless the caller allows the expansion."""


class BaseModelMismatchError(ResurgoError, ValueError):
    """Adapters saved without their base model (PEFT, ``AdapterOnly``) are loaded onto a base model
    whose weights differ from the one they were trained on (the two content digests differ)."""


class ExternalFilesError(ResurgoError):
    """A checkpoint made by an import in place reads tensor bytes from files outside it, and this
    load may not follow them there: the checkpoint was not made by this user for that source root
    (and the caller did not allow the root), or a path under the root leads out of it."""
