"""The manager's janitor: one background thread for deletions and tier copies, the removal of the
staging leftovers (interrupted saves, copies and deletions) a root holds when a manager starts,
and the warning of the deletions' errors, the same on every rank.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path

from resurgo.errors import ResurgoWarning
from resurgo.manager.catalog import INCOMPLETE, TEMPORARY, Entry, remove, scan
from resurgo.storage.base import Root

log = logging.getLogger("resurgo.manager")


class Janitor:
    """Runs jobs one after another in a background thread that lives only while there is work.

    Not a daemon: an interpreter exiting normally finishes the deletions it started (they are
    crash-safe anyway). Errors are kept for the owner's thread to report.
    """

    def __init__(self) -> None:
        self._jobs: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="resurgo-manager-janitor", daemon=False)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            try:
                job()
            except Exception as e:  # noqa: BLE001 - reported by the owner's next call
                with self._lock:
                    self._errors.append(e)

    def join(self) -> None:
        while True:
            with self._lock:
                thread = self._thread
            if thread is None:
                return
            thread.join()

    def take_errors(self) -> list[BaseException]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def clear_leftovers(self, store: Root) -> None:
        """Queue the removal of what an interrupted save, copy or deletion left in ``store`` (where
        saves write in place: a checkpoint without manifest; one job per root, so none is still
        running)."""
        for entry in scan(store):
            if entry.status == TEMPORARY or (entry.status == INCOMPLETE and store.saves_in_place):
                self.submit(functools.partial(remove_leftover, store, entry))


def remove_leftover(store: Root, entry: Entry) -> None:
    log.info("removing leftover %s", entry.location)
    remove(store, entry.name)


class DeletionErrors:
    """The errors of ``janitor``'s jobs (deletions: retention runs on one rank per root), warned
    once as one ResurgoWarning, the same text on every rank."""

    def __init__(self, janitor: Janitor, root: Path | str, world_size: int) -> None:
        self._janitor, self._root, self._world_size = janitor, root, world_size
        self._errors: list[str] = []  # warned on every rank by the next agreement

    def reap(self, now: bool = False) -> None:
        """Take the janitor's errors. Alone, or ``now`` (closing: no collective left to agree
        them in), warn them here; else every rank warns them alike once the next agreement has
        gathered them (:meth:`take`, then :meth:`warn`)."""
        self._errors += [f"{type(e).__name__}: {e}" for e in self._janitor.take_errors()]
        if now or self._world_size == 1:
            self.warn([list(self._errors)], stacklevel=4)
            self._errors.clear()

    def take(self) -> list[str]:
        """This rank's errors not yet warned, for an agreement to gather."""
        errors, self._errors = self._errors, []
        return errors

    def warn(self, errors: list[list[str]], stacklevel: int) -> None:
        """One ResurgoWarning for every rank's deletion errors (the same text on every rank)."""
        lines = [f"{'' if len(errors) == 1 else f'rank {r}: '}{e}" for r, es in enumerate(errors) for e in es]
        if lines:
            warnings.warn(f"resurgo: retention in {self._root} could not delete everything it chose ({'; '.join(lines)}); "
                          "the checkpoints saved are committed and what was not deleted stays in place (retention "
                          "tries again after the next commit, `resurgo gc` removes it by hand); should_stop is not set",
                          ResurgoWarning, stacklevel=stacklevel)
