"""The memory tier: checkpoints in each node's memory with replicas on another node's, restored
locally, from a peer, or from the durable tier (real processes, gloo: 4 ranks on 2 simulated
nodes, node = rank // 2, one root per node); and its pure parts (placement, the step memory can
rebuild, shares of a copy, the memory budget)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import resurgo
from resurgo.dist.comm import Comm
from resurgo.errors import MemoryBudgetError, RankFailedError, StorageError, UnsupportedValueError
from resurgo.manager import CheckpointManager, MemoryTier, Tier, daly_interval
from resurgo.manager.catalog import checkpoint_name
from resurgo.manager.memory import MemoryNodes
from resurgo.pipeline.verify import verify_checkpoint, verify_file_bytes
from resurgo.storage import local as local_storage
from resurgo.storage.local import CheckpointDir
from resurgo.storage.spare_pages import SPARE_DIR, SparePages
from resurgo.plan.memory_plan import (Holding, Nodes, Transfer, assign_held, choose_rebuild, node_bytes,
                                      replica_targets, replication, spread)

from dist_harness import run_ranks

WORLD = 4


def _files(root: Path, step: int) -> dict[str, bytes]:
    d = root / checkpoint_name(step)
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# -- real processes ------------------------------------------------------------------------------
def test_restore_from_local_memory_then_from_a_peer_after_a_node_is_replaced(tmp_path: Path):
    out = run_ranks(WORLD, "memory_workers:save_restore_replace", str(tmp_path))
    before = out[0]["listing"]  # every file once steps 1 and 2 were saved (and copied)
    mem0, mem1 = "mem/node0/" + checkpoint_name(2), "mem/node1/" + checkpoint_name(2)
    # keep_last=1 per node; each node holds its ranks' files and the other node's replicas
    node0 = {n[len(mem0) + 1:]: b for n, b in before.items() if n.startswith(mem0)}
    assert {n[len(mem1) + 1:]: b for n, b in before.items() if n.startswith(mem1)} == node0
    # and the pages of step 1's data files, deleted once step 2 was complete, for the next save
    spares = [n for n in before if n.startswith("mem/") and not n.startswith((mem0, mem1))]
    assert sorted(n.rsplit("/", 1)[0] for n in spares) == [f"mem/node{k}/{SPARE_DIR}" for k in (0, 0, 0, 0, 1, 1, 1, 1)]
    assert sorted(n for n in node0 if n.startswith("data/")) == [f"data/rank0000{r}-000.safetensors" for r in range(4)]
    # the durable tier got its copies, made from memory (each rank from its own node's files)
    assert {n[len("durable/step_000000002/"):]: b for n, b in before.items()
            if n.startswith("durable/step_000000002/")} == node0
    # interval="auto" measured the memory tier's save
    for r in out:
        assert r["cost"] > 0 and r["interval"] == pytest.approx(daly_interval(r["cost"], 3600.0))
    # restored from local memory (the durable data files were hidden), then from node 0's replicas
    assert [(r["local"], r["local_exact"]) for r in out] == [(2, True)] * WORLD
    assert [(r["replaced"], r["replaced_exact"]) for r in out] == [(2, True)] * WORLD
    # node 1 came back empty and holds the step again (its ranks' files and node 0's replicas)
    assert _files(tmp_path / "mem" / "node1", 2) == node0
    assert verify_checkpoint(tmp_path / mem1).ok


@pytest.mark.slow
def test_both_copies_lost_falls_back_to_the_newest_durable_step(tmp_path: Path):
    run_ranks(WORLD, "memory_workers:save_steps", str(tmp_path), [2, 3], 2)  # durable: step 2 only
    for node in ("node0", "node1"):  # rank 1's data is gone from both nodes' memory
        (tmp_path / "mem" / node / checkpoint_name(3) / "data" / "rank00001-000.safetensors").unlink()
    out = run_ranks(WORLD, "memory_workers:restore_only", str(tmp_path), 3)
    assert [(r["step"], r["exact"]) for r in out] == [(2, True)] * WORLD


@pytest.mark.slow
def test_sigkill_mid_replication_restores_the_previous_complete_step(tmp_path: Path):
    with pytest.raises(RankFailedError):
        run_ranks(WORLD, "memory_workers:kill_mid_replication", str(tmp_path), timeout=120)
    for node in ("node0", "node1"):
        names = os.listdir(tmp_path / "mem" / node)
        assert checkpoint_name(1) in names and checkpoint_name(2) not in names
    # node 1's staging of step 2 holds a verified replica already: it was never committed
    assert any(".resurgo-tmp-" in n for n in os.listdir(tmp_path / "mem" / "node1"))
    out = run_ranks(WORLD, "memory_workers:restore_only", str(tmp_path), 1)
    assert [(r["step"], r["exact"]) for r in out] == [(1, True)] * WORLD
    for node in ("node0", "node1"):  # the restarted managers removed what the killed save left
        assert os.listdir(tmp_path / "mem" / node) == [checkpoint_name(1)]


@pytest.mark.slow
def test_a_replica_corrupted_in_transit_fails_the_save_everywhere_and_is_never_committed(tmp_path: Path):
    out = run_ranks(WORLD, "memory_workers:corrupt_in_transit", str(tmp_path))
    kinds = {r["error"][0] for r in out}
    assert kinds == {"CorruptCheckpointError"}
    assert "received from rank 0 does not verify" in out[2]["error"][1]
    assert [(r["step"], r["exact"]) for r in out] == [(1, True)] * WORLD
    for node in ("node0", "node1"):
        assert os.listdir(tmp_path / "mem" / node) == [checkpoint_name(1)]


@pytest.mark.slow
def test_resume_from_memory_on_two_ranks_instead_of_four(tmp_path: Path):
    run_ranks(WORLD, "memory_workers:save_steps", str(tmp_path), [4])
    out = run_ranks(2, "memory_workers:resume_on_two", str(tmp_path), 4)
    assert [(r["step"], r["exact"]) for r in out] == [(4, True)] * 2


@pytest.mark.slow
def test_three_nodes_each_holding_two_of_three_files_keep_last_and_restore(tmp_path: Path):
    out = run_ranks(3, "memory_workers:three_nodes", str(tmp_path))
    files = [f"rank0000{r}-000.safetensors" for r in range(3)]
    for rank, r in enumerate(out):
        assert r["steps"] == [checkpoint_name(3)]  # keep_last=1 although no node holds every file
        assert r["spares"] == 2  # step 2's two files, deleted once step 3 was complete
        assert r["held"] == sorted([files[rank], files[(rank - 1) % 3]])  # its own and its predecessor's
        assert (r["restored"], r["exact"], r["after"]) == (3, True, files)


# -- pure parts ----------------------------------------------------------------------------------
def test_nodes_number_in_order_of_their_lowest_rank():
    nodes = Nodes.of(["b", "b", "a", "a", "c"])
    assert nodes.index == (0, 0, 1, 1, 2) and nodes.members == ((0, 1), (2, 3), (4,))
    assert nodes.leaders == (0, 2, 4) and nodes.leader(3) == 2


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6), replicas=st.integers(0, 5))
def test_replicas_go_to_distinct_other_nodes(sizes: list[int], replicas: int):
    ids = [k for k, n in enumerate(sizes) for _ in range(n)]
    nodes = Nodes.of(ids)
    if replicas and replicas >= len(sizes):
        with pytest.raises(UnsupportedValueError, match=rf"{len(sizes)} node\(s\), so at most {len(sizes) - 1}"):
            replica_targets(nodes, replicas)
        return
    targets = replica_targets(nodes, replicas)
    for rank, ts in enumerate(targets):
        homes = [ids[t] for t in ts]
        assert len(ts) == replicas and len(set(homes)) == replicas and ids[rank] not in homes
    transfers = replication([[(f"data/rank{r:05d}-000.safetensors", 10 + r)] for r in range(len(ids))], targets)
    assert len(transfers) == replicas * len(ids) and transfers == sorted(transfers)
    held = node_bytes([10 + r for r in range(len(ids))], nodes, targets)
    assert sum(held) == (replicas + 1) * sum(10 + r for r in range(len(ids)))


def _holding(digest: str, held: set[str], declared=("a", "b", "c")) -> Holding:
    return Holding(digest, {n: 10 for n in declared}, frozenset(held))


def test_rebuild_takes_the_newest_step_the_nodes_hold_between_them():
    holdings = {
        0: {5: _holding("x", {"a", "b"}), 4: _holding("y", {"a", "b", "c"})},
        2: {5: _holding("x", {"b"}), 4: _holding("y", {"a", "b", "c"})},  # nobody holds c of step 5
        4: {},
    }
    r = choose_rebuild(holdings)
    assert (r.step, r.digest, r.source) == (4, "y", 0)
    assert r.transfers == tuple(Transfer(0, n, 4, 10) for n in ("a", "b", "c"))  # the empty node gets all
    holdings[4] = {5: _holding("x", {"c"})}
    r = choose_rebuild(holdings)
    assert r.step == 5 and r.transfers == (Transfer(0, "a", 2, 10), Transfer(0, "a", 4, 10), Transfer(0, "b", 4, 10),
                                           Transfer(4, "c", 0, 10), Transfer(4, "c", 2, 10))
    assert choose_rebuild(holdings, only=4).step == 4 and choose_rebuild(holdings, only=3) is None
    assert choose_rebuild({0: {}, 2: {}}) is None


def test_rebuild_replaces_a_node_whose_manifest_differs():
    holdings = {0: {7: _holding("new", {"a", "b", "c"})}, 2: {7: _holding("new", {"a"})},
                4: {7: _holding("old", {"a", "b", "c"})}}
    r = choose_rebuild(holdings)
    assert (r.digest, r.source) == ("new", 0)
    assert [(t.name, t.dst) for t in r.transfers] == [("a", 4), ("b", 2), ("b", 4), ("c", 2), ("c", 4)]


@settings(max_examples=100, deadline=None)
@given(data=st.data(), ranks=st.integers(1, 6))
def test_copy_shares_take_each_file_once_from_a_rank_that_holds_it(data, ranks: int):
    files = [(f"f{i}", data.draw(st.integers(0, 1000))) for i in range(data.draw(st.integers(0, 12)))]
    held = [frozenset(data.draw(st.sets(st.sampled_from([n for n, _ in files]))) if files else set()) for _ in range(ranks)]
    if not all(any(n in h for h in held) for n, _ in files):
        with pytest.raises(ValueError, match="no rank holds it"):
            assign_held(files, held)
        return
    shares = assign_held(files, held)
    assert sorted(n for s in shares for n in s) == sorted(n for n, _ in files)
    assert all(n in held[r] for r, s in enumerate(shares) for n in s)
    assert assign_held(list(reversed(files)), held) == shares


class _Plan:
    def __init__(self, per_rank: list[int]):
        self.per_rank = per_rank

    def bytes_per_rank(self) -> list[int]:
        return self.per_rank


def test_node_bytes_is_checked_before_writing_and_names_root_bytes_and_budget(tmp_path: Path):
    tier = MemoryTier(replicas=0, root=tmp_path / "n{node}", node="a", node_bytes=1000)
    nodes = MemoryNodes(tier, Comm(0, 1))
    assert nodes.root == tmp_path / "na"
    nodes.check_budget(3, _Plan([1000]))  # exactly the budget: fits
    with pytest.raises(MemoryBudgetError) as e:
        nodes.check_budget(3, _Plan([1001]))
    msg = str(e.value)
    assert str(tmp_path / "na") in msg and "saving step 3 needs 1001 bytes" in msg and "node_bytes=1000" in msg
    assert not (tmp_path / "na").exists()
    # a manager: the second save needs room for both steps (the first goes once the second is complete)
    state = {"w": torch.arange(100, dtype=torch.float32)}
    tier = MemoryTier(replicas=0, root=tmp_path / "m", node=0, node_bytes=1500)
    with CheckpointManager(tiers=[tier], async_save=False) as mgr:
        mgr.save(state, 1)
        with pytest.raises(MemoryBudgetError, match=r"saving step 2 needs 400 bytes .* already there take \d+"):
            mgr.save(state, 2)
        assert mgr.steps() == [1] and os.listdir(tmp_path / "m") == [checkpoint_name(1)]


def test_memory_tier_refuses_bad_settings(tmp_path: Path):
    with pytest.raises(ValueError, match="replicas must be an int >= 0"):
        MemoryTier(replicas=-1)
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        MemoryTier(keep_last=0)
    with pytest.raises(UnsupportedValueError, match="the memory tier is a local directory"):
        MemoryTier(root="s3://bucket/x")
    with pytest.raises(UnsupportedValueError, match=r"1 node\(s\), so at most 0 replica"):
        CheckpointManager(tiers=[MemoryTier(replicas=1, root=tmp_path / "m", node=0)])
    with pytest.raises(ValueError, match="a MemoryTier first"):
        CheckpointManager(tiers=[Tier(tmp_path / "d"), MemoryTier(root=tmp_path / "m")])
    with pytest.raises(UnsupportedValueError, match="incremental saves do not go to a MemoryTier"):
        CheckpointManager(tiers=[MemoryTier(replicas=0, root=tmp_path / "m", node=0)], incremental=True)


def test_memory_tier_default_node_and_root(monkeypatch):
    monkeypatch.delenv("GROUP_RANK", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    tier = MemoryTier()
    assert tier.node_id(9) == 2
    monkeypatch.setenv("GROUP_RANK", "5")
    assert tier.node_id(9) == 5
    assert str(tier.root_for(5)).startswith("/dev/shm/resurgo-") and str(tier.root_for(5)).endswith("/job7/node-5")
    assert MemoryTier(root=lambda n: f"/x/{n}").root_for(3) == Path("/x/3")


def test_a_received_replica_is_verified_before_it_is_written(tmp_path: Path):
    resurgo.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path / "c")
    manifest = resurgo.read_manifest(tmp_path / "c")
    (name,) = manifest.files
    data = np.fromfile(tmp_path / "c" / name, dtype=np.uint8)
    assert verify_file_bytes(manifest, name, data, "peer") == []
    data[-7] ^= 1
    problems = verify_file_bytes(manifest, name, data, "peer")
    assert len(problems) == 1 and "does not match its checksum" in problems[0]
    assert "18 bytes, the manifest says" in verify_file_bytes(manifest, name, data[:18], "peer")[0]


def test_a_replica_is_received_into_its_file_in_place_and_sent_from_a_private_mapping(tmp_path: Path):
    staging = CheckpointDir(tmp_path / "c").stage(False)
    f = staging.create_mapped("data/a.safetensors", 10)
    assert len(f.view) == 10 and (tmp_path / os.listdir(tmp_path)[0] / "data" / "a.safetensors").stat().st_size == 10
    f.view[:] = b"0123456789"
    f.fsync()
    f.close()
    with pytest.raises(StorageError, match="a.safetensors"):  # never over an existing file
        staging.create_mapped("data/a.safetensors", 10)
    sent = staging.map_read("data/a.safetensors")
    assert bytes(sent.view) == b"0123456789"
    sent.view[0] = ord("x")  # what is sent may be changed (a test's fault): the file keeps its bytes
    sent.close()
    assert bytes(staging.map_read("data/a.safetensors").view) == b"0123456789"
    staging.commit(b"{}")
    committed = tmp_path / "c" / "data" / "a.safetensors"
    again = CheckpointDir(tmp_path / "d").stage(False)
    again.adopt("data/a.safetensors", committed)  # a file the node holds already: linked, not copied
    assert os.stat(again.tmp / "data" / "a.safetensors").st_ino == committed.stat().st_ino
    again.abort()


def test_data_files_in_memory_are_written_without_o_direct(tmp_path: Path, monkeypatch):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/root / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\nnone /mnt/my\\040ram ramfs rw 0 0\n")
    assert local_storage.in_memory_fs(Path("/dev/shm/x/y"), str(mounts))
    assert local_storage.in_memory_fs(Path("/mnt/my ram/x"), str(mounts))
    assert not local_storage.in_memory_fs(Path("/dev/shmx/y"), str(mounts))
    assert not local_storage.in_memory_fs(Path("/home/x"), str(mounts))
    asked, looked_up = [], []
    monkeypatch.setattr(local_storage, "DirectWriteHandle", lambda path, label, direct, reuse: asked.append(direct))
    for in_memory in (True, False):
        monkeypatch.setattr(local_storage, "in_memory_fs", lambda path: looked_up.append(path) or in_memory)
        staging = CheckpointDir(tmp_path / f"c{in_memory}").stage(False)
        staging.create("data/a.safetensors")
        staging.create("data/b.safetensors")
        staging.abort()
    assert asked == [False, False, True, True] and len(looked_up) == 2  # once per save


def test_a_rebuild_spreads_each_nodes_files_over_its_ranks():
    nodes = Nodes.of([0, 0, 1, 1, 1])
    transfers = [Transfer(0, n, 2, 10) for n in ("a", "b", "c", "d")] + [Transfer(2, "e", 0, 10)]
    assert spread(transfers, nodes) == sorted([Transfer(0, "a", 2, 10), Transfer(1, "b", 3, 10), Transfer(0, "c", 4, 10),
                                               Transfer(1, "d", 2, 10), Transfer(2, "e", 0, 10)])


def _data_file(root: Path, step: int) -> Path:
    (name,) = os.listdir(root / checkpoint_name(step) / "data")
    return root / checkpoint_name(step) / "data" / name


def test_a_deleted_step_leaves_its_pages_to_the_next_save_and_only_resurgos_files(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(local_storage, "in_memory_fs", lambda path: True)  # tmp_path is on disk: pretend tmpfs
    root = tmp_path / "m"
    pool = SparePages(root)
    tier = MemoryTier(replicas=0, keep_last=1, root=root, node=0)
    states = {s: {"w": torch.arange(1000 * (5 - s), dtype=torch.float32) + s} for s in range(1, 5)}  # shrinking
    with CheckpointManager(tiers=[tier], async_save=False) as mgr:
        mgr.save(states[1], 1)
        first = _data_file(root, 1).stat()
        mgr.save(states[2], 2)
        mgr.wait()
        assert [(size, (pool.path / name).stat().st_ino) for size, name in pool.files()] == [
            (first.st_size, first.st_ino)]
        (pool.path / "notes.txt").write_text("mine")  # not resurgo's: never taken nor deleted
        os.symlink(tmp_path, pool.path / "page-0123456789ab")
        mgr.save(states[3], 3)
        mgr.wait()
        third = _data_file(root, 3)
        assert third.stat().st_ino == first.st_ino  # written over step 1's pages, cut to its own size
        assert third.stat().st_size == resurgo.read_manifest(root / checkpoint_name(3)).files[
            "data/" + third.name].bytes
        assert verify_checkpoint(root / checkpoint_name(3)).ok
        os.link(third, tmp_path / "linked")  # a file with another link keeps its pages where they are
        mgr.save(states[4], 4)
        mgr.wait()
        assert pool.files() == [] and (tmp_path / "linked").stat().st_nlink == 1
        target = {"w": torch.zeros(1000)}
        assert mgr.restore(target) == 4 and torch.equal(target["w"], states[4]["w"])
    assert sorted(os.listdir(pool.path)) == ["notes.txt", "page-0123456789ab"]
    assert (pool.path / "notes.txt").read_text() == "mine"


def test_spare_pages_count_against_node_bytes_and_go_first(tmp_path: Path):
    tier = MemoryTier(replicas=0, root=tmp_path / "n", node=0, node_bytes=1000)
    nodes = MemoryNodes(tier, Comm(0, 1))
    pool = SparePages(nodes.root)
    pool.path.mkdir(parents=True)
    spare = tmp_path / "freed"
    spare.write_bytes(bytes(600))
    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert pool.keep_at(folder, spare.name) and not spare.exists()
    finally:
        os.close(folder)
    nodes.check_budget(3, _Plan([400]))  # the save takes the pages over: 1000 bytes at most
    assert [size for size, _ in pool.files()] == [600]
    nodes.check_budget(3, _Plan([500]))  # 1100 if it could not: the spare pages are freed instead
    assert pool.files() == []


@pytest.mark.slow
def test_bytes_read_from_a_peer_that_do_not_verify_are_never_loaded(tmp_path: Path):
    out = run_ranks(WORLD, "memory_workers:corrupt_peer_read", str(tmp_path))
    assert [(r["step"], r["exact"]) for r in out] == [(2, True)] * WORLD  # from the durable tier
    for rank in (2, 3):  # the ranks whose reads came from node 0
        (warned,) = [w for w in out[rank]["warnings"] if "from memory" in w]
        assert "does not match its xxh3-128 checksum" in warned and "trying the durable tiers" in warned
    assert out[2]["node1"] == ["manifest.json"]  # node 1 holds the step's manifest, and no unverified byte


def test_digests_hashed_as_a_replica_arrived_are_compared_not_trusted_blindly(tmp_path: Path):
    resurgo.save({"w": torch.arange(1 << 18, dtype=torch.float32)}, tmp_path / "c")  # 1 MiB: 4 KiB blocks
    manifest = resurgo.read_manifest(tmp_path / "c")
    (name,) = manifest.files
    chunk = manifest.tensors["w"].chunks[0]
    start, bb = chunk.byte_range[0], chunk.block_bytes
    data = np.fromfile(tmp_path / "c" / name, dtype=np.uint8)
    good = {(start + i * bb, start + (i + 1) * bb): d for i, d in enumerate(chunk.checksums)}
    assert verify_file_bytes(manifest, name, data, "peer", good) == []
    # a block's digest taken as it arrived is what is compared: one that differs is found
    bad = dict(good)
    bad[(start + 3 * bb, start + 4 * bb)] = "0" * 32
    problems = verify_file_bytes(manifest, name, data, "peer", bad)
    assert len(problems) == 1 and "block 3 does not match its checksum" in problems[0]
    # bytes with no digest of exactly their block are hashed: a flipped byte there is found
    data[start + 5 * bb + 1] ^= 1
    partial = {k: v for k, v in good.items() if k != (start + 5 * bb, start + 6 * bb)}
    partial[(start + 5 * bb, start + 5 * bb + 8)] = "f" * 32  # not a block: ignored
    problems = verify_file_bytes(manifest, name, data, "peer", partial)
    assert len(problems) == 1 and "block 5 does not match its checksum" in problems[0]


def test_a_file_is_sent_from_its_sources_as_the_bytes_it_is_written_as(tmp_path: Path, monkeypatch):
    from resurgo.pipeline import replicate
    from resurgo.pipeline.buffers import TensorStream
    from resurgo.pipeline.save import LazySources, prepare_save, write_and_commit

    monkeypatch.setattr(replicate, "PIECE_BYTES", 64 << 10)  # several pieces per chunk
    state = {"a": torch.arange(1 << 16, dtype=torch.float32), "b": torch.arange(300, dtype=torch.int16), "s": 7}
    prep = prepare_save(state, tmp_path / "c", overwrite=False, allow_pickle=False, step=None, metadata=None,
                        io_threads=1, block_bytes=None)
    sources = LazySources(prep.leaves)
    (plan,) = prep.plan.files
    staged = replicate.StagedFile(plan, sources)
    pieces = staged.pieces
    assert staged.sendable and pieces[0].start == 0 and pieces[-1].stop == staged.nbytes
    assert all(p.stop == q.start for p, q in zip(pieces, pieces[1:]))  # back to back, every byte once
    sent = b"".join(bytes(staged.view(p)) for p in pieces)
    write_and_commit(prep, sources)
    assert sent == (tmp_path / "c" / plan.path).read_bytes()
    manifest = resurgo.read_manifest(tmp_path / "c")
    # each chunk's pieces hold whole checksum blocks from the chunk's start: hashed on arrival
    for key in ("a", "b"):
        c = manifest.tensors[key].chunks[0]
        mine = [p for p in pieces if c.byte_range[0] <= p.start < c.byte_range[1]]
        assert {p.block_bytes for p in mine} == {c.block_bytes} and len(mine) > (key == "a")
        assert all((p.start - c.byte_range[0]) % c.block_bytes == 0 for p in mine)
    # a chunk whose bytes are not in host memory as one buffer: the file is sent once written
    streamed = {k: (TensorStream(torch.as_tensor(v)) if k == "a" else v) for k, v in sources.items()}
    assert not replicate.StagedFile(plan, streamed).sendable
