"""Reading a load plan: parallel positional reads into destination memory, verified before they land.

Each read op fills a slice of either the destination's own bytes (one whole chunk) or a chunk
buffer (several chunks, assembled afterwards). No byte that fails its checksum reaches a
destination, and no tensor is changed until all of its bytes have verified: each tensor is a unit
of its own (many to a request when small, many requests to one when large), filled only once
every part of every request reading it has verified. A part is verified first, then filled:

- from a local file (a handle with ``view``: its mapping), its bytes are hashed where the page
  cache holds them, then put in place from there: the same passes over memory as reading into
  place and hashing there, and no copy of the state in between. Read by one thread, a group of
  parts about a core's cache in size is hashed, then each part copied out of the mapping while
  the group is in cache. Read by several, a whole request is hashed, then its verified parts are
  read into place by one vectored read per run of them: a copy per part lets go of the GIL once
  per part, and two threads handing it back and forth that often ran 1.2 to 2 times slower than
  one thread (on a 2-core VM), where one call per request overlaps as reading into place does;
- from other handles (an object store, a peer), it is read once into memory held until its
  tensor has verified, then copied into place.

A tensor is filled as soon as its last part verifies, by the thread that hashed that part (a
tensor of one part straight after its hash, while its bytes are in cache), so a cold read
overlaps the filling. When a part fails, the tensors already filled stay loaded and the others
are untouched; :func:`read_ops` records which in its ``loaded`` set. Each data file's
safetensors header is read and verified with the file's first data (one request on an object
store), not in a round of its own before them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from resurgo import faults
from resurgo.dist import liveness
from resurgo.errors import CorruptCheckpointError
from resurgo.format import checksum, dtypes
from resurgo.format.manifest import Manifest, TensorEntry, is_external
from resurgo.gcpause import collector_paused
from resurgo.pipeline.buffers import as_copyable, typed_view, writable_bytes
from resurgo.pipeline.data_files import open_data_file
from resurgo.plan.load_plan import MAX_PIECE_BYTES, BoxCopy, ReadOp, ReadPart, Scatter, Target, plan_reads
from resurgo.state.flatten import Array
from resurgo.state.unflatten import Destination
from resurgo.storage.base import Checkpoint, ReadHandle


@dataclass
class ReadTask:
    """What one pool thread reads in one request: ``ops`` of ``file`` back to back (gaps between
    them fetched and dropped), preceded by the file's header bytes when ``header`` is set."""

    file: str
    ops: list[ReadOp] = field(default_factory=list)
    header: bool = False


@dataclass
class ReadResult:
    bytes_read: int  # from storage
    files: list[str]
    seconds: dict[str, float]
    bytes_received: int = 0  # from other ranks (shared reads)


def place_destinations(destinations: list[Destination]) -> tuple[list[Target], list[np.ndarray], list[tuple[Array, np.ndarray]]]:
    """Every place this rank fills, its bytes (the tensor's own memory when it is one flat host
    buffer, else a staging array copied in at the end), and the staged ones."""
    targets: list[Target] = []
    bufs: list[np.ndarray] = []
    staged: list[tuple[Array, np.ndarray]] = []
    for d in destinations:
        itemsize = dtypes.itemsize(d.entry.dtype)
        for piece in d.local_pieces():
            nbytes = piece.place.numel * itemsize
            mem = writable_bytes(piece.tensor)
            if mem is None:
                mem = np.empty(nbytes, dtype=np.uint8)
                staged.append((piece.tensor, mem))
            targets.append(Target(d.key, piece.place, nbytes))
            bufs.append(mem)
    return targets, bufs, staged


class _PlanReading:
    """One load plan being read: the destination bytes, the open data files, and the checks each
    read passes before its bytes are placed. Its methods are called from pool threads."""

    def __init__(self, ckpt: Checkpoint, manifest: Manifest, entries: dict[str, TensorEntry],
                 bufs: list[np.ndarray], handles: dict[str, ReadHandle], verify: bool):
        self.ckpt = ckpt
        self.manifest = manifest
        self.entries = entries
        self.bufs = bufs
        self.handles = handles
        self.verify = verify

    def views_of(self, op: ReadOp, held: bool = False) -> list[memoryview]:
        """Where each part of ``op`` lands: its destination's bytes, or (``held``, or a part
        assembled from a chunk buffer) a scratch buffer."""
        views = []
        for part in op.parts:
            if part.target is not None and not held:
                views.append(self.bufs[part.target].data[part.dst_offset : part.dst_offset + part.length])
            else:
                views.append(np.empty(part.length, dtype=np.uint8).data)
        return views

    def _read(self, task: ReadTask, per_op: list[list[memoryview]]) -> float:
        """Read ``task`` in one request into ``per_op`` (each op's views), checking the header it
        carries; seconds reading."""
        flat: list[memoryview] = []
        header = np.empty(self.manifest.file_entry(task.file).header_bytes if task.header else 0, dtype=np.uint8)
        start = end = 0 if task.header else task.ops[0].file_offset
        if task.header:
            flat.append(header.data)
            end = len(header)
        for op, views in zip(task.ops, per_op):
            if op.file_offset > end:  # bytes between two reads of a batch: fetched and dropped
                flat.append(np.empty(op.file_offset - end, dtype=np.uint8).data)
            flat.extend(views)
            end = op.file_offset + op.length
        t0 = time.perf_counter()
        self.handles[task.file].read_into_many(start, flat)
        t1 = time.perf_counter()
        liveness.progress()  # slow storage is not a stalled rank
        if task.header:
            check_header_bytes(self.ckpt, self.manifest, task.file, header.data)
        return t1 - t0

    def run(self, task: ReadTask) -> tuple[float, float, float]:
        """Read one task in one request straight into place, verifying each op before scattering
        it; (seconds reading, hashing, copying). For reads whose bytes are not checked, or land
        in fresh memory, where a failure leaves nothing to keep untouched."""
        faults.point("load.read")
        per_op = [self.views_of(op) for op in task.ops]
        t_read = self._read(task, per_op)
        t_hash = t_copy = 0.0
        for op, views in zip(task.ops, per_op):
            t_hash += self.check_op(op, views)
            t_copy += self.place(op, views, held=False)
        return t_read, t_hash, t_copy

    def fetch(self, task: ReadTask) -> tuple[float, list[list[memoryview]]]:
        """The bytes of ``task``, not verified yet, without touching a destination: where the
        file's mapping holds them, else read into memory; (seconds reading, each op's parts' bytes).
        The header the task carries is verified here.

        Pages not cached are read by the mapping's faults, whose readaround window is the disk's
        readahead size: the page cache gets large folios, mapped a huge page at a time. (Asking
        the disk first with POSIX_FADV_WILLNEED left 4 KiB pages, each mapped on its own, and made
        a cold load 1.2 to 1.5 times slower.)"""
        faults.point("load.read")
        handle = self.handles[task.file]
        mapped = getattr(handle, "view", None)
        if mapped is None:
            held = [self.views_of(op, held=True) for op in task.ops]
            return self._read(task, held), held
        header = self.manifest.file_entry(task.file).header_bytes if task.header else 0
        start, end = self._span(task)
        t0 = time.perf_counter()
        data = mapped(start, end - start)  # one call maps every page of the request
        t_read = time.perf_counter() - t0
        liveness.progress()
        if task.header:
            check_header_bytes(self.ckpt, self.manifest, task.file, data[:header])
        return t_read, _slices(task, start, data)

    def _span(self, task: ReadTask) -> tuple[int, int]:
        """Where ``task``'s one request starts and ends in its file."""
        start = 0 if task.header else task.ops[0].file_offset
        end = task.ops[-1].file_offset + task.ops[-1].length if task.ops else self.manifest.file_entry(task.file).header_bytes
        return start, end

    def unmap(self, file: str) -> None:
        """This reading is done with ``file``: where it is mapped, the mapping goes now, while
        other threads go on with other files, rather than when the files are closed after the
        last read (unmapping 512 MiB of 4 KiB pages took one thread 2 to 9 ms)."""
        unmap = getattr(self.handles[file], "unmap", None)
        if unmap is not None:
            unmap()

    def mapped(self, file: str) -> bool:
        """Whether ``file``'s bytes are read where its mapping holds them (a local file)."""
        return getattr(self.handles[file], "view", None) is not None

    def map_ahead(self, task: ReadTask) -> None:
        """Map (reading from the disk what is not cached) the pages of ``task``'s request in its
        file's mapping, for :meth:`fetch` to find them there; nothing for other handles."""
        mapped = getattr(self.handles[task.file], "view", None)
        if mapped is not None:
            start, end = self._span(task)
            mapped(start, end - start).release()

    def check_op(self, op: ReadOp, views: list[memoryview]) -> float:
        """Verify what ``op`` read into ``views``; seconds hashing."""
        t0 = time.perf_counter()
        if self.verify:
            for part, view in zip(op.parts, views):
                self._check_part(op, part, view, part.first_block)
        return time.perf_counter() - t0

    def check_bytes(self, op: ReadOp, part: ReadPart, view: memoryview) -> None:
        """Verify the bytes of one part of ``op`` (when this reading verifies)."""
        if self.verify:
            self._check_part(op, part, view, part.first_block)

    def _check_part(self, op: ReadOp, part: ReadPart, view: memoryview, first_block: int) -> None:
        """Bytes of ``part`` from block ``first_block`` of its chunk on match their checksums."""
        chunk = self.entries[part.key].chunks[part.chunk]
        bad = checksum.first_bad_block(view, chunk.block_bytes, chunk.checksums, first_block)
        if bad is not None:
            _, start, a, b = chunk.locate(bad * chunk.block_bytes, (bad + 1) * chunk.block_bytes)[0]
            raise CorruptCheckpointError(
                f"{self.ckpt.path}: tensor {part.key!r} is corrupt in {self.manifest.describe_file(op.file)}: block {bad} "
                f"(file bytes {start}..{start + b - a}) does not match its xxh3-128 checksum"
            )

    def place(self, op: ReadOp, views: list[memoryview], held: bool) -> float:
        """Scatter what ``op`` read into place (``held``: its direct parts too); seconds copying."""
        t0 = time.perf_counter()
        for part, view in zip(op.parts, views):
            if part.scatters:
                scatter(np.frombuffer(view, dtype=np.uint8), part.scatters, self.bufs)
            if part.box is not None:
                copy_box(np.frombuffer(view, dtype=np.uint8), part.box, self.bufs)
            if held and part.target is not None:
                self.bufs[part.target][part.dst_offset : part.dst_offset + part.length] = np.frombuffer(view, dtype=np.uint8)
        return time.perf_counter() - t0

    def reread_into_place(self, file: str, parts: list[tuple[ReadPart, memoryview, int]]) -> None:
        """Put verified ``parts`` (each with its bytes' offset in ``file``, a local file whose
        mapping they were verified in) in place: a part landing in one target is read there
        again from the same page-cache pages, one vectored read for each run of such parts
        back to back in the file (one call, which lets other threads run); the others are
        copied out of their bytes. (A file cut short meanwhile leaves the run's tensors part
        filled with verified bytes, and raises: data files are never changed once committed.)"""
        handle = self.handles[file]
        start = end = -1
        views: list[memoryview] = []
        for part, view, at in parts:
            if part.target is None:
                self.place_part(part, view)
                continue
            if at != end and views:
                handle.read_into_many(start, views)
                views = []
            if not views:
                start = at
            views.append(self.bufs[part.target].data[part.dst_offset : part.dst_offset + part.length])
            end = at + part.length
        if views:
            handle.read_into_many(start, views)

    def place_part(self, part: ReadPart, view: memoryview) -> float:
        """Copy the verified bytes of one part into place; seconds copying."""
        t0 = time.perf_counter()
        src = np.frombuffer(view, dtype=np.uint8)
        if part.scatters:
            scatter(src, part.scatters, self.bufs)
        if part.box is not None:
            copy_box(src, part.box, self.bufs)
        if part.target is not None:
            self.bufs[part.target][part.dst_offset : part.dst_offset + part.length] = src
        return time.perf_counter() - t0


@collector_paused()
def read_destinations(ckpt: Checkpoint, manifest: Manifest, destinations: list[Destination],
                      verify: bool = True, threads: int = 4, loaded: set[str] | None = None,
                      atomic: bool = True) -> ReadResult:
    """Fill every destination from the checkpoint, reading only the bytes its places need.
    ``loaded`` and ``atomic``: as :func:`read_ops` says; a destination that is not one flat host
    buffer is filled (copied from its staging memory) only once every read has succeeded."""
    t_start = time.perf_counter()
    targets, bufs, staged = place_destinations(destinations)
    entries = {d.key: d.entry for d in destinations}
    ops = plan_reads(targets, entries)
    result = read_ops(ckpt, manifest, entries, bufs, ops, verify=verify, threads=threads, loaded=loaded, atomic=atomic)
    result.seconds["plan"] += time.perf_counter() - t_start - result.seconds["total"]
    t0 = time.perf_counter()
    copy_back(staged)
    result.seconds["assemble"] += time.perf_counter() - t0
    result.seconds["total"] = time.perf_counter() - t_start
    return result


def plan_tasks(manifest: Manifest, ops: list[ReadOp], files: set[str] | dict, verify: bool,
               coalesce_reads: tuple[int, int] = (0, 0)) -> list[ReadTask]:
    """The requests that read ``ops`` from ``files`` (every file the ops read), each file's
    header with them when ``verify``; reads less than ``coalesce_reads = (gap, most)`` apart merge."""
    gap, most = coalesce_reads
    batches = coalesce(ops, gap, most) if most else [[op] for op in ops]
    headers = {name: manifest.file_entry(name).header_bytes for name in files if not is_external(name)}  # foreign: none of ours
    return read_tasks(batches, headers if verify else {}, gap)


def task_extent(task: ReadTask, header_bytes: int) -> tuple[int, tuple[int, ...]]:
    """Where in its file a task's one request starts, and the lengths of the buffers it fills
    back to back (as :meth:`_PlanReading.run` lays them out): the header (``header_bytes``, when
    the task reads it), then each op's parts, a buffer for the bytes between two ops of a batch."""
    start = end = 0 if task.header else task.ops[0].file_offset
    lengths = []
    if task.header:
        lengths.append(header_bytes)
        end = header_bytes
    for op in task.ops:
        if op.file_offset > end:
            lengths.append(op.file_offset - end)
        lengths.extend(part.length for part in op.parts)
        end = op.file_offset + op.length
    return start, tuple(lengths)


@collector_paused()  # an object per op and part, all kept until the end: see resurgo.gcpause
def read_ops(ckpt: Checkpoint, manifest: Manifest, entries: dict[str, TensorEntry], bufs: list[np.ndarray],
             ops: list[ReadOp], verify: bool = True, threads: int = 4,
             handles: dict[str, ReadHandle] | None = None, tasks: list[ReadTask] | None = None,
             loaded: set[str] | None = None, atomic: bool = True) -> ReadResult:
    """Run the read ops of a load plan into ``bufs`` (the plan's targets' bytes), verifying each
    read unless ``verify`` is false. ``handles``: the files to read from (bytes already in memory,
    or received from peers), else the checkpoint's data files, opened here and closed at the end.
    ``tasks``: the requests (:func:`plan_tasks` of ``ops``), when the caller planned them already.
    ``atomic`` (with ``verify``): a tensor is filled only once all its bytes here verified (see
    the module), and the keys of those filled are added to ``loaded`` as they are; else (fresh
    buffers, nothing to keep) each read is verified where it lands, then scattered."""
    t_start = time.perf_counter()
    own = handles is None
    if handles is None:
        handles = _open_files(ckpt, manifest, {op.file for op in ops})
    seconds = {"plan": time.perf_counter() - t_start, "read": 0.0, "checksum": 0.0}
    if tasks is None:
        # Bytes in memory: reads back to back are one task (a pool task costs more than a call).
        tasks = plan_tasks(manifest, ops, handles, verify, ckpt.coalesce_reads if own else (0, MAX_PIECE_BYTES))
    batches = [t for t in tasks if t.ops]
    reading = _PlanReading(ckpt, manifest, entries, bufs, handles, verify)
    try:
        # One batch (and its header reads) runs in this thread: run in a pool thread, its buffers
        # come from another malloc arena, which raised a windowed conversion's peak RSS by 8-16 MiB.
        workers = 1 if threads <= 1 or len(batches) <= 1 else threads
        if verify and atomic:
            units = _Units(reading, tasks, loaded if loaded is not None else set(), shared=workers > 1)
            if workers == 1:
                with _Readahead(reading, tasks) as units.readahead:
                    units.work()
            else:
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resurgo-read") as pool:
                    list(pool.map(lambda _: units.work(), range(workers)))
            units.release()
            if units.error is not None:
                raise units.error
            seconds["read"], seconds["checksum"], seconds["assemble"] = units.seconds
        else:
            if workers == 1:
                results = [reading.run(t) for t in tasks]
            else:
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resurgo-read") as pool:
                    results = list(pool.map(reading.run, tasks))
            seconds["read"] = sum(r[0] for r in results)
            seconds["checksum"] = sum(r[1] for r in results)
            seconds["assemble"] = sum(r[2] for r in results)
    finally:
        if own:
            for h in handles.values():
                h.close()
    seconds["total"] = time.perf_counter() - t_start
    return ReadResult(sum(op.length for op in ops), sorted({op.file for op in ops}), seconds)


# Parts hashed, then filled, together by a plan's only thread: about what a core's cache holds,
# so that the copy reads bytes the hash just brought in, and the lock is taken once per group
# rather than per part.
GROUP_BYTES = 512 << 10


class _Units:
    """Verify-then-fill scheduling of one plan's requests (see the module). The unit is a tensor:
    it is filled once every part of every request reading it verified. Workers take jobs from one
    queue: verifying a request (queued first to last), a group of parts at a time, or filling a
    verified part of a tensor whose last part verified in another request (queued at the front, so
    a verified tensor is filled before more is read). The parts that complete their tensors are
    filled at once by the thread that hashed them: one thread copies each group of parts straight
    after its hash, while in cache; several read a whole request's verified parts into place after
    hashing all of it (see the module). The thread done with a file's last job lets its mapping go.
    After a failure no part is verified any more; the tensors already verified are still filled,
    so each tensor ends either loaded or untouched."""

    def __init__(self, reading: _PlanReading, tasks: list[ReadTask], loaded: set[str], shared: bool = False):
        self.reading, self.tasks, self.loaded = reading, tasks, loaded
        # Several threads: a request is one group, its verified parts of a local file read into
        # place again (see the module); one thread: groups copied out while in cache.
        self.shared = shared
        self.group_bytes = GROUP_BYTES if not shared else 1 << 62
        self.unverified: dict[str, int] = {}  # per tensor: parts not verified yet
        for t in tasks:
            for op in t.ops:
                for part in op.parts:
                    self.unverified[part.key] = self.unverified.get(part.key, 0) + 1
        self.unfilled = dict(self.unverified)
        # verified, tensor not complete: (part, its bytes, its file)
        self.waiting: dict[str, list[tuple[ReadPart, memoryview, str]]] = {}
        # (task to verify, None) or (None, (tensor, part, its verified bytes, its file) to fill)
        self.queue: deque[tuple[int | None, tuple[str, ReadPart, memoryview, str] | None]] = deque(
            (i, None) for i in range(len(tasks)))
        # per file: its requests not done and its parts waiting for their tensor; at none, the
        # thread that finished its last let its mapping go (see _PlanReading.unmap)
        self.open_work: dict[str, int] = {}
        for t in tasks:
            self.open_work[t.file] = self.open_work.get(t.file, 0) + 1
        self.busy = 0
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.seconds = [0.0, 0.0, 0.0]  # reading, hashing, copying
        self.readahead: _Readahead | None = None  # one worker: the next requests mapped meanwhile

    def work(self) -> None:
        while True:
            with self.cond:
                while not self.queue and self.busy:
                    self.cond.wait()
                if not self.queue:
                    return
                i, fill = self.queue.popleft()
                if fill is None and self.error is not None:
                    continue
                self.busy += 1
            try:
                if fill is not None:
                    file = fill[3]
                    t_copy = self._fill(*fill[:3])
                    with self.cond:
                        self.seconds[2] += t_copy
                else:
                    assert i is not None
                    file = self.tasks[i].file
                    self._check(i)
            except BaseException as e:  # noqa: BLE001 - raised by read_ops once every worker is done
                with self.cond:
                    if self.error is None:
                        self.error = e
            finally:
                with self.cond:
                    self.busy -= 1
                    self.open_work[file] -= 1
                    done = not self.open_work[file] and self.error is None
                    self.cond.notify_all()
            if done:  # this job's views of the file are gone with its frame
                self.reading.unmap(file)

    def release(self) -> None:
        """Drop the bytes held for tensors never completed (views of the files' mappings)."""
        self.waiting.clear()
        self.queue.clear()

    def _check(self, i: int) -> None:
        if self.readahead is not None:
            self.readahead.reached(i)
        task = self.tasks[i]
        t_read, held = self.reading.fetch(task)
        reread = self.shared and self.reading.mapped(task.file)
        times = [0.0, 0.0]  # hashing, copying
        try:
            group: list[tuple[ReadOp, ReadPart, memoryview, int]] = []
            size = 0
            for op, views in zip(task.ops, held):
                at = op.file_offset
                for part, view in zip(op.parts, views):
                    group.append((op, part, view, at))
                    at += part.length
                    size += part.length
                    if size >= self.group_bytes:
                        if not self._verify_and_fill(group, times, task.file, reread):
                            return
                        group, size = [], 0
            if group:
                self._verify_and_fill(group, times, task.file, reread)
        finally:
            del held
            with self.cond:
                self.seconds[0] += t_read
                self.seconds[1] += times[0]
                self.seconds[2] += times[1]

    def _verify_and_fill(self, group: list[tuple[ReadOp, ReadPart, memoryview, int]], times: list[float],
                         file: str, reread: bool) -> bool:
        """Verify a group of parts read together from ``file``, then fill those whose tensor
        they complete (``reread``: by reading them again from the file, else copied out); False
        once a request has failed (this one or another: verify no more). The bookkeeping takes
        the lock once."""
        if self.error is not None:
            return False
        failure: CorruptCheckpointError | None = None
        t0 = time.perf_counter()
        verified = len(group)
        for j, (op, part, view, _) in enumerate(group):
            try:
                self.reading.check_bytes(op, part, view)
            except CorruptCheckpointError as e:
                failure, verified = e, j
                break
        t1 = time.perf_counter()
        ready: list[tuple[ReadPart, memoryview, int]] = []
        with self.cond:
            for _, part, view, at in group[:verified]:
                key = part.key
                self.unverified[key] -= 1
                if self.unverified[key]:
                    self.waiting.setdefault(key, []).append((part, view, file))
                    self.open_work[file] += 1
                    continue
                others = self.waiting.pop(key, ())
                if others:
                    self.queue.extendleft((None, (key, *other)) for other in others)
                    self.cond.notify_all()
                ready.append((part, view, at))
        if reread:
            self.reading.reread_into_place(file, ready)
        else:
            for part, view, _ in ready:
                self.reading.place_part(part, view)
        t2 = time.perf_counter()
        if ready:
            self._filled([part.key for part, _, _ in ready])
        times[0] += t1 - t0
        times[1] += t2 - t1
        if failure is not None:
            raise failure
        return True

    def _fill(self, key: str, part: ReadPart, view: memoryview) -> float:
        t_copy = self.reading.place_part(part, view)
        self._filled([key])
        return t_copy

    def _filled(self, keys: list[str]) -> None:
        """One part of each of ``keys`` is in place; a tensor whose last part that was is loaded."""
        with self.cond:
            for key in keys:
                self.unfilled[key] -= 1
                if not self.unfilled[key]:
                    self.loaded.add(key)


class _Readahead:
    """For a plan read by one thread: a helper thread maps the pages of the next ``depth``
    requests (reading those not cached) while the reader hashes and copies the current one, as
    the kernel's readahead does for a reader that reads into place; mapped alone, a cold request
    would wait for the disk with nothing else to do. Its errors are left to the reader, which
    meets them when it maps the same pages."""

    def __init__(self, reading: _PlanReading, tasks: list[ReadTask], depth: int = 2):
        self.reading, self.tasks, self.depth = reading, tasks, depth
        self.current = 0
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="resurgo-readahead", daemon=True)

    def __enter__(self) -> "_Readahead":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join()

    def reached(self, i: int) -> None:
        """The reader starts request ``i``."""
        with self.cond:
            self.current = i
            self.cond.notify()

    def _run(self) -> None:
        for i, task in enumerate(self.tasks):
            with self.cond:
                while not self.stopped and i > self.current + self.depth:
                    self.cond.wait()
                if self.stopped:
                    return
            if not task.ops:
                continue
            try:
                self.reading.map_ahead(task)
            except Exception:  # noqa: BLE001 - the reader raises it, mapping the same pages
                return


def _slices(task: ReadTask, start: int, data: memoryview) -> list[list[memoryview]]:
    """Each op's parts' bytes in ``data``, the task's file bytes from ``start``."""
    out = []
    for op in task.ops:
        at, views = op.file_offset - start, []
        for part in op.parts:
            views.append(data[at : at + part.length])
            at += part.length
        out.append(views)
    return out


def copy_back(staged: list[tuple[Array, np.ndarray]]) -> None:
    """Copy staged bytes into the tensors they were read for (those that are not one flat host buffer)."""
    for tensor, mem in staged:
        _copy_back(tensor, mem)


def coalesce(ops: list[ReadOp], max_gap: int, max_bytes: int) -> list[list[ReadOp]]:
    """Reads of one file, in file order, grouped while the next starts at most ``max_gap`` bytes
    after the previous ends and the group spans at most ``max_bytes``."""
    batches: list[list[ReadOp]] = []
    for op in sorted(ops, key=lambda o: (o.file, o.file_offset)):
        if batches:
            last = batches[-1]
            end = last[-1].file_offset + last[-1].length
            if (last[-1].file == op.file and end <= op.file_offset <= end + max_gap
                    and op.file_offset + op.length - last[0].file_offset <= max_bytes):
                last.append(op)
                continue
        batches.append([op])
    return batches


def read_tasks(batches: list[list[ReadOp]], header_bytes: dict[str, int], gap: int) -> list[ReadTask]:
    """One task per batch; the header of every file in ``header_bytes`` (name -> header size) is
    read by the file's first batch when that starts at most ``gap`` bytes after it, else by a task
    of its own (listed first: they are small)."""
    tasks = [ReadTask(b[0].file, b) for b in batches]
    first: dict[str, ReadTask] = {}
    for t in tasks:
        if t.file not in first or t.ops[0].file_offset < first[t.file].ops[0].file_offset:
            first[t.file] = t
    alone = []
    for name in sorted(header_bytes):
        carrier = first.get(name)
        if carrier is not None and carrier.ops[0].file_offset - header_bytes[name] <= gap:
            carrier.header = True
        else:
            alone.append(ReadTask(name, [], header=True))
    return alone + tasks


def copy_box(scratch: np.ndarray, box: BoxCopy, bufs: list[np.ndarray]) -> None:
    shape = box.shape + (box.itemsize,)
    src = np.lib.stride_tricks.as_strided(scratch[box.src_offset:], shape, box.src_strides + (1,), writeable=False)
    dst = np.lib.stride_tricks.as_strided(bufs[box.target][box.dst_offset:], shape, box.dst_strides + (1,))
    dst[...] = src


def scatter(scratch: np.ndarray, scatters: tuple[Scatter, ...], bufs: list[np.ndarray]) -> None:
    """Copy the runs out of a read; runs with one length and constant strides (the rows of a box)
    go as one strided numpy copy instead of one copy per row."""
    i, n = 0, len(scatters)
    while i < n:
        s = scatters[i]
        j = i + 1
        src_step = dst_step = 0
        if j < n:
            s2 = scatters[j]
            src_step, dst_step = s2.src_offset - s.src_offset, s2.dst_offset - s.dst_offset
            while (j < n and scatters[j].length == s.length and scatters[j].target == s.target
                   and scatters[j].src_offset == s.src_offset + (j - i) * src_step
                   and scatters[j].dst_offset == s.dst_offset + (j - i) * dst_step):
                j += 1
        rows = j - i
        if rows >= 2 and src_step >= s.length and dst_step >= s.length:
            src = np.lib.stride_tricks.as_strided(scratch[s.src_offset:], (rows, s.length), (src_step, 1))
            dst = np.lib.stride_tricks.as_strided(bufs[s.target][s.dst_offset:], (rows, s.length), (dst_step, 1))
            dst[...] = src
        else:
            rows = 1
            bufs[s.target][s.dst_offset : s.dst_offset + s.length] = scratch[s.src_offset : s.src_offset + s.length]
        i += rows


def _open_files(ckpt: Checkpoint, manifest: Manifest, names: set[str]) -> dict[str, ReadHandle]:
    handles: dict[str, ReadHandle] = {}
    try:
        for name in sorted(names):
            h = open_data_file(ckpt, manifest, name)
            handles[name] = h
            expected = manifest.file_entry(name).bytes
            if h.size != expected:
                raise CorruptCheckpointError(
                    f"{ckpt.path}: data file {manifest.describe_file(name)} has {h.size} bytes, the manifest says {expected} "
                    "(truncated or altered)"
                )
    except BaseException:
        for h in handles.values():
            h.close()
        raise
    return handles


def check_header(ckpt: Checkpoint, manifest: Manifest, name: str, handle: ReadHandle) -> None:
    """The safetensors header is covered by its own checksum, so every byte of a file is verified."""
    check_header_bytes(ckpt, manifest, name, handle.read_at(0, manifest.file_entry(name).header_bytes))


def check_header_bytes(ckpt: Checkpoint, manifest: Manifest, name: str, data: bytes | memoryview) -> None:
    entry = manifest.file_entry(name)
    if checksum.digest(data) != entry.header_checksum:
        raise CorruptCheckpointError(
            f"{ckpt.path}: the safetensors header of {name} (bytes 0..{entry.header_bytes}) does not match its checksum"
        )


def _copy_back(tensor: Array, mem: np.ndarray) -> None:
    if isinstance(tensor, np.ndarray):
        np.copyto(tensor, mem.view(tensor.dtype).reshape(tensor.shape))
        return
    with torch.no_grad():
        as_copyable(tensor).copy_(as_copyable(typed_view(mem, tensor.dtype, tuple(tensor.shape))))
