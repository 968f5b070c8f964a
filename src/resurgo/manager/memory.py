"""The memory tier of a CheckpointManager: checkpoints in each node's memory, replicated to
other nodes' memory, restored from a peer when a node is lost.

Gemini (SOSP'23), REFT and Orbax's emergency checkpointing keep checkpoints in CPU memory, locally
and on peers, so that a job can save every few steps and restore in seconds; durable storage is
the last resort. Here each node has its own root (``/dev/shm`` by default: it survives the
training process, not the machine). A save writes every rank's data files into its node's root
and, from the same bytes while it writes them, sends them to ``replicas`` ranks on other nodes
(:func:`resurgo.plan.memory_plan.replica_targets`), which receive them into their node's staging
(:mod:`resurgo.pipeline.replicate`); once every rank's files are written, they verify every
checksum of the replicas before keeping them; only once that succeeded on every rank does each
node's lowest rank commit its node's directory (the coordinator's manifest, the same bytes on every node). A committed node directory
therefore always belongs to a step that was complete, with its replicas, everywhere.

Restore: the nodes' leaders report what their roots hold; every rank agrees on the newest step
whose files the nodes hold among them (:func:`resurgo.plan.memory_plan.choose_rebuild`); each node
that lacks files of it commits a directory of the step with the files it holds; every rank loads
from its own node's root with the ordinary verified load, whose reads of the files its node lacks
are received from a rank that holds them (:mod:`resurgo.pipeline.peer_read`). Once the restore
has returned, those nodes receive the files they lack (verified) in the background and commit
the complete step (:class:`Refill`): a node that came back empty holds its replicas again before
the next save or load runs.
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
import threading
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from resurgo.dist.comm import Comm
from resurgo.errors import CorruptCheckpointError, MemoryBudgetError, ResurgoError, UnsupportedValueError
from resurgo.format.checksum import digest
from resurgo.format.manifest import MANIFEST_NAME, declared_files, parse_manifest
from resurgo.manager.catalog import checkpoint_name, step_of, temporary_target
from resurgo.pipeline import replicate
from resurgo.pipeline.collective import NodeLocal
from resurgo.pipeline.peer_read import PeerFiles
from resurgo.plan.global_plan import GlobalPlan
from resurgo.plan.save_plan import FilePlan
from resurgo.renamed import renamed_keywords
from resurgo.plan.memory_plan import (Holding, Nodes, Rebuild, assign_held, choose_rebuild, node_bytes,
                                      replica_targets, replication, spread)
from resurgo.storage.base import Staging
from resurgo.storage.local import CheckpointDir, LocalRoot, LocalStaging
from resurgo.storage.open import is_url
from resurgo.storage.spare_pages import SparePages

log = logging.getLogger("resurgo.manager")
SHM = "/dev/shm"
JOB_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")  # the job's id, for the default root


def _positive_int(name: str, value: Any, minimum: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"MemoryTier: {name} must be an int >= {minimum} or None, not {value!r}")


@renamed_keywords("MemoryTier", memory_budget="node_bytes")
@dataclass(frozen=True)
class MemoryTier:
    """The first tier of a CheckpointManager, in each node's memory with replicas on other nodes.

    ``replicas``: how many other nodes hold a copy of each rank's data (rank ``r``, the ``j``-th of
    its node, sends to the ``j``-th rank of each of the next ``replicas`` nodes). ``keep_last``:
    steps kept in each node's root, a rule of this tier as a :class:`Tier`'s ``keep_last`` is (the
    manager's ``keep_last=`` beside it raises UnsupportedValueError). ``root``: each node's directory: None for
    ``/dev/shm/resurgo-<user>/<job id>/node-<node>``; a path, in which ``{node}`` is replaced by
    the node's identity; or a callable ``root(node) -> path``. ``node``: this process's node
    identity (an int or a str; or a callable ``node(rank)``); None takes ``GROUP_RANK``, else
    ``rank // LOCAL_WORLD_SIZE``, else the hostname. ``node_bytes`` (old name ``memory_budget``,
    deprecated): the most bytes the checkpoints in one node's root may take; a save that would exceed it raises MemoryBudgetError
    before writing anything (the previous step stays until the new one is complete, so the budget
    must hold ``keep_last + 1`` steps). A deleted step's data files stay in the root as spare pages
    for the next save (:mod:`resurgo.storage.spare_pages`), emptied first when the budget needs it.
    """

    replicas: int = 1
    keep_last: int | None = 1
    root: str | os.PathLike | Callable[[Any], str | os.PathLike] | None = None
    node: Hashable | Callable[[int], Hashable] | None = None
    node_bytes: int | None = None

    copy_every_steps = None  # it takes every save, as the first tier does
    storage_options = None  # a local directory

    def __post_init__(self) -> None:
        _positive_int("replicas", self.replicas, 0)
        _positive_int("keep_last", self.keep_last, 1)
        _positive_int("node_bytes", self.node_bytes, 1)
        if isinstance(self.root, (str, os.PathLike)) and is_url(self.root):
            raise UnsupportedValueError(f"MemoryTier(root={self.root!r}): the memory tier is a local directory "
                                        "(in /dev/shm by default); put object stores in a later Tier")

    def node_id(self, rank: int) -> Hashable:
        """This process's node identity (see the class docstring)."""
        if callable(self.node):
            return self.node(rank)
        if self.node is not None:
            return self.node
        if os.environ.get("GROUP_RANK"):
            return int(os.environ["GROUP_RANK"])
        if os.environ.get("LOCAL_WORLD_SIZE"):
            return rank // max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
        return socket.gethostname()

    def root_for(self, node: Hashable) -> Path:
        """The directory of ``node``'s checkpoints."""
        if callable(self.root):
            return Path(self.root(node))
        if self.root is None:
            job = next((os.environ[k] for k in JOB_ENV if os.environ.get(k)), "default")
            return Path(SHM) / f"resurgo-{getpass.getuser()}" / job / f"node-{node}"
        text = os.fspath(self.root)
        return Path(text.replace("{node}", str(node)))


def holdings(root: Path) -> dict[int, Holding]:
    """The committed steps of a node's root and which of their data files it holds (listing and
    manifests only; the load verifies the bytes)."""
    store = LocalRoot(root)
    found: dict[int, Holding] = {}
    for listing in store.listings(select=lambda name: step_of(name) is not None):
        step = step_of(listing.name)
        if step is None or not listing.has_manifest:
            continue
        ckpt = store.open(listing.name)
        try:
            raw = ckpt.read_manifest_bytes()
            manifest = parse_manifest(raw, ckpt.describe(MANIFEST_NAME))
        except (ResurgoError, OSError):
            continue  # not restorable from here; the other nodes may hold it
        if manifest.step != step or manifest.references:
            continue
        declared = {name: entry.bytes for name, entry in manifest.files.items()}
        held = frozenset(n for n, size in declared.items() if listing.files.get(n) == size)
        found[step] = Holding(digest(raw), declared, held)
    return found


class MemoryNodes:
    """One manager's view of the memory tier: its node, its root, where its replicas go.
    Made collectively (every rank, in the same order) over the manager's control channel."""

    def __init__(self, tier: MemoryTier, comm: Comm):
        self.tier = tier
        me = tier.node_id(comm.rank)
        root = tier.root_for(me)
        everyone = comm.all_gather((me, socket.gethostname(), str(root.absolute())))
        self.nodes = Nodes.of([n for n, _, _ in everyone])
        self.targets = replica_targets(self.nodes, tier.replicas)
        seen: dict[tuple[str, str], Hashable] = {}
        for node, host, path in everyone:
            other = seen.setdefault((host, path), node)
            if other != node:
                raise UnsupportedValueError(
                    f"MemoryTier: nodes {other!r} and {node!r} both use {path} on {host}; each node needs a root "
                    "of its own (put {node} in root=, or pass root=callable)")
        self.rank = comm.rank
        self.node = me
        self.root = root
        self.leader = self.nodes.leader(comm.rank)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def path_for(self, step: int) -> Path:
        return self.root / checkpoint_name(step)

    def open_root(self) -> LocalRoot:
        """This node's root, whose deleted steps leave their data files' pages to the next save."""
        return LocalRoot(self.root, spare_pages=True)

    # -- saving -----------------------------------------------------------------------------------
    def node_local(self, step: int, comm: Callable[[], Comm]) -> NodeLocal:
        """How the save of ``step`` writes into this node's root and replicates (``comm()``: the
        save's channel, asked for in the thread that writes)."""
        return NodeLocal(self.leader, lambda plan: self.check_budget(step, plan),
                         lambda staging, files, sources: self.replicate(comm(), staging, files, sources))

    def used_bytes(self) -> int:
        """The bytes of the checkpoints (and leftovers of saves) in this node's root."""
        return sum(found.total_bytes for found in LocalRoot(self.root).listings(
            select=lambda name: step_of(name) is not None or temporary_target(name) is not None))

    def check_budget(self, step: int, plan: GlobalPlan) -> None:
        """MemoryBudgetError, before anything is written, when the save of ``step`` would take this
        node's root over the budget."""
        budget = self.tier.node_bytes
        if budget is None:
            return
        k = self.nodes.index[self.rank]
        per_rank = plan.bytes_per_rank()
        needed = node_bytes(per_rank, self.nodes, self.targets)[k]
        own = sum(per_rank[r] for r in self.nodes.members[k])
        used = self.used_bytes()
        spares = SparePages(self.root)
        if used + needed + spares.nbytes() > budget:
            spares.clear()  # the save could not take them all over: their pages are freed, not counted
        if used + needed > budget:
            raise MemoryBudgetError(
                f"{self.root}: saving step {step} needs {needed} bytes in node {self.node!r}'s memory ({own} of its "
                f"ranks' data and {needed - own} of replicas it holds for other nodes), and the checkpoints already "
                f"there take {used}: {used + needed} bytes, over node_bytes={budget}. Nothing was "
                "written. Raise node_bytes (it must hold keep_last + 1 steps: the old ones go only once the new "
                "one is complete everywhere), or lower keep_last or replicas")

    def replicate(self, comm: Comm, staging: Staging, files: Sequence[FilePlan],
                  sources: Mapping[str, Any]) -> replicate.SaveExchange:
        """Start sending this rank's data files (``files``, written from ``sources``) to its replica
        targets and receiving the replicas this node holds into the node's staging, before the
        files are written; verified once the manifest is known (every rank; collective)."""
        # A memory root is a local directory: its staging (LocalStaging) maps the replicas it
        # receives (and, for a file not sent from its sources, what it wrote), so no file is
        # copied beside its bytes in the node's memory.
        assert isinstance(staging, LocalStaging)
        staged = [replicate.StagedFile(f, sources) for f in files]
        _, everyone = comm.agree_noting(lambda: (None, [(f.path, f.nbytes, f.pieces) for f in staged]))
        transfers = replication([[(name, size) for name, size, _ in own] for own in everyone], self.targets)
        pieces = {(r, name): p for r, own in enumerate(everyone) for name, _, p in own}
        return replicate.SaveExchange(comm, transfers, pieces, str(self.root), staged,
                                      sink=staging.create_mapped, written=staging.map_read)

    # -- restoring --------------------------------------------------------------------------------
    def rebuild(self, comm: Comm, only: int | None = None) -> Rebuild | None:
        """The step every rank agrees memory can rebuild (``only``: that step), or None."""
        mine = comm.agree(lambda: holdings(self.root) if self.is_leader else None)
        everyone = comm.all_gather(mine)
        return choose_rebuild({r: h for r, h in enumerate(everyone) if h is not None}, only)

    def open_for_load(self, comm: Comm, rebuild: Rebuild) -> PeerFiles | None:
        """Make the chosen step loadable on every node before any file moves: each node that lacks
        files of it commits a directory of the step with the files it holds and the manifest of
        the node they come from (a node directory may hold only some of its step's files), and
        every rank learns which peer rank sends it each file its node lacks (the load reads
        those bytes from there: :mod:`resurgo.pipeline.peer_read`). None when every node holds
        every file. Collective."""
        if not rebuild.transfers:
            return None
        self.fetch(comm, rebuild, receive=False)
        mine = self.nodes.index[self.rank]
        return PeerFiles({t.name: t.src for t in spread(rebuild.transfers, self.nodes)
                          if self.nodes.index[t.dst] == mine})

    def refill(self, comm: Comm, rebuild: Rebuild) -> "Refill | None":
        """After a restore loaded ``rebuild``'s step: give every node that lacked files of it the
        whole step again (:meth:`fetch`), in a background thread on ``comm`` (the save and load
        channel: the next save or load waits for it first). None when there is nothing to send."""
        if not rebuild.transfers:
            return None
        return Refill(str(self.path_for(rebuild.step)), lambda: self.fetch(comm, rebuild))

    def fetch(self, comm: Comm, rebuild: Rebuild, receive: bool = True) -> None:
        """Give every node that lacks files of the chosen step a complete, committed directory of
        it: the files it holds and those received from peers (verified), with the manifest of
        the node they come from (``receive=False``: only the files it holds). Collective."""
        if not rebuild.transfers:
            return
        path = self.path_for(rebuild.step)
        raw = comm.all_gather(CheckpointDir(path).read_manifest_bytes() if self.rank == rebuild.source else None)
        source_raw = raw[rebuild.source]
        assert source_raw is not None
        manifest = parse_manifest(source_raw, f"rank {rebuild.source}'s manifest of step {rebuild.step}")
        # Each leader opens its node's staging; every rank of the node writes what it receives there.
        incoming = {t.name for t in rebuild.transfers if t.dst == self.leader}
        staging: LocalStaging | None = None
        held = CheckpointDir(path)

        def prepare() -> None:
            nonlocal staging
            if self.rank not in rebuild.receivers():
                return
            staging = held.stage(True, declared_files)
            for name in sorted(set(manifest.files) - incoming):  # what this node holds already
                staging.adopt(name, held.resolve(name))

        def commit() -> None:
            if staging is not None:
                staging.commit(source_raw)

        try:
            comm.agree(prepare)
            mine = comm.all_gather(staging)[self.leader]  # None on a node that receives nothing: never written to
            if receive:
                comm.agree(lambda: replicate.exchange(
                    comm, spread(rebuild.transfers, self.nodes), manifest, str(path), source=held.map_read,
                    sink=lambda name, nbytes: mine.create_mapped(name, nbytes)))  # type: ignore[union-attr]
            comm.agree(commit)
        except BaseException:
            if staging is not None:
                staging.abort()
            raise

    def committed_steps(self) -> frozenset[int]:
        """The steps this node's root holds committed (with some or all of their files)."""
        return frozenset(holdings(self.root))

    def held_files(self, step: int) -> frozenset[str]:
        found = holdings(self.root).get(step)
        return found.held if found is not None else frozenset()

    def copy_share(self, step: int) -> Callable[[list[tuple[str, int]], Comm], list[str]]:
        """For a copy of ``step`` to a durable tier: each rank copies files its node holds."""
        def share(files: list[tuple[str, int]], comm: Comm) -> list[str]:
            held = comm.all_gather(self.held_files(step))
            try:
                return assign_held(files, held)[comm.rank]
            except ValueError as e:
                raise CorruptCheckpointError(f"{self.path_for(step)}: cannot copy step {step} from memory: {e} "
                                             "in any node's memory") from None
        return share


class Refill:
    """A node's re-replication after a restore, running in a background thread; an in-flight
    operation (:mod:`resurgo.pipeline.inflight`): the next save or load waits for it. A failure
    is warned about, not raised: the step is restored, and the next save replicates anew."""

    def __init__(self, path: str, work: Callable[[], None]):
        self.path = path
        self._thread = threading.Thread(target=self._run, args=(work,), name="resurgo-refill", daemon=True)
        self._error: BaseException | None = None
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - reported by _settle, on the caller's thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for it to end (a failure is warned about)."""
        self._settle()

    def _settle(self) -> None:
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            warnings.warn(f"resurgo: {self.path}: re-replicating the restored step to the nodes that lacked it "
                          f"failed: {error}; the next save replicates anew", stacklevel=3)
        else:
            log.info("%s: every node holds the restored step again", self.path)
