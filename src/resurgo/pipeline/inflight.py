"""The one asynchronous save in flight, and what happens to its errors.

At most one asynchronous save runs at a time per process. A new save (synchronous or not) first
settles the previous one: it waits for it (or raises ``SaveInFlightError`` with
``if_busy="raise"``), and if it failed and nobody has seen its error yet, raises that error. At
interpreter exit, a save still in flight is waited for, so it commits; an error nobody saw is
raised there (Python prints it) rather than lost.
"""

from __future__ import annotations

import atexit
import threading
from typing import Protocol

from resurgo.errors import SaveInFlightError


class InFlight(Protocol):
    path: str

    def done(self) -> bool: ...

    def _settle(self) -> None:
        """Wait for the save to end; raise its error if it failed and the error was not seen."""


_lock = threading.Lock()
_current: InFlight | None = None


def settle(if_busy: str = "wait") -> None:
    """Make way for a new save: wait for (or refuse, with "raise") the one in flight."""
    if if_busy not in ("wait", "raise"):
        raise ValueError(f"if_busy must be 'wait' or 'raise', not {if_busy!r}")
    global _current
    with _lock:
        previous = _current
    if previous is None:
        return
    if if_busy == "raise" and not previous.done():
        raise SaveInFlightError(f"an asynchronous save to {previous.path} is still running (if_busy='raise')")
    try:
        previous._settle()
    finally:
        with _lock:
            if _current is previous:
                _current = None


def register(handle: InFlight) -> None:
    global _current
    with _lock:
        _current = handle


@atexit.register
def _at_exit() -> None:
    settle("wait")
