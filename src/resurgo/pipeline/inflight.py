"""The one asynchronous save in flight, and what happens to its errors.

At most one asynchronous save runs at a time per process. A new save (synchronous or not) first
settles the previous one: it waits for it (or raises ``SaveInFlightError`` with
``if_busy="raise"``), and if it failed and nobody has seen its error yet, raises that error. At
interpreter exit, a save still in flight is waited for, so it commits; an error nobody saw is
raised there (Python prints it) rather than lost.

In a job of several ranks, whether the previous save is still running flips at a slightly
different moment on each rank, so an asynchronous save agrees on it (:func:`settle` with a
``comm``): with ``if_busy="raise"`` every rank raises, or none does.
"""

from __future__ import annotations

import atexit
import threading
from typing import Protocol

from resurgo.dist.call import check_same
from resurgo.dist.comm import Comm
from resurgo.errors import SaveInFlightError


class InFlight(Protocol):
    path: str

    def done(self) -> bool: ...

    def _settle(self) -> None:
        """Wait for the save to end; raise its error if it failed and the error was not seen."""


_lock = threading.Lock()
_current: InFlight | None = None


def settle(if_busy: str = "wait", comm: Comm | None = None, path: str = "") -> None:
    """Make way for a new save (to ``path``): wait for (or refuse, with "raise") the one in flight.

    ``comm``: the ranks of the new save agree, in one collective of that channel (one the
    background commit does not use), on ``if_busy`` and on whether a save is still running on
    any of them: with "raise", every rank raises SaveInFlightError naming the busy ranks, or none
    does."""
    if if_busy not in ("wait", "raise"):
        raise ValueError(f"if_busy must be 'wait' or 'raise', not {if_busy!r}")
    global _current
    with _lock:
        previous = _current
    busy = previous is not None and not previous.done()
    if comm is not None and comm.size > 1:
        everyone = comm.all_gather((if_busy, busy))
        check_same("asynchronous save", path, ("if_busy",), [(choice,) for choice, _ in everyone])
        running = [rank for rank, (_, b) in enumerate(everyone) if b]
        if if_busy == "raise" and running:
            raise SaveInFlightError(f"{path}: not saved: the previous asynchronous save is still running on "
                                    f"rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} "
                                    "(if_busy='raise'); every rank skips this save")
    elif if_busy == "raise" and busy:
        assert previous is not None
        raise SaveInFlightError(f"an asynchronous save to {previous.path} is still running (if_busy='raise')")
    if previous is None:
        return
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
