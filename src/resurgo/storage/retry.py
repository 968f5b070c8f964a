"""Retrying object-store calls on transient errors, and turning failures into resurgo errors.

Transient: connection refused or reset, timeouts, throttling, server errors (anything that is not
one of the permanent failures below). They are retried with exponential backoff
(:data:`RETRY`). Permanent: no such bucket or key, access denied, a failed precondition; they
are raised at once. Either way the error that reaches the caller is a ResurgoError naming the URL.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from resurgo.errors import CheckpointNotFoundError, ResurgoError, StorageError

log = logging.getLogger("resurgo.storage")
T = TypeVar("T")


@dataclass
class RetryPolicy:
    attempts: int = 4  # in all, the first try included
    first_delay: float = 0.25  # seconds; doubled after each failure, with jitter
    max_delay: float = 4.0

    def delays(self) -> list[float]:
        return [min(self.max_delay, self.first_delay * 2 ** i) * random.uniform(0.8, 1.2)
                for i in range(max(0, self.attempts - 1))]


RETRY = RetryPolicy()


def is_precondition_failure(e: BaseException) -> bool:
    """A conditional write refused because the object exists (S3 412, fsspec ``mode="create"``)."""
    return isinstance(e, FileExistsError) or "pre-condition" in str(e).lower() or "precondition" in str(e).lower()


def is_permanent(e: BaseException) -> bool:
    return isinstance(e, (FileNotFoundError, PermissionError, NotImplementedError, ValueError, TypeError,
                          ResurgoError)) or is_precondition_failure(e)


def as_resurgo_error(e: BaseException, url: str, doing: str) -> ResurgoError:
    """The error to raise for ``e`` met while ``doing`` at ``url``."""
    if isinstance(e, ResurgoError):
        return e
    text = str(e) or type(e).__name__
    if isinstance(e, FileNotFoundError):
        if "bucket" in text.lower():
            return CheckpointNotFoundError(f"{url}: no such bucket ({text}) while {doing}")
        return CheckpointNotFoundError(f"{url}: not found while {doing}: {text}")
    if isinstance(e, PermissionError):
        return StorageError(errno.EACCES, f"{url}: access denied while {doing}: {text}")
    code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
    return StorageError(code, f"{url}: {doing} failed: {type(e).__name__}: {text}")


def with_retries(call: Callable[[], T], url: str, doing: str, policy: RetryPolicy | None = None) -> T:
    """``call()``, retried with backoff on transient errors; failures become ResurgoErrors."""
    policy = policy or RETRY
    delays = policy.delays()
    for attempt in range(len(delays) + 1):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - classified below
            if is_permanent(e) or attempt == len(delays):
                err = as_resurgo_error(e, url, doing)
                if attempt and not is_permanent(e):
                    err = StorageError(getattr(err, "errno", None) or errno.EIO,
                                       f"{err} (gave up after {attempt + 1} attempts)")
                raise err from e
            log.warning("resurgo: %s at %s failed (%s: %s); retrying in %.2f s", doing, url,
                        type(e).__name__, e, delays[attempt])
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")
