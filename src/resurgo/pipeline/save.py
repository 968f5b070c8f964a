"""The save pipeline in two halves: prepare (flatten, check, plan, open the staging directory) and
write-and-commit (write data files in parallel, build the manifest, commit atomically).

``resurgo.save`` runs both in the caller's thread; ``resurgo.async_save`` runs the first in the
caller's thread and the second in the background, from a snapshot of the tensors.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from resurgo.errors import UnsupportedValueError
from resurgo.format import checksum
from resurgo.format.tree import top_level_step
from resurgo.gcpause import collector_paused
from resurgo.dist import comm as dist_comm
from resurgo.dist.call import call_note, check_same
from resurgo.dist.comm import Comm
from resurgo.format.index import INDEX_FORMAT, RankIndex, data_file_name, index_file_name
from resurgo.format.manifest import (
    FORMAT_VERSION,
    INDEXED_VERSION,
    GridEntry,
    RankFiles,
    MANIFEST_NAME,
    MAX_METADATA_DEPTH,
    REFERENCE_RE,
    REFERENCING_VERSION,
    TMP_MARKER,
    BoxPlace,
    ChunkEntry,
    Extent,
    FileEntry,
    FlatPlace,
    Manifest,
    TensorEntry,
    declared_files,
    json_depth_exceeds,
    parse_manifest,
)
from resurgo.layout.box import ChunkBox, FlatRange, place_order
from resurgo.pipeline.buffers import TensorStream, source_for_write
from resurgo.pipeline.manifest_read import resolve_for
from resurgo.pipeline.collective import NodeLocal, open_node_staging, write_then_commit
from resurgo.pipeline.writer import (WrittenChunk, WrittenFile, digests_of, reused_extents, sampled_digests,
                                     write_data_file)
from resurgo.plan.global_plan import GlobalPlan, PlanCache, RankDecl, RankSummary, RankWrite, TensorDecl, TensorMeta
from resurgo.plan.core_plan import layouts_of
from resurgo.plan.reuse_plan import (BaseIndex, Segment, changed_throughout, mostly_changed, owned_bytes,
                                     sample_blocks, segments)
from resurgo.plan.save_plan import FilePlan, SavePlan, plan_files
from resurgo.reports import SaveReport
from resurgo.state.flatten import TensorLeaf, flatten_state
from resurgo.storage.base import Staging
from resurgo.storage.open import is_url, local_path, open_checkpoint
from resurgo.version import __version__


@dataclass
class PreparedSave:
    """Everything decided before any tensor byte is written."""

    path: str
    tree: dict  # the whole job's tree (per-rank values merged in)
    tensors: dict[str, TensorMeta]  # every tensor of the checkpoint, by manifest key
    leaves: dict[str, TensorLeaf]  # what this rank writes, by chunk name in its data files
    pickled: bool
    step: int | None
    metadata: dict | None
    save_info: dict | None
    plan: SavePlan  # this rank's data files
    staging: Staging
    comm: Comm = field(default_factory=lambda: Comm(0, 1))
    seconds: dict[str, float] = field(default_factory=dict)
    base: BaseIndex | None = None  # the checkpoint whose unchanged bytes this save references
    incremental: bool = False  # a later save may take this one as its base
    node_local: NodeLocal | None = None  # one directory per node (a memory tier), not one shared
    job_plan: GlobalPlan | None = None  # the whole job's plan: the layouts of a version 4 core (indexed)

    @property
    def indexed(self) -> bool:
        """Written as format version 4: a core manifest, and an index per rank."""
        return self.job_plan is not None

    @property
    def owns_staging(self) -> bool:
        """Whether this rank opened the staging, and so is the one to remove it on a failure:
        rank 0, or the node's leader for a node-local save."""
        return self.comm.rank == (0 if self.node_local is None else self.node_local.leader)

    @property
    def tensor_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values())


def library_versions() -> dict[str, str]:
    return {"resurgo": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def check_metadata(metadata: dict | None, step: int | None, name: str = "metadata") -> None:
    if step is not None and type(step) is not int:
        raise UnsupportedValueError(f"step must be an int or None, not {type(step).__name__}")
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise UnsupportedValueError(f"{name} must be a dict with str keys")
    if json_depth_exceeds(metadata, MAX_METADATA_DEPTH):  # readers refuse it: keep the manifest readable
        raise UnsupportedValueError(f"{name} is nested deeper than {MAX_METADATA_DEPTH} levels")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UnsupportedValueError(f"{name} must be plain JSON (str, int, float, bool, None, list, dict): {e}") from None


DEFAULT_IO_THREADS = 4  # writer (and reader) threads per rank: data files written in parallel
AUTO_PER_RANK_BYTES = 1 << 20  # plain tensors up to this size are compared across ranks


_plans = PlanCache()  # the last plan: repeated saves of one layout skip planning and send summaries


@dataclass(frozen=True)
class _Decided:
    """Rank 0's answer to every rank: a new plan, or the merged tree of the plan every rank holds."""

    plan: GlobalPlan | None
    tree: dict | None  # when the held plan is reused
    plan_id: str
    per_rank: frozenset[str]
    pickled: bool
    staging: Staging | None  # None: node-local, each node's leader opens its own
    index: BaseIndex | None


def _declare(leaf: TensorLeaf, compare: bool) -> TensorDecl:
    if leaf.pieces is not None:
        return TensorDecl(leaf.key, leaf.kind, leaf.dtype, leaf.shape, tuple(p.place for p in leaf.pieces), True)
    digest = None
    if compare and leaf.nbytes <= AUTO_PER_RANK_BYTES:
        src = source_for_write(leaf.value)
        if isinstance(src, TensorStream):
            buf = np.empty(src.nbytes, dtype=np.uint8)
            src.read_into(0, buf)
            src = buf
        digest = checksum.digest(src.data.cast("B"))
    return TensorDecl(leaf.key, leaf.kind, leaf.dtype, leaf.shape, (ChunkBox.whole(leaf.shape),), False, digest)


def _write_leaf(leaf: TensorLeaf, w: RankWrite) -> TensorLeaf:
    """The local tensor holding one chunk this rank writes, under the chunk's name."""
    value = leaf.value
    if leaf.pieces is not None:
        value = next(p.tensor for p in leaf.pieces if p.place == w.local_place)
    return TensorLeaf(w.item.name, value, leaf.kind, leaf.dtype, tuple(value.shape))


def open_base(path: str | os.PathLike, base: str | os.PathLike, storage_options: dict | None) -> BaseIndex:
    """The index of ``base``, a committed checkpoint in the same root as ``path`` (the same parent
    directory, or the same URL prefix), not ``path`` itself; else UnsupportedValueError."""
    here, there = (str(p).rstrip("/").rsplit("/", 1) if is_url(p) else
                   (os.path.realpath(os.path.dirname(os.path.abspath(local_path(p)))), os.path.basename(os.path.abspath(local_path(p))))
                   for p in (path, base))
    if is_url(path) != is_url(base) or here[0] != there[0]:
        raise UnsupportedValueError(
            f"{path}: the base {base} is not in the same root (directory or URL prefix) as the checkpoint being "
            f"saved; a checkpoint references only checkpoints beside it: save a full checkpoint (no base), or one "
            f"beside {base}")
    if here[1] == there[1]:
        raise UnsupportedValueError(f"{path}: a checkpoint cannot be its own base (saving over it would delete "
                                    f"the bytes it references); give an earlier checkpoint as base")
    if REFERENCE_RE.fullmatch(f"{there[1]}/data/x.safetensors") is None or TMP_MARKER in there[1]:
        raise UnsupportedValueError(f"{base}: a base's name must match [A-Za-z0-9_.-]{{1,200}} and not be a temporary "
                                    f"directory, to be referenced")
    return BaseIndex.of(there[1], read_base_manifest(base, storage_options))


def read_base_manifest(base: str | os.PathLike, storage_options: dict | None) -> Manifest:
    """The manifest of the checkpoint ``base``, checked as any manifest read is (parsed only when
    its bytes are not those of a manifest this process already holds: :data:`_manifests`)."""
    ckpt = open_checkpoint(base, storage_options)
    raw = ckpt.read_manifest_bytes()
    manifest = _manifests.parse(raw, ckpt.describe(MANIFEST_NAME))
    return resolve_for(ckpt, manifest, None) if manifest.indexed else manifest  # a job's save as a base


class _ManifestMemo:
    """Parsed manifests by their exact bytes: this process's last incremental save (most often the
    next save's base) and the last base parsed (one base of several saves, or the base a manager
    read to choose it, read again by the save). A base is then parsed once, not once per save:
    equal bytes are the same manifest, validated when it was parsed or built here."""

    def __init__(self) -> None:
        self._written: tuple[bytes, Manifest] | None = None
        self._parsed: tuple[bytes, Manifest] | None = None

    def wrote(self, raw: bytes, manifest: Manifest) -> None:
        self._written = (raw, manifest)

    def parse(self, raw: bytes, where: str) -> Manifest:
        for held in (self._written, self._parsed):
            if held is not None and held[0] == raw:
                return held[1]
        manifest = parse_manifest(raw, where)
        self._parsed = (raw, manifest)
        return manifest


_manifests = _ManifestMemo()


def _reuse_blocks(w: RankWrite, base: BaseIndex) -> RankWrite:
    """A chunk the base has at the same place keeps the base's checksum blocks, to compare them."""
    match = base.chunks.get((w.item.key, w.item.place))
    if match is None or match.nbytes != w.item.nbytes or match.block_bytes == w.item.block_bytes:
        return w
    return replace(w, item=replace(w.item, block_bytes=match.block_bytes))


def prepare_save(state: Any, path: str | os.PathLike, *, overwrite: bool, allow_pickle: bool,
                 step: int | None, metadata: dict | None, io_threads: int, block_bytes: int | None,
                 comm: Comm | None = None, storage_options: dict | None = None,
                 save_info: dict | None = None, base: str | os.PathLike | None = None,
                 as_base: bool = False, node_local: NodeLocal | None = None,
                 call: tuple[tuple[str, Any], ...] = (("call", "save"),)) -> PreparedSave:
    """Flatten and check the state (plain values are encoded now: a snapshot), plan the files and
    open the staging directory. Raises before anything is written when the state or path is bad.

    In a distributed job this is collective: every rank sends a summary of its declarations
    (fingerprints and its per-rank values) to rank 0; when they show that the plan every rank
    holds from the last save still holds, rank 0 merges the trees and every rank reuses its plan;
    else every rank sends its declarations (metadata only), and rank 0 validates and plans the
    whole checkpoint (:mod:`resurgo.plan.global_plan`). Rank 0 opens the staging directory; every
    rank gets the plan, or the same error.

    ``base``: an earlier checkpoint of the same root whose unchanged bytes this one references;
    ``as_base`` (implied by ``base``): checksum blocks small enough to be the unit of reuse, so that
    a later save can take this one as its base (:func:`resurgo.format.checksum.incremental_block_bytes_for`).

    ``node_local``: ``path`` is this rank's node's directory; each node's leader opens its staging
    there (:class:`resurgo.pipeline.collective.NodeLocal`), after ``before_stage(plan)``.

    Every rank's path (its name, for a node-local save), step, overwrite, base, as_base and
    allow_pickle, and the pairs of ``call`` (which call, and its own options), travel with the
    first plan gather; ranks that passed different ones all raise UnsupportedValueError naming
    each rank's value, before anything is opened or written (:mod:`resurgo.dist.call`)."""
    if node_local is not None and base is not None:
        raise UnsupportedValueError(f"{path}: a node-local save (memory tier) cannot reference a base checkpoint; "
                                    "save it in full")
    t0 = time.perf_counter()
    comm = comm or dist_comm.current()
    # Node-local saves name one directory per node, each in its node's own root: only the name must match.
    where = os.path.basename(os.fspath(path).rstrip("/")) if node_local is not None else os.fspath(path)
    arg_names, note = call_note(path=where, step=step, overwrite=bool(overwrite),
                                base=None if base is None else os.fspath(base), as_base=bool(as_base),
                                allow_pickle=bool(allow_pickle), **dict(call))
    tree, leaves, decl, summary, pickled = comm.agree(
        lambda: _flatten_and_declare(state, allow_pickle, metadata, save_info, step, comm.size > 1))
    block_fn, block_rule = _checksum_blocks(block_bytes, as_base or base is not None)

    def coordinate(gathered: list[tuple[Any, ...]] | None) -> _Decided | None:
        """Rank 0: the plan (or, from summaries, the merged tree of the plan every rank holds), then
        the base and the staging; None when the summaries do not suffice."""
        if not comm.is_coordinator:
            return None
        assert gathered is not None
        if len(gathered[0]) > 2:  # the first gather: every rank's arguments, checked before anything opens
            check_same("save", os.fspath(path), arg_names, [n for _, _, n in gathered])
        if isinstance(gathered[0][0], RankSummary):
            merged = _plans.reuse(tree, [s for s, *_ in gathered], block_rule)
            if merged is None:
                return None
            plan, plan_id, per_rank = None, "", frozenset[str]()
        else:
            plan, merged = _plans.plan([d for d, *_ in gathered], block_fn, block_rule), None
            plan_id, per_rank = _plans.ticket()
        index = open_base(path, base, storage_options) if base is not None else None
        staging = None if node_local else open_checkpoint(path, storage_options).stage(overwrite, declared_files)
        return _Decided(plan, merged, plan_id, per_rank, any(p for _, p, *_ in gathered), staging, index)

    decided = _agree_on_plan(comm, summary, decl, pickled, note, coordinate)
    pickled, staging, index = decided.pickled, decided.staging, decided.index  # staging: a copy of rank 0's (it pickles)
    plan = _take_plan(decided)
    if node_local is not None:  # one staging per node, opened by its leader once the plan is known
        staging = _node_staging(comm, node_local, plan, path, storage_options, overwrite)
    assert staging is not None
    own, files = _rank_writes(plan, comm.rank, index, leaves, io_threads, staging.file_tag)
    if step is None:  # the state's own step counter, when it has one at its top
        step = top_level_step(plan.tree)
    # A job of several ranks writes version 4: its metadata stays O(tensors) in the manifest. Saves
    # taking part in reuse, and node-local ones, keep every chunk in the manifest (version 2 or 3).
    indexed = comm.size > 1 and not as_base and base is None and node_local is None
    return PreparedSave(str(path), plan.tree, plan.tensors, own, pickled, step,
                        dict(metadata) if metadata else None, dict(save_info) if save_info else None,
                        files, staging, comm,
                        {"flatten": time.perf_counter() - t0}, index, as_base or base is not None, node_local,
                        plan if indexed else None)


def _flatten_and_declare(state: Any, allow_pickle: bool, metadata: dict | None, save_info: dict | None,
                         step: int | None, distributed: bool
                         ) -> tuple[dict, dict[str, TensorLeaf], RankDecl, RankSummary | None, bool]:
    """This rank's part before planning: the metadata checked, the state flattened, its
    declarations and (in a job of several ranks) their summary against the plan it holds."""
    check_metadata(metadata, step)
    check_metadata(save_info, step, "save_info")
    tree, leaves, pickled = flatten_state(state, allow_pickle=allow_pickle)
    decl = RankDecl(tree, tuple(_declare(leaf, distributed) for leaf in leaves.values()))
    return tree, leaves, decl, _plans.summarize(decl) if distributed else None, pickled


def _checksum_blocks(block_bytes: int | None, incremental: bool) -> tuple[Callable[[int, int], int], Any]:
    """The checksum block size rule of a save's chunks, and what identifies it to the plan cache:
    ``block_bytes`` when given, else small blocks for a save taking part in reuse, else the default."""
    block_rule: Any = block_bytes
    if block_bytes is not None:
        block_fn: Callable[[int, int], int] = lambda n, row_bytes: block_bytes
    elif incremental:
        block_fn, block_rule = checksum.incremental_block_bytes_for, "incremental"
    else:
        block_fn = checksum.block_bytes_for
    return block_fn, block_rule


def _agree_on_plan(comm: Comm, summary: RankSummary | None, decl: RankDecl, pickled: bool, note: Any,
                   coordinate: Callable[[list[tuple[Any, ...]] | None], _Decided | None]) -> _Decided:
    """Every rank's copy of rank 0's decision: from the summaries when the plan every rank holds
    still does, else from every rank's declarations."""
    decided = None
    if summary is not None:  # a summary first: the plan every rank holds may still do
        summaries = comm.gather((summary, pickled, note))
        decided = comm.broadcast(comm.agree(lambda: coordinate(summaries)))
    if decided is None:  # no plan held, or it changed: every rank sends its declarations
        full = comm.gather((decl, pickled))
        decided = comm.broadcast(comm.agree(lambda: coordinate(full)))
    assert decided is not None
    return decided


def _take_plan(decided: _Decided) -> GlobalPlan:
    """The plan rank 0 decided, held for the next save's summary (or the held one, reused)."""
    if decided.plan is None:
        assert decided.tree is not None
        return _plans.reused(decided.tree)
    _plans.hold(decided.plan_id, decided.plan, decided.per_rank)
    return decided.plan


def _node_staging(comm: Comm, node_local: NodeLocal, plan: GlobalPlan, path: str | os.PathLike,
                       storage_options: dict | None, overwrite: bool) -> Staging:
    """This node's staging, opened by its leader once the plan is known."""
    def open_here() -> Staging:
        node_local.before_stage(plan)
        return open_checkpoint(path, storage_options).stage(overwrite, declared_files)

    return open_node_staging(comm, node_local.leader, open_here)


def _rank_writes(plan: GlobalPlan, rank: int, index: BaseIndex | None, leaves: dict[str, TensorLeaf],
                 io_threads: int, file_tag: str) -> tuple[dict[str, TensorLeaf], SavePlan]:
    """This rank's writes (their blocks aligned with the base's, when it has one) and its files."""
    writes = plan.writes[rank]
    if index is not None:
        writes = tuple(_reuse_blocks(w, index) for w in writes)
    own = {w.item.name: _write_leaf(leaves[w.local_key], w) for w in writes}
    files = plan_files([w.item for w in writes], rank=rank, max_files=max(1, io_threads), tag=file_tag)
    return own, files


class LazySources(Mapping):
    """Each tensor's bytes as its writer asks for them: a host tensor's own memory, or a
    :class:`TensorStream` copied slice by slice (device, strided), so a synchronous save holds no
    copy of the state beyond one slice buffer per writer thread."""

    def __init__(self, leaves: dict[str, TensorLeaf]):
        self._leaves = leaves

    def __getitem__(self, key: str) -> "np.ndarray | TensorStream":
        return source_for_write(self._leaves[key].value)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)


def write_and_commit(prep: PreparedSave, sources: Mapping[str, "np.ndarray | TensorStream"],
                     digests: Mapping[str, list[str]] | None = None,
                     failed_before: BaseException | None = None,
                     amend: Callable[[Manifest], Manifest] | None = None) -> SaveReport:
    """Write this rank's data files (one thread per file); once every rank's are durable, rank 0
    writes the manifest and commits (:mod:`resurgo.pipeline.collective`). On any failure, on any
    rank, the staging is removed, nothing is committed, and every rank raises the same error.
    ``failed_before``: this rank's snapshot failed in the background; it is raised in the write
    phase, so that every rank raises it rather than wait for this one. ``amend``: what the manifest
    becomes before it is written (an import in place adds its chunks in foreign files)."""
    t_start = time.perf_counter()
    comm = prep.comm

    def write_file(f: FilePlan) -> tuple[list[WrittenFile], list[WrittenChunk]]:
        with collector_paused():  # an object per run of blocks: see resurgo.gcpause
            plan, reused, reuse, known, sampled = _reuse_in_file(prep, f, sources, digests)
        return ([] if plan is None else [write_data_file(prep.staging, plan, sources, known, reuse, sampled)]), reused

    mine: list[WrittenFile] = []

    def write() -> Any:
        if failed_before is not None:
            raise failed_before
        files = prep.plan.files
        if len(files) == 1:
            results = [write_file(files[0])]
        else:
            with ThreadPoolExecutor(len(files), thread_name_prefix="resurgo-write") as pool:
                results = list(pool.map(write_file, files))
        mine.extend(w for ws, _ in results for w in ws)
        reused = [c for _, cs in results for c in cs]
        if prep.indexed:  # the rank's index goes with its data files; rank 0 gets its size and digest
            written_index = write_index(prep, mine)
            mine.append(written_index)
            return len(mine) - 1, written_index.nbytes, written_index.header_checksum
        return mine, reused

    def manifest(everyone: list[Any]) -> bytes:
        with collector_paused():  # an object per chunk and extent
            if prep.indexed:
                built = build_core(prep, everyone)
            else:
                built = build_manifest(prep, [w for ws, _ in everyone for w in ws], [c for _, cs in everyone for c in cs])
            if amend is not None:
                built = amend(built)
            raw = built.to_json_bytes()
        if prep.incremental:
            _manifests.wrote(raw, built)
        return raw

    node = prep.node_local
    # A node-local save's replication starts before its files are written (it sends from their
    # sources) and ends, verified, once the manifest is known.
    replication = None if node is None else node.replicate(prep.staging, prep.plan.files, sources)

    def replicated(raw: bytes, _: Any) -> None:
        assert replication is not None
        replication.finish(raw)

    try:
        hook = None if node is None else (node.leader, replicated)
        _, manifest_bytes, t_commit = write_then_commit(comm, prep.staging, write, manifest, hook)
    finally:
        if replication is not None:
            replication.drain()
    written = mine
    seconds = dict(prep.seconds)
    seconds["commit"] = t_commit
    for phase in ("write", "checksum", "fsync"):
        seconds[phase] = sum(w.seconds.get(phase, 0.0) for w in written)
    seconds["write_and_commit"] = time.perf_counter() - t_start
    return SaveReport(
        path=prep.path,
        bytes_written=sum(w.nbytes for w in written) + manifest_bytes,
        tensor_bytes=prep.tensor_bytes,
        files=[w.path for w in written] + ([MANIFEST_NAME] if manifest_bytes else []),
        num_tensors=len(prep.tensors),
        seconds=seconds,
    )


def _reuse_in_file(prep: PreparedSave, f: FilePlan, sources: Mapping[str, "np.ndarray | TensorStream"],
                   digests: Mapping[str, list[str]] | None
                   ) -> tuple[FilePlan | None, list[WrittenChunk], dict[str, list[Segment]],
                              Mapping[str, list[str]] | None, dict[str, dict[int, str]]]:
    """With a base: decide what of each chunk of file ``f`` that the base also has is written.
    A chunk whose sampled blocks all differ from the base's is written whole, hashed as it is
    written (but for the sampled blocks: their digests are kept); the others are hashed now
    (unless staging hashed them already) and compared block by block: unchanged, reused whole;
    mostly changed, written whole; else only what changed is written. Returns the file to write
    (None: nothing left in it), the chunks reused whole, each partial chunk's segments, the
    digests known before writing, and the sampled digests of the chunks written whole unhashed."""
    if prep.base is None:
        return f, [], {}, digests, {}
    known = dict(digests or {})
    reused: list[WrittenChunk] = []
    reuse: dict[str, list[Segment]] = {}
    sampled_whole: dict[str, dict[int, str]] = {}
    items = []
    for item in f.items:
        match = prep.base.match(item.key, item.place, item.nbytes, item.block_bytes)
        if match is None:
            items.append(item)
            continue
        picks = sample_blocks(len(match.checksums))
        sampled = ([known[item.name][i] for i in picks] if item.name in known
                   else sampled_digests(sources[item.name], item.nbytes, item.block_bytes, picks))
        if changed_throughout(sampled, match, picks):
            items.append(item)
            if item.name not in known:
                sampled_whole[item.name] = dict(zip(picks, sampled))
            continue
        if item.name not in known:
            known[item.name] = digests_of(sources[item.name], item.nbytes, item.block_bytes)
        segs = segments(item.nbytes, known[item.name], match)
        owned = owned_bytes(segs)
        if mostly_changed(segs, item.nbytes):
            items.append(item)
        elif owned == 0:
            reused.append(WrittenChunk(item, "", (0, 0), item.block_bytes, known[item.name],
                                       reused_extents(segs, "", 0)))
        else:
            reuse[item.name] = segs
            items.append(replace(item, nbytes=owned, partial=True))
    return (FilePlan(f.path, tuple(items)) if items else None), reused, reuse, known, sampled_whole


def _entry(c: WrittenChunk) -> ChunkEntry:
    place = c.item.place
    box = BoxPlace(offsets=list(place.offsets), shape=list(place.shape)) if isinstance(place, ChunkBox) else None
    flat = FlatPlace(start=place.start, stop=place.stop) if isinstance(place, FlatRange) else None
    name = None if c.item.name == c.item.key else c.item.name
    if c.extents is not None:
        return ChunkEntry(box=box, flat=flat, name=name, block_bytes=c.block_bytes, checksums=c.checksums,
                          extents=[Extent(file=f, byte_range=[a, b]) for f, a, b in c.extents])
    return ChunkEntry(box=box, flat=flat, file=c.file, name=name,
                      byte_range=list(c.byte_range), block_bytes=c.block_bytes, checksums=c.checksums)


def build_manifest(prep: PreparedSave, written: list[WrittenFile], reused: list[WrittenChunk] = ()) -> Manifest:  # type: ignore[assignment]
    chunks: dict[str, list[WrittenChunk]] = {key: [] for key in prep.tensors}
    for c in [c for w in written for c in w.chunks] + list(reused):
        chunks[c.item.key].append(c)
    used = {f for cs in chunks.values() for c in cs for f, _, _ in (c.extents or ())}
    references = {name: entry for name, entry in (prep.base.files.items() if prep.base else ()) if name in used}
    tensors = {key: TensorEntry(kind=meta.kind, dtype=meta.dtype, shape=list(meta.shape),
                                chunks=[_entry(c) for c in sorted(chunks[key], key=lambda c: place_order(c.item.place))])
               for key, meta in prep.tensors.items()}
    return Manifest(
        format="resurgo.checkpoint", version=REFERENCING_VERSION if references else FORMAT_VERSION,
        created_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        step=prep.step, metadata=dict(prep.metadata or {}),
        save_info=dict(prep.save_info or {}), library=library_versions(),
        world={"size": prep.comm.size}, checksum_algorithm="xxh3-128", pickled=prep.pickled,
        files={w.path: FileEntry(bytes=w.nbytes, header_bytes=w.header_bytes, header_checksum=w.header_checksum)
               for w in sorted(written, key=lambda w: w.path)},
        references=dict(sorted(references.items())), tensors=tensors, tree=prep.tree,
    )


def write_index(prep: PreparedSave, written: list[WrittenFile]) -> WrittenFile:
    """Write and fsync this rank's index (format version 4): its data files and their chunks.
    Returned as a written file whose ``header_checksum`` is the xxh3-128 of the whole index, which
    the core records."""
    rank = prep.comm.rank
    names = [w.path for w in written]
    if names != [data_file_name(rank, i, prep.staging.file_tag) for i in range(len(names))]:
        raise AssertionError(f"rank {rank}'s data files {names} do not follow the naming rule of format version 4")
    chunks: dict[str, list[ChunkEntry]] = {}
    for c in sorted((c for w in written for c in w.chunks), key=lambda c: (c.item.key, place_order(c.item.place))):
        if c.item.place.numel:  # an empty chunk is listed nowhere
            chunks.setdefault(c.item.key, []).append(_entry(c))
    index = RankIndex(format=INDEX_FORMAT, version=INDEXED_VERSION, rank=rank, chunks=chunks,
                      files={w.path: FileEntry(bytes=w.nbytes, header_bytes=w.header_bytes,
                                               header_checksum=w.header_checksum) for w in written})
    raw = index.encode()
    t0 = time.perf_counter()
    path = index_file_name(rank, prep.staging.file_tag)
    handle = prep.staging.create(path)
    try:
        handle.write(memoryview(raw))
        handle.fsync()
    finally:
        handle.close()
    return WrittenFile(path, len(raw), 0, checksum.digest(raw), [], {"write": time.perf_counter() - t0})


def build_core(prep: PreparedSave, ranks: list[tuple[int, int, str]]) -> Manifest:
    """The version 4 manifest: each tensor's layout (:mod:`resurgo.plan.core_plan`) and each
    rank's count of data files with its index's size and digest (``ranks``, by rank)."""
    assert prep.job_plan is not None
    layouts = layouts_of(prep.job_plan)
    tensors = {}
    for key, meta in prep.tensors.items():
        layout = layouts[key]
        tensors[key] = TensorEntry(kind=meta.kind, dtype=meta.dtype, shape=list(meta.shape),
                                   **({"grid": layout} if isinstance(layout, GridEntry) else {"pieces": layout}))
    return Manifest(
        format="resurgo.checkpoint", version=INDEXED_VERSION,
        created_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        step=prep.step, metadata=dict(prep.metadata or {}),
        save_info=dict(prep.save_info or {}), library=library_versions(),
        world={"size": prep.comm.size}, checksum_algorithm="xxh3-128", pickled=prep.pickled,
        files={}, tensors=tensors, tree=prep.tree, file_tag=prep.staging.file_tag,
        ranks=RankFiles(files=[n for n, _, _ in ranks], index_bytes=[b for _, b, _ in ranks],
                        index_checksums=[d for _, _, d in ranks]),
    )
