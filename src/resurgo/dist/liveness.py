"""Liveness of a job's ranks: heartbeats, progress, and waits that end when a rank fails.

This module owns telling a rank that is dead or stuck from one that is slow but working, and the
waits of resurgo's collectives built on it. Each process of a job of several ranks publishes on
the job's store (keys under ``resurgo/``), once a second, a record of its own: a heartbeat count,
a progress count (:func:`progress`, bumped at each chunk or file written or read), the collectives
it reached, what it is doing (:func:`operation`, :func:`phase`), its host and pid.

Before each blocking collective every rank announces its arrival on the store and waits there, not
inside gloo (:func:`arrive`). Rank 0 watches every rank not yet arrived; the others watch rank 0.
A rank has failed when its heartbeats stop for :data:`HEARTBEAT_LIMIT` seconds (dead or stopped;
a dead process on this host is seen at once), or when it neither arrives nor makes progress for
the collective timeout while the others wait for it: ``RESURGO_COLLECTIVE_TIMEOUT`` seconds
(default 120), or :func:`set_collective_timeout`. The first verdict, or "every rank arrived", is
stored once for that collective (compare-and-set), so every rank leaves it with the same outcome;
the first verdict is also the job's, with which every later wait of every rank ends at once.
Rank 0 hosts the store: stopped, it answers nothing and TCPStore's calls would wait forever, so a
watchdog cuts this process's connections to the store once a call waited past the heartbeat limit.
The gloo collective that follows an arrival, and point-to-point transfers, are waited for with the
same checks (:func:`run_collective`, :func:`wait_requests`): a rank that stops inside one is named
within the heartbeat limit, not at gloo's timeout. A rank waiting on its peers is not stuck itself
(it watches them).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

from resurgo.errors import RankFailedError, UnsupportedValueError
from resurgo.wording import on_ranks

ENV = "RESURGO_COLLECTIVE_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
HEARTBEAT_LIMIT = 15.0  # seconds without a heartbeat before a rank is declared dead or stopped
BEAT_PERIOD = 1.0

_timeout: float | None = None
_progress = [0]  # a lost increment under a race is harmless: only a change is looked at
_activities: dict[int, list[str]] = {}  # thread ident -> [operation, phase, checkpoint]
_lock = threading.Lock()
_job: _Job | None = None
_groups_seen = 0


def collective_timeout() -> float:
    """Seconds a collective waits for a rank that neither arrives nor makes progress."""
    if _timeout is not None:
        return _timeout
    raw = os.environ.get(ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    return _positive(raw, ENV)


def set_collective_timeout(seconds: float | None) -> None:
    """Set this process's collective timeout (None: back to ``RESURGO_COLLECTIVE_TIMEOUT``)."""
    global _timeout
    _timeout = None if seconds is None else _positive(seconds, "collective_timeout")


def _positive(value: object, name: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise UnsupportedValueError(f"{name}={value!r}: expected a positive, finite number of seconds")
    return seconds


def progress() -> None:
    """This rank made progress (a chunk or file written or read): it is slow, not stuck."""
    _progress[0] += 1


@contextlib.contextmanager
def operation(name: str, checkpoint: object, collective: bool = True) -> Iterator[None]:
    """Within it, this thread does ``name`` ("save", "load", ...) on ``checkpoint``: what the other
    ranks' errors will name if this rank falls silent, and what this rank's errors name.
    ``collective=False``: a call this rank makes alone, kept in its record afterwards, so that
    ranks waiting for it in a collective of the same call raise the mismatch (:class:`_Watch`)."""
    tid = threading.get_ident()
    before = _activities.get(tid)
    _activities[tid] = [name, "", str(checkpoint)]
    job = _job
    if not collective and job is not None:
        job.alone = {"operation": name, "checkpoint": str(checkpoint), "reached": dict(job.reached)}
    _announce()
    try:
        yield
    finally:
        if before is None:
            _activities.pop(tid, None)
        else:
            _activities[tid] = before


def phase(name: str) -> None:
    """This thread's operation entered phase ``name`` ("plan", "write", "commit", ...)."""
    activity = _activities.get(threading.get_ident())
    if activity is not None:
        activity[1] = name
        _announce()


def _announce() -> None:
    """Publish this rank's record now, not at the next heartbeat: a rank that falls silent right
    after is named with what it was doing."""
    job = _job
    if job is not None:
        with contextlib.suppress(Exception):  # a store that does not answer is the watchers' to judge
            job.publish(job.client())


def call_tag() -> dict:
    """What this thread's collective is part of, for the ranks to compare: its operation and
    checkpoint (empty outside one), this host and pid, and the last call this rank made alone."""
    op, _, ckpt = _activities.get(threading.get_ident(), ["", "", ""])
    job = _job
    if job is None:
        return {"operation": op, "checkpoint": ckpt, "host": socket.gethostname(), "pid": os.getpid(), "alone": None}
    return {"operation": op, "checkpoint": ckpt, "host": job.host, "pid": job.pid, "alone": job.alone}


def check_same_call(tags: Sequence[dict]) -> None:
    """UnsupportedValueError, the same on every rank given the same ``tags`` (every rank's
    :func:`call_tag`, by rank), when ranks meet in one collective from different calls: one rank's
    load paired with another's save, most often after a rank made alone (collective=False) the
    call the others made together. Tags without an operation are not compared."""
    if len({t["operation"] for t in tags if t["operation"]}) <= 1:
        return
    calls = {(t["operation"], t["checkpoint"]) for t in tags}
    alone = [f"rank {r} (host {t['host']}, pid {t['pid']}) made {t['alone']['operation']} of "
             f"{t['alone']['checkpoint']} alone (collective=False)"
             for r, t in enumerate(tags) if t["alone"] and (t["alone"]["operation"], t["alone"]["checkpoint"])
             in calls and (t["alone"]["operation"], t["alone"]["checkpoint"]) != (t["operation"], t["checkpoint"])]
    error = UnsupportedValueError(
        "ranks met in one collective from different calls: "
        + on_ranks([(t["operation"] or "no resurgo operation") + (f" of {t['checkpoint']}" if t["checkpoint"] else "")
                    for t in tags])
        + (f"; {'; '.join(alone)}, while the others called it collectively" if alone else "")
        + ". Every rank makes the same collective calls in the same order, with the same collective=")
    error.agreed = True  # type: ignore[attr-defined]  # raised alike on every rank: not agreed again
    raise error


def _doing() -> list[str]:
    """This thread's [operation, phase, checkpoint]; else the latest of any thread's."""
    here = _activities.get(threading.get_ident())
    if here is not None:
        return list(here)
    latest = list(_activities.values())[-1:]
    return list(latest[0]) if latest else ["", "", ""]


def _identity() -> str:
    """Processes with the same identity share a pid space: one's pid can be checked by another."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return "|".join(parts)


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


class _Job:
    """This process's heartbeat and its clients of the job's store."""

    def __init__(self, store: Any, rank: int, size: int, prefix: str):
        self.rank, self.size, self.prefix = rank, size, prefix
        self._store, self._local = store, threading.local()
        self.identity, self.host, self.pid = _identity(), socket.gethostname(), os.getpid()
        self.beats = 0
        self.reached: dict[str, int] = {}  # channel -> collectives reached
        self.failed: dict[int, dict] = {}  # ranks found failed: final, later waits on them end at once
        self.transfers = 0  # point-to-point waits in progress: waiting on peers that it watches
        self.alone: dict | None = None  # the last call made alone (collective=False), after which collectives
        self.stopped = threading.Event()
        self.where, self.port = _where(store)
        self.calls: dict[int, float] = {}  # thread ident -> when its store call began
        self.cut = ""  # why the watchdog cut the connections to the store, once it did
        self.publish(self.client())
        self._thread = threading.Thread(target=self._beat, name="resurgo-heartbeat", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch_store, name="resurgo-store-watchdog", daemon=True)
        self._watchdog.start()

    def client(self) -> Any:
        """This thread's connection to the store: a wait on one thread never delays the heartbeat."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = _Timed(_clone(self._store), self.calls)
            self._local.client = client
        return client

    def _watch_store(self) -> None:
        """Cut this process's connections to the store once a call on one has waited past the
        heartbeat limit: the store's host is stopped (TCPStore's timeout bounds waits for a key,
        not a server that never answers), and every call then fails at once, naming it."""
        while not self.stopped.wait(BEAT_PERIOD):
            now = time.monotonic()
            if self.port is not None and any(now - t > HEARTBEAT_LIMIT + 2 * BEAT_PERIOD
                                             for t in list(self.calls.values())):
                self.cut = f"no answer for {HEARTBEAT_LIMIT + 2 * BEAT_PERIOD:.0f} s"
                _cut_connections(self.port)

    def key(self, name: str) -> str:
        return self.prefix + name

    def publish(self, store: Any) -> None:
        self.beats += 1
        op, ph, ckpt = _doing()
        record = {"beat": self.beats, "progress": _progress[0], "reached": self.reached, "operation": op,
                  "phase": ph, "checkpoint": ckpt, "host": self.host, "pid": self.pid, "identity": self.identity,
                  "transfers": self.transfers, "alone": self.alone}
        store.set(self.key(f"beat/{self.rank}"), json.dumps(record))

    def _beat(self) -> None:
        store = self.client()
        while not self.stopped.wait(BEAT_PERIOD):
            with contextlib.suppress(Exception):  # a store that does not answer is the watchers' to judge
                self.publish(store)

    def declare(self, store: Any, failed: list[dict]) -> list[dict]:
        """Store ``failed`` as the job's verdict unless one was stored first; the stored one."""
        return list(json.loads(store.compare_set(self.key("failed"), "", json.dumps(failed))))

    def verdict(self, store: Any) -> list[dict] | None:
        """The job's verdict, once any rank found one failed (every wait then ends with it)."""
        key = self.key("failed")
        return list(json.loads(store.get(key))) if store.check([key]) else None

    def records(self, ranks: Sequence[int]) -> dict[int, dict]:
        """The latest records of ``ranks`` (those that published one)."""
        store = self.client()
        keys = [self.key(f"beat/{r}") for r in ranks]
        if store.check(keys):
            raw = dict(zip(ranks, store.multi_get(keys)))
        else:  # some have not published yet: a get would wait for them
            raw = {r: store.get(k) for r, k in zip(ranks, keys) if store.check([k])}
        return {r: json.loads(v) for r, v in raw.items()}


def _clone(store: Any) -> Any:
    import torch.distributed as dist

    base = store
    while not isinstance(base, dist.TCPStore) and hasattr(base, "underlying_store"):
        base = base.underlying_store
    if not isinstance(base, dist.TCPStore):
        return store  # another kind of store: shared, with its own timeout
    client: Any = cast(Any, base).clone()  # a new connection to the same server (untyped in torch)
    client.set_timeout(timedelta(seconds=HEARTBEAT_LIMIT))  # a store that stops answering is found
    return client


class _Timed:
    """A store client whose calls in progress are listed (thread ident -> start), for the watchdog."""

    def __init__(self, client: Any, calls: dict[int, float]):
        self._client, self._calls = client, calls

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            tid = threading.get_ident()
            self._calls[tid] = time.monotonic()
            try:
                return method(*args, **kwargs)
            finally:
                self._calls.pop(tid, None)

        return timed


def _cut_connections(port: int) -> None:
    """Shut down every socket of this process connected to ``port`` (the store's): a call blocked
    on one returns with an error."""
    with contextlib.suppress(OSError):
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
        for fd in fds:
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                peer = sock.getpeername()
                if isinstance(peer, tuple) and len(peer) >= 2 and peer[1] == port:
                    sock.shutdown(socket.SHUT_RDWR)  # the socket itself, through this duplicate
            except OSError:
                pass
            finally:
                sock.close()


def _where(store: Any) -> tuple[str, int | None]:
    """The store's "host:port" (or kind) and its TCP port (None when it has none)."""
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    return (f"{host}:{port}" if host is not None else type(base).__name__), (port if isinstance(port, int) else None)


def start(rank: int, size: int) -> None:
    """Start this process's heartbeat on the default process group's store (once per group)."""
    global _job, _groups_seen
    import torch.distributed as dist

    with _lock:
        if _job is not None:
            _job.stopped.set()
        # The same on every rank: the launcher's restart, and how many groups this process joined.
        _groups_seen += 1
        prefix = f"resurgo/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_groups_seen}/"
        _job = _Job(dist.distributed_c10d._get_default_store(), rank, size, prefix)


def started() -> bool:
    return _job is not None


@dataclass
class _Watch:
    """What a waiting rank saw of others: when each last beat and last made progress."""

    job: _Job
    channel: str
    number: int
    since: float = field(default_factory=time.monotonic)
    seen: dict[int, tuple[int, float, int, float]] = field(default_factory=dict)
    doing: list[str] = field(default_factory=lambda: _doing())  # the waiting thread's [operation, phase, checkpoint]

    def failed(self, ranks: Iterable[int], *, arrival: bool = True) -> list[dict]:
        """The ranks among ``ranks`` that failed, each its record with a "why"; [] when none."""
        ranks = list(ranks)
        now, limit = time.monotonic(), collective_timeout()
        records = self.job.records(ranks)
        out = []
        for r in ranks:
            if r in self.job.failed:
                out.append(self.job.failed[r])
                continue
            rec = records.get(r, {"beat": -1, "progress": -1})
            if arrival and rec.get("reached", {}).get(self.channel, 0) > self.number:
                continue  # it is here: waiting with us
            if arrival and self._made_alone(rec):
                out.append({**rec, "rank": r, "call": True, "why": (
                    f"it called {self.doing[0]} of {self.doing[2]} with collective=False, while this collective "
                    f"waits for every rank to call it with collective=True; every rank passes the same "
                    f"collective= (collective=False is for a call one rank makes while the others do not)")})
                self.job.failed[r] = out[-1]
                continue
            beat, t_beat, prog, t_prog = self.seen.get(r, (rec["beat"], self.since, rec["progress"], self.since))
            if rec["beat"] != beat:
                beat, t_beat = rec["beat"], now
            if rec["progress"] != prog or rec.get("transfers"):  # waiting on peers it watches itself
                prog, t_prog = rec["progress"], now
            self.seen[r] = (beat, t_beat, prog, t_prog)
            why = ""
            if rec.get("identity") == self.job.identity and _process_gone(int(rec["pid"])):
                why = "its process has exited"
            elif now - t_beat >= HEARTBEAT_LIMIT:
                why = (f"no heartbeat for {now - t_beat:.0f} s (dead, stopped or cut off)" if rec["beat"] >= 0
                       else f"it never joined in {now - t_beat:.0f} s")
            elif now - t_prog >= limit:
                state = ("alive but made" if now - t_beat < 3 * BEAT_PERIOD
                         else f"no heartbeat for {now - t_beat:.0f} s (stopped or cut off) and")
                why = f"{state} no progress for {now - t_prog:.0f} s (the collective timeout, {ENV}, is {limit:g} s)"
            if why:
                out.append({**rec, "rank": r, "why": why})
                self.job.failed[r] = out[-1]
        return out

    def _made_alone(self, rec: dict) -> bool:
        """Whether the rank of ``rec`` made the call this collective is for alone: the same
        operation of the same checkpoint, after the same number of collectives on this channel
        (so not an earlier call of it)."""
        alone = rec.get("alone")
        return bool(alone and self.doing[0] and [alone["operation"], alone["checkpoint"]]
                    == [self.doing[0], self.doing[2]] and alone["reached"].get(self.channel, 0) == self.number)


def _describe(failed: Sequence[dict]) -> str:
    parts = []
    for f in failed:
        who = f"rank {f['rank']}"
        if "host" in f:
            who += f" (host {f['host']}, pid {f['pid']})"
        doing = f.get("operation") or "outside resurgo"
        if f.get("operation"):
            doing += (f", phase {f['phase']}" if f.get("phase") else "") + f", of {f['checkpoint']}"
        parts.append(f"{who}: {f['why']}; last seen in {doing}")
    return "; ".join(parts)


def rank_failed(failed: Sequence[dict], cause: str = "") -> RankFailedError | UnsupportedValueError:
    """The error naming the ``failed`` ranks, raised in what this thread is doing: when each of them
    made alone the call the others made collectively, UnsupportedValueError (the call is wrong,
    no rank failed), else RankFailedError."""
    op, ph, ckpt = _doing()
    context = f"{op or 'collective'}" + (f" of {ckpt}" if ckpt else "") + (f" (phase {ph})" if ph else "")
    here = f" on rank {_job.rank}" if _job is not None else ""
    message = f"{context} failed{here}: {_describe(failed) if failed else 'no rank found silent'}"
    if cause:
        message += f" [{cause}]"
    if failed and all(f.get("call") for f in failed):
        return UnsupportedValueError(message)
    return RankFailedError(message, ranks=tuple(int(f["rank"]) for f in failed), operation=op, phase=ph,
                           checkpoint=ckpt)


def _store_failed(job: _Job, error: BaseException) -> RankFailedError | UnsupportedValueError:
    host = "rank 0, which hosts it," if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" else "its host"
    return rank_failed([{"rank": 0, "why": f"the job's store at {job.where} does not answer ({job.cut or error}): "
                         f"{host} is dead or stopped"}])


def _pause(waited: int) -> float:
    """Polling pauses: short at first (a collective whose ranks are all close), then 20 ms."""
    return min(0.0002 * (2 ** min(waited, 7)), 0.02)


def arrive(channel: str) -> None:
    """Wait until every rank reached this ``channel``'s next collective; RankFailedError (the same
    on every rank) when a rank failed first. A world of one, or no heartbeat started: returns."""
    job = _job
    if job is None:
        return
    number = job.reached.get(channel, 0)
    job.reached[channel] = number + 1
    progress()
    name = f"{channel}/{number}"
    outcome_key = job.key(f"outcome/{name}")
    try:
        store = job.client()
        outcome = None
        if store.add(job.key(f"arrived/{name}"), 1) == job.size:  # the last to arrive
            outcome = store.compare_set(outcome_key, "", "ok")  # or a verdict stored just before
            if number:  # every rank has left the previous one
                store.delete_key(job.key(f"arrived/{channel}/{number - 1}"))
                store.delete_key(job.key(f"outcome/{channel}/{number - 1}"))
        watch = _Watch(job, channel, number)
        watched = [r for r in range(job.size) if r != job.rank] if job.rank == 0 else [0]
        waited, next_check = 0, time.monotonic() + BEAT_PERIOD
        while outcome is None and not store.check([outcome_key]):
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + BEAT_PERIOD
                failed = job.verdict(store) or watch.failed(watched)
                if failed:
                    outcome = store.compare_set(outcome_key, "", json.dumps(job.declare(store, failed)))
                    break
            time.sleep(_pause(waited))
            waited += 1
        if outcome is None:
            outcome = store.get(outcome_key)
    except RuntimeError as e:
        raise _store_failed(job, e) from e
    if outcome != b"ok":
        raise rank_failed(json.loads(outcome))


def diagnose(cause: BaseException, peers: Iterable[int] | None = None) -> RankFailedError | UnsupportedValueError:
    """The error for a collective or transfer that broke (``cause``, gloo's): the ranks among
    ``peers`` (default: all) found silent within a heartbeat limit, or none if all still beat."""
    job = _job
    if job is None:
        return RankFailedError(f"{_doing()[0] or 'collective'} failed: {cause}")
    ranks = [r for r in (range(job.size) if peers is None else peers) if r != job.rank]
    watch = _Watch(job, "", 0)
    deadline = time.monotonic() + HEARTBEAT_LIMIT + 2 * BEAT_PERIOD
    try:
        while True:
            store = job.client()
            failed = job.verdict(store) or watch.failed(ranks, arrival=False)
            if failed:
                return rank_failed(job.declare(store, failed), f"gloo: {cause}")
            if time.monotonic() >= deadline:
                return rank_failed([], f"gloo: {cause}")
            time.sleep(BEAT_PERIOD)
    except RuntimeError as e:
        return _store_failed(job, e)


def wait_requests(requests: Sequence[Any], peers: Iterable[int]) -> None:
    """Wait for point-to-point ``requests`` (isend/irecv) whose other ends are ``peers`` (global
    ranks): all of them, then raise the first failure. RankFailedError naming a peer that dies
    or stalls first; a transfer gloo breaks becomes RankFailedError naming the silent peers."""
    peers = sorted(set(peers))
    errors: list[BaseException] = []

    def wait_all() -> None:
        for request in requests:  # every one, even after a failure: none may land after we return
            try:
                request.wait()
            except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
                errors.append(e)

    _watched(wait_all, peers)
    if errors:
        first = errors[0]
        if isinstance(first, RuntimeError) and _job is not None and peers:
            raise diagnose(first, peers) from first
        raise first


def run_collective(run: Callable[[], None]) -> None:
    """``run()``, a gloo collective every rank has entered (after :func:`arrive`), watched: a rank
    that dies or stops inside it makes every other rank raise RankFailedError within the heartbeat
    limit, not at the group's timeout. Rank 0 watches every rank, the others rank 0 (the store's
    host) and the job's verdict, as in :func:`arrive`. A gloo error is raised as it is."""
    job = _job
    errors: list[BaseException] = []

    def call() -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
            errors.append(e)

    peers = [] if job is None else [r for r in range(job.size) if r != job.rank] if job.rank == 0 else [0]
    _watched(call, peers)
    if errors:
        raise errors[0]


def _watched(wait: Callable[[], None], peers: list[int]) -> None:
    """Run ``wait`` (which must not raise) to its end, or raise RankFailedError once a rank among
    ``peers`` failed (or the job's verdict is stored) first. While it waits this rank counts as
    waiting on peers it watches itself: not stuck, for the others' watches."""
    job = _job
    if job is None or not peers:
        wait()
        return
    # gloo tells completion only to a wait() that cannot be bounded: it runs in a thread of its
    # own while this one watches the peers (left behind, it ends when gloo gives up).
    done = threading.Event()

    def run() -> None:
        try:
            wait()
        finally:
            done.set()

    thread = threading.Thread(target=run, name="resurgo-collective-wait", daemon=True)
    thread.start()
    watch = _Watch(job, "", 0)
    job.transfers += 1
    try:
        known = [job.failed[r] for r in peers if r in job.failed]
        if known:
            raise rank_failed(known)
        while not done.wait(BEAT_PERIOD):
            store = job.client()
            failed = job.verdict(store) or watch.failed(peers, arrival=False)
            if failed:
                raise rank_failed(job.declare(store, failed))
    except RuntimeError as e:
        raise _store_failed(job, e) from e
    finally:
        job.transfers -= 1
        if not done.is_set():
            _left_behind(thread)


_behind: list[threading.Thread] = []


def _left_behind(thread: threading.Thread) -> None:
    """A wait left inside gloo after its peer failed. gloo ends it with an error once the peer's
    connections close (the peer killed); an error reaching it while the interpreter finalizes
    aborts the process ("terminate called"), so exit waits a moment for it first."""
    with _lock:
        if not _behind:
            atexit.register(_join_left_behind)
        _behind.append(thread)


def _join_left_behind(seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    for thread in list(_behind):
        thread.join(max(0.0, deadline - time.monotonic()))
