"""Coordination over torch.distributed: gather, broadcast, and agreeing on success or failure.

This module owns every collective resurgo makes. Only small Python objects (plans, checksums,
error descriptions) travel through it, never tensor data. Collectives run on a gloo group of
resurgo's own, created once, so they work beside NCCL training and from a background thread
(asynchronous saves) without interleaving with the training's own collectives. Alone (no
process group), every call is a local no-op with rank 0 of a world of 1. :func:`sent_bytes`
counts what this process put into each kind of collective, to measure the protocols built on it.

A rank that dies or stalls never leaves the others inside a collective: each collective first
waits on the job's store until every rank arrived (:func:`resurgo.dist.liveness.arrive`), and a
gloo error becomes :class:`RankFailedError` naming the silent ranks.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from resurgo import errors, faults
from resurgo.dist import liveness
from resurgo.errors import RankFailedError, ResurgoError

T = TypeVar("T")
_lock = threading.Lock()
_groups: dict[tuple[int, str], Any] = {}
_alone = threading.local()
_started: dict[int, bool] = {}  # default groups whose heartbeat runs
_sent = {"gather": 0, "all_gather": 0, "broadcast": 0}  # pickled bytes this process sent, by collective


def sent_bytes() -> dict[str, int]:
    """Pickled bytes this process has sent in each kind of collective (a broadcast counts on the
    sending rank), since it started; a world of one sends nothing."""
    with _lock:
        return dict(_sent)


def _pickled(kind: str, obj: object) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    with _lock:
        _sent[kind] += len(payload)
    return payload


@dataclass(frozen=True)
class Comm:
    rank: int
    size: int
    group: Any = None  # None: a world of one
    channel: str = "io"

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        payload = _pickled("gather", obj)
        self._collective(lambda: dist.gather_object(payload, out, dst=_global_rank(self.group, 0), group=self.group))
        return None if out is None else [pickle.loads(b) for b in out]

    def all_gather(self, obj: T) -> list[T]:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        # Each rank's call travels with its object: ranks that meet here from different calls all
        # raise the same error (every rank sees every tag), not a misreading of each other's objects.
        payload = _pickled("all_gather", (liveness.call_tag(), obj))
        self._collective(lambda: dist.all_gather_object(out, payload, group=self.group))
        tagged = [pickle.loads(b) for b in out]
        liveness.check_same_call([tag for tag, _ in tagged])
        return [o for _, o in tagged]

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box: list[Any] = [_pickled("broadcast", obj) if self.rank == 0 else None]
        self._collective(lambda: dist.broadcast_object_list(box, src=_global_rank(self.group, 0), group=self.group))
        return obj if self.rank == 0 else pickle.loads(box[0])

    def _collective(self, run: Callable[[], None]) -> None:
        """``run()``, a gloo collective, once every rank has arrived; a failure of gloo or of a
        rank becomes RankFailedError."""
        liveness.arrive(self.channel)
        faults.point("collective.entered")
        try:
            liveness.run_collective(run)
        except RuntimeError as e:
            raise liveness.diagnose(e) from e

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's ``rank`` (what point-to-point calls take)."""
        return _global_rank(self.group, rank)

    def agree(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` here; if it failed on any rank, every rank raises the same error (the first
        failing rank's, naming that rank). Collective: every rank must call it."""
        return self.agree_noting(lambda: (fn(), None))[0]

    def agree_noting(self, fn: Callable[[], tuple[T, Any]], call: Any = None,
                     check_call: Callable[[list[Any]], None] | None = None) -> tuple[T, list[Any]]:
        """:meth:`agree` for an ``fn`` returning (result, note): with the result, every rank's
        note, gathered in the same collective as the outcomes. ``call``: this rank's arguments,
        gathered with its outcome even when ``fn`` failed; every rank first runs ``check_call`` on
        every rank's ``call``, so ranks that passed different arguments all raise its error (the
        same, from the same values), not one rank's failure that the difference may have caused."""
        outcome: tuple[Any, Any, Any] = (None, None, call)  # (failure, note, call)
        result: Any = None
        original: BaseException | None = None
        try:
            result, note = fn()
            outcome = (None, note, call)
        except BaseException as e:  # noqa: BLE001 - reported to every rank, then raised
            if getattr(e, "agreed", False):  # every rank raised it already, in one collective
                raise
            original = e
            outcome = ((type(e).__name__, str(e), self.rank, _fields(e)), None, call)
        if self.size == 1:
            if original is not None:
                raise original
            return result, [outcome[1]]
        every = self.all_gather(outcome)
        if check_call is not None:
            check_call([c for _, _, c in every])
        # The first rank's failure, unless it is only the consequence of another's (bytes received
        # from a rank that could not read them): the cause is raised on every rank.
        failures = sorted((f for f, _, _ in every if f is not None), key=lambda f: bool(f[3].get("secondary")))
        if failures:
            raise _rebuild(*failures[0]) from original
        return result, [n for _, n, _ in every]


def _global_rank(group: Any, group_rank: int) -> int:
    import torch.distributed as dist

    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _fields(e: BaseException) -> dict[str, Any]:
    """What of ``e`` besides its class and message the other ranks rebuild: an OSError's errno
    (a disk failing on one rank is a StorageError on every rank), a RankFailedError's fields, and
    whether it is only the consequence of another rank's failure ("secondary")."""
    fields: dict[str, Any] = {"secondary": True} if getattr(e, "secondary", False) else {}
    if isinstance(e, OSError):
        fields["errno"] = e.errno
    if isinstance(e, RankFailedError):
        fields.update(ranks=e.ranks, operation=e.operation, phase=e.phase, checkpoint=e.checkpoint)
    return fields


def _rebuild(name: str, message: str, rank: int, fields: dict[str, Any]) -> BaseException:
    """The same error on every rank: of the same class when it is one of ours; a StorageError
    for an OSError (a rank's disk full, failing or refusing); else RankFailedError naming the
    rank where it arose."""
    # An error agreed before (a background save's, raised again by the next call) names its rank already.
    text = message if re.match(r"rank \d+ failed: ", message) else f"rank {rank} failed: {message}"
    cls = getattr(errors, name, None)
    if "errno" in fields and not (isinstance(cls, type) and issubclass(cls, ResurgoError)):
        cls = errors.StorageError
    error: BaseException | None = None
    if isinstance(cls, type) and issubclass(cls, ResurgoError):
        try:
            error = cls(text, **{k: v for k, v in fields.items() if k not in ("errno", "secondary")})
        except TypeError:  # a class whose constructor needs more than a message
            error = None
    if error is None:
        return RankFailedError(f"{text} ({name})", ranks=(rank,))
    if isinstance(error, OSError) and fields.get("errno") is not None:
        error.errno = fields["errno"]
    return error


def _start_heartbeat(default: Any) -> None:
    """This process's heartbeat on ``default``'s store, once per default group (not collective:
    each rank starts it at its first collective or call alone, whichever comes first)."""
    import torch.distributed as dist

    if not _started.get(id(default)):
        liveness.start(dist.get_rank(), dist.get_world_size())
        _started[id(default)] = True


def _heartbeat() -> None:
    """Start the heartbeat if this process is one of a job of several ranks."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with _lock:
            _start_heartbeat(dist.group.WORLD)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within it, :func:`current` is a world of one in this thread: a save or load made by one
    process of a job on its own (Lightning saves from global rank 0 only), which would otherwise
    wait forever for the other ranks to join its collectives."""
    _heartbeat()  # the other ranks see what this one does alone (a collective call it missed)
    before = getattr(_alone, "on", False)
    _alone.on = True
    try:
        yield
    finally:
        _alone.on = before


def current(channel: str = "io") -> Comm:
    """This process's place in the job: the default process group, or a world of one.

    ``channel`` names a gloo group of its own: "io" for saves and loads (an asynchronous save
    commits from its background thread), "control" for decisions made on the training thread
    (the CheckpointManager's), so collectives of two threads never pair up across ranks.
    """
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return Comm(0, 1)
    if getattr(_alone, "on", False) or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Comm(0, 1)
    default = dist.group.WORLD
    with _lock:
        group = _groups.get((id(default), channel))
        if group is None:
            _start_heartbeat(default)
            # Collective: every rank creates it at its first use, in the same program order. Its
            # timeout bounds what every rank entered; a receive posted before its sender's writes
            # (replication) may wait that long, so it stays at least gloo's 30 minutes.
            timeout = timedelta(seconds=max(1800.0, liveness.collective_timeout() + liveness.HEARTBEAT_LIMIT))
            group = dist.new_group(backend="gloo", timeout=timeout)
            _groups[(id(default), channel)] = group
    return Comm(dist.get_rank(), dist.get_world_size(), group, channel)
