"""Load orchestration: plan and check everything, read verified bytes into the target, then
fill its containers.

Every rank reads only what its own layout needs. The whole plan is checked before the target
changes (:class:`~resurgo.state.unflatten.TargetFill`); if any rank fails, every rank raises the
same error (:func:`~resurgo.dist.comm.Comm.agree`). The ranks' arguments travel with that
agreement and are compared first: ranks that passed different ones all raise
UnsupportedValueError, whatever failed where, and no rank has read a byte yet. No byte that fails its checksum reaches a
target tensor, and a tensor is filled only once all of its bytes verified
(:mod:`resurgo.pipeline.reader`), so when a checksum fails each target tensor is either loaded
or exactly as it was: the :class:`~resurgo.errors.CorruptCheckpointError` lists both, for the
rank raising it, and no value, container or ``load_state_dict`` of the target is touched. A
save that replaces the checkpoint meanwhile is read again from its new manifest
(:mod:`resurgo.pipeline.consistent`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

from resurgo.dist import comm as dist_comm
from resurgo.dist.call import call_note, check_same
from resurgo.errors import (
    CheckpointReplacedError,
    CorruptCheckpointError,
    KeyMismatchError,
    PickleNotAllowedError,
    ResurgoError,
)
from resurgo.format import checksum
from resurgo.format.expansion import distinct_bytes
from resurgo.format.manifest import Manifest
from resurgo.pipeline import consistent, data_files, inflight
from resurgo.pipeline.buffers import writable_bytes
from resurgo.pipeline.manifest_read import read_manifest_and_bytes, resolve_for
from resurgo.pipeline.peer_read import PeerFiles, PeerLoad
from resurgo.pipeline.reader import ReadResult, read_destinations
from resurgo.pipeline.shared_read import SharedLoad, agree_plan, mixed_share_reads, share_note
from resurgo.reports import LoadReport
from resurgo.state.unflatten import Destination, TargetFill
from resurgo.storage.base import Checkpoint
from resurgo.storage.open import is_url, open_checkpoint
from resurgo.wording import plural


def load_into(target: Any, path: str | os.PathLike, *, strict: bool, verify: bool, allow_pickle: bool,
            io_threads: int, storage_options: dict | None = None,
            ignore_mismatched: bool = False, share_reads: bool | None = None,
            peers: PeerFiles | None = None, allow_expansion: bool = False) -> tuple[Any, LoadReport]:
    """Plan, check and read everything, then fill the target (see :func:`_load_into`). A
    CorruptCheckpointError says which of this rank's target tensors were loaded and which were
    left untouched."""
    loaded: set[str] = set()
    planned: list[list[Destination]] = []
    try:
        return _load_into(target, path, strict=strict, verify=verify, allow_pickle=allow_pickle, io_threads=io_threads,
                        storage_options=storage_options, ignore_mismatched=ignore_mismatched,
                        share_reads=share_reads, peers=peers, loaded=loaded, planned=planned,
                        allow_expansion=allow_expansion)
    except CorruptCheckpointError as e:
        comm = dist_comm.current()
        raise _naming_keys(e, planned[0] if planned else [], loaded, comm.rank if comm.size > 1 else None) from e


def _naming_keys(error: CorruptCheckpointError, destinations: list[Destination], filled: set[str],
                 rank: int | None) -> CorruptCheckpointError:
    """``error`` with the keys of ``destinations`` it left loaded and untouched, listed in its
    message (abbreviated) and its attributes. A staged destination (not one flat host buffer)
    is copied in only after every read succeeded: it is untouched."""
    keys = [d.key for d in destinations]
    staged = {d.key for d in destinations if any(writable_bytes(p.tensor) is None for p in d.local_pieces())}
    loaded = [k for k in keys if k in filled and k not in staged]
    untouched = [k for k in keys if k not in loaded]
    where = f" on rank {rank}" if rank is not None else ""  # another rank's message may precede
    said = str(error).rstrip()
    message = (f"{said}{'' if said.endswith('.') else '.'} Of the {plural(len(keys), 'target tensor')}{where}, {len(loaded)} loaded "
               f"(every byte verified){_some(loaded)} and {len(untouched)} left untouched{_some(untouched)}; "
               "no other value of the target changed.")
    return CorruptCheckpointError(message, loaded, untouched)


def _some(keys: list[str], most: int = 8) -> str:
    if not keys:
        return ""
    more = f", and {len(keys) - most} more" if len(keys) > most else ""
    return f" ({', '.join(map(repr, keys[:most]))}{more})"


def _load_into(target: Any, path: str | os.PathLike, *, strict: bool, verify: bool, allow_pickle: bool,
             io_threads: int, storage_options: dict | None = None,
             ignore_mismatched: bool = False, share_reads: bool | None = None,
             peers: PeerFiles | None = None, loaded: set[str], planned: list[list[Destination]],
             allow_expansion: bool = False) -> tuple[Any, LoadReport]:
    """Plan, check and read everything, then fill the target. In a distributed job every rank reads
    only what its own layout needs; if any rank fails before the target is touched, all raise.
    ``share_reads``: bytes several ranks need are read once and sent (:mod:`resurgo.pipeline.shared_read`);
    None decides from where the ranks run and what they read, False never. ``peers``: each rank
    loads its node's directory of ``path``, and the files it lacks are read from the peers named
    (:mod:`resurgo.pipeline.peer_read`); every rank passes one (an empty one where its node holds
    every file); the ranks do not share reads. ``loaded`` gets the keys of the tensors filled,
    ``planned`` the destinations of the last attempt planned. New tensors (those the target does
    not hold) taking more than MAX_EXPANSION times the distinct bytes the checkpoint's chunks read
    are refused before they are allocated (ExpansionError), unless ``allow_expansion``."""
    t_start = time.perf_counter()
    comm = dist_comm.current()
    sharing = comm.size > 1 and share_reads is not False and peers is None
    if comm.size > 1:  # an in-flight save commits with collectives on the same group: let it finish
        inflight.settle(if_busy="wait")

    # Ranks may load their own copies (a root per node): the checkpoint's name must match, not its path.
    names, call = call_note(share_reads=share_reads, checkpoint=os.path.basename(os.fspath(path).rstrip("/")),
                     strict=strict, allow_pickle=allow_pickle, ignore_mismatched=ignore_mismatched,
                     allow_expansion=allow_expansion)
    seen: list[bytes] = []  # the manifest this attempt read
    indexes_read: dict[str, int] = {}

    def plan_and_read() -> tuple[tuple[TargetFill, Any, ReadResult | SharedLoad | PeerLoad | _PlannedRead, Manifest, float],
                                 Any]:
        """The load planned (and read when this process loads alone), and this rank's note for the
        others: the manifest it read, and what planning shared reads needs (None: not sharing). In a
        job of several ranks nothing is read yet: the ranks first compare their arguments."""
        ckpt = open_checkpoint(path, storage_options).pinned()  # one version, where the backend can
        keep_open = False
        try:
            manifest, raw = read_manifest_and_bytes(ckpt, resolved=False)
            seen.append(raw)
            indexes_read.clear()
            if manifest.pickled and not allow_pickle:
                raise PickleNotAllowedError(
                    f"{ckpt.path}: holds pickled values; loading them could run code from the file. "
                    "Pass allow_pickle=True only if you trust this checkpoint."
                )
            whole = manifest.indexed and target is None and peers is None
            if whole:  # every tensor is allocated from the manifest: its chunks are all read first
                manifest = resolve_for(ckpt, manifest, None, indexes_read)
            if peers is None:
                data_files.check_sizes(ckpt, manifest)  # before any allocation
            else:
                peers.check_sizes(ckpt, {name: f.bytes for name, f in manifest.files.items()})
            def stored_bytes() -> int:  # asked only if the load needs a new tensor
                if not manifest.indexed or whole:
                    return distinct_bytes(manifest)
                return distinct_bytes(resolve_for(ckpt, manifest, None, indexes_read))  # every chunk counts

            target_fill = TargetFill(manifest, allow_pickle=allow_pickle, strict=strict, rank=comm.rank, world=comm.size,
                                source=str(ckpt.path), ignore_mismatched=ignore_mismatched,
                                stored_bytes=None if allow_expansion else stored_bytes)
            result = target_fill.plan(target)
            if strict and (target_fill.missing or target_fill.unexpected):
                raise KeyMismatchError(_key_mismatch_message(ckpt, target_fill.missing, target_fill.unexpected),
                                       target_fill.missing, target_fill.unexpected)
            destinations = target_fill.destinations
            planned[:] = [destinations]
            if manifest.indexed and not whole:  # the chunks this rank needs, from the indexes that hold them
                manifest = resolve_for(ckpt, manifest, {d.key: [p.place for p in d.local_pieces()] for d in destinations},
                                       indexes_read)
                destinations = [replace(d, entry=manifest.tensors[d.key]) for d in destinations]
                planned[:] = [destinations]
                data_files.check_sizes(ckpt, manifest)
            t_plan = time.perf_counter() - t_start
            version = (str(path), checksum.digest(raw))
            if peers is not None:  # read once every rank planned: the transfers are collective
                # a memory tier's node directory: a local one, whose files map (see CheckpointDir)
                opened.append(PeerLoad(ckpt, manifest, destinations, verify, io_threads, peers,
                                       ckpt.map_read, loaded))  # type: ignore[attr-defined]
                keep_open = True
                return (target_fill, result, opened[-1], manifest, t_plan), (version, None)
            if sharing:  # read once every rank agreed on the plan: the sharing is collective
                shared = SharedLoad(ckpt, manifest, destinations, verify, io_threads, loaded)
                opened.append(shared)
                keep_open = True
                return ((target_fill, result, shared, manifest, t_plan),
                        (version, share_note(shared.needs, is_url(path))))
            planned_read = _PlannedRead(ckpt, manifest, destinations, verify, io_threads, loaded, target is not None)
            if comm.size > 1:  # read once every rank agreed on the call (the read is agreed too)
                opened.append(planned_read)
                keep_open = True
                return (target_fill, result, planned_read, manifest, t_plan), (version, None)
            return (target_fill, result, planned_read.read(), manifest, t_plan), (version, None)
        finally:
            if not keep_open:
                ckpt.close()

    shared_info = {"shared": False, "plan_bytes": 0}
    opened: list[SharedLoad | PeerLoad | _PlannedRead] = []  # loads planned whose checkpoint is still open

    def read_from_peers(load: PeerLoad) -> ReadResult:
        try:
            return comm.agree(lambda: load.transfer(comm))
        finally:
            close_opened()

    def read_shared(load: SharedLoad, notes: list[Any]) -> ReadResult:
        """Every rank agrees on the share plan, then reads its part (all raise if one fails)."""
        try:
            plan, shared_info["plan_bytes"] = agree_plan(comm, [v for v, _ in notes], [n for _, n in notes],
                                                         load.needs, share_reads)
            shared_info["shared"] = plan is not None
            return comm.agree(load.read_alone if plan is None else lambda: load.transfer(comm, plan))
        finally:
            close_opened()

    def read_planned(load: _PlannedRead) -> ReadResult:
        try:
            return comm.agree(load.read)
        finally:
            close_opened()

    def check_call(calls: list[tuple]) -> None:
        """Every rank, on every rank's arguments, before any failure is raised: ranks that passed
        different ones all refuse, from the same values."""
        if len(set(calls)) == 1:
            return
        choices[:] = calls
        shares = [c[names.index("share_reads")] for c in calls]
        if len(set(shares)) > 1:
            raise mixed_share_reads(str(path), shares)
        # Each rank's own path would start the message: name none when the checkpoints differ.
        checkpoints = {c[names.index("checkpoint")] for c in calls}
        check_same("load", str(path) if len(checkpoints) == 1 else "resurgo.load", names, calls)

    def close_opened() -> None:
        for load in opened:
            load.ckpt.close()
        opened.clear()

    # A save replacing the checkpoint meanwhile is not corruption: read the new version instead. Every
    # decision is collective, so all ranks retry together and end on the same version.
    choices: list[Any] = []  # every rank's arguments, when they differ (the load is refused)
    for _ in range(consistent.ATTEMPTS):
        seen.clear()
        try:
            try:
                (target_fill, result, read, manifest, t_plan), notes = comm.agree_noting(plan_and_read, call, check_call)
            except BaseException:  # another rank failed, or the ranks' arguments differ: nothing is read
                close_opened()
                raise
            if not _one_version_per_path([v for v, _ in notes]):
                close_opened()
                continue
            shared_load: SharedLoad | PeerLoad | None = None
            if isinstance(read, _PlannedRead):
                read = read_planned(read)
            elif isinstance(read, (SharedLoad, PeerLoad)):
                shared_load = read
                read = read_shared(read, notes) if isinstance(read, SharedLoad) else read_from_peers(read)
        except CheckpointReplacedError:
            continue  # raised on every rank by agree()
        except ResurgoError as e:
            if choices or getattr(e, "agreed", False):  # every rank raises it, from the same notes or tags
                raise
            changed = consistent.manifest_changed(path, storage_options, seen[0] if seen else None)
            if any(comm.all_gather(changed)):
                continue
            raise
        break
    else:
        raise consistent.replaced_too_often(path)
    seconds = dict(read.seconds)
    if shared_load is not None:
        seconds["assemble"] = seconds.get("assemble", 0.0) + shared_load.finish()
    # A Stateful's load_state_dict may refuse on one rank only: every rank raises its error.
    comm.agree(target_fill.run_actions)
    seconds["plan"] = t_plan + seconds.get("plan", 0.0)
    seconds["total"] = time.perf_counter() - t_start
    return result, LoadReport(
        path=str(path), bytes_read=read.bytes_read, files=read.files, num_tensors=len(target_fill.destinations),
        seconds=seconds, missing_keys=target_fill.missing, unexpected_keys=target_fill.unexpected,
        mismatched_keys=target_fill.mismatched, step=manifest.step,
        metadata_bytes_read=len(seen[0]) + sum(indexes_read.values()),
        bytes_received=read.bytes_received, shared=bool(shared_info["shared"]),
        share_plan_bytes_sent=int(shared_info["plan_bytes"]),
    )


@dataclass
class _PlannedRead:
    """One rank's load of a job, planned, read from storage by this rank alone once every rank
    agreed on the call (see :func:`~resurgo.pipeline.reader.read_destinations`)."""

    ckpt: Checkpoint
    manifest: Manifest
    destinations: list[Destination]
    verify: bool
    threads: int
    loaded: set[str]
    atomic: bool

    def read(self) -> ReadResult:
        return read_destinations(self.ckpt, self.manifest, self.destinations, verify=self.verify,
                                 threads=self.threads, loaded=self.loaded, atomic=self.atomic)


def _key_mismatch_message(ckpt: Checkpoint, missing: list[str], unexpected: list[str]) -> str:
    parts = [f"{ckpt.path}: keys differ between the target state and the checkpoint (strict=True)."]
    if missing:
        parts.append(f"Missing from the checkpoint ({len(missing)}): {', '.join(map(repr, missing))}.")
    if unexpected:
        parts.append(f"In the checkpoint but not in the target ({len(unexpected)}): {', '.join(map(repr, unexpected))}.")
    parts.append("Pass strict=False to load the keys that match.")
    return " ".join(parts)


def _one_version_per_path(read: list[tuple[str, str]]) -> bool:
    """Whether the ranks that loaded the same path read the same manifest. Ranks may load
    different paths (each its own checkpoint); only a path read in two versions calls for a retry."""
    versions: dict[str, set[str]] = {}
    for path, digest in read:
        versions.setdefault(path, set()).add(digest)
    return all(len(digests) == 1 for digests in versions.values())
