"""Preemption: the signal handlers a manager installs, and the request they (or the caller) raise.

A handler only sets a flag: it runs between two bytecodes of the training loop. The manager reads
the flag at its next ``maybe_save``, saves, and sets ``should_stop``.
"""

from __future__ import annotations

import signal
import threading
import warnings
from types import FrameType
from typing import Any


class Preemption:
    """The preemption request of one manager, and the handlers of ``signals`` that set it
    (installed only on the main thread; :meth:`uninstall` puts the previous ones back)."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self._requested = False
        self._previous_handlers: dict[int, Any] = {}
        self._install(signals)

    @property
    def requested(self) -> bool:
        return self._requested

    def request(self) -> None:
        self._requested = True

    def clear(self) -> None:
        self._requested = False

    def _install(self, signals: tuple[int, ...]) -> None:
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("resurgo: CheckpointManager created outside the main thread: no preemption signal "
                          "handler installed (Python allows them on the main thread only); call "
                          "notify_preemption() yourself", stacklevel=4)  # CheckpointManager()'s caller
            return
        for sig in signals:
            self._previous_handlers[sig] = signal.signal(sig, self.on_signal)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag here: a signal handler runs between two bytecodes of the training loop.
        self._requested = True
        previous = self._previous_handlers.get(signum)
        # Chain to a Python handler installed before us (logging, another manager), but not to
        # default actions: terminating (SIG_DFL) or raising KeyboardInterrupt would defeat the save.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous_handlers.items():
            if signal.getsignal(sig) == self.on_signal:  # only if nobody replaced ours since
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()
