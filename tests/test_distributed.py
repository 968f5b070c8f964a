"""Distributed save and universal load on real processes (gloo, CPU).

Every save layout x every load layout x world sizes 1 to 4, compared bitwise with the reference
tensors; per-rank values; errors raised identically on every rank; bytes read by a resharded load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import resurgo
from dist_harness import run_ranks
from dist_workers import DIM0_LAYOUTS, LAYOUTS, bits, reference
from helpers import bits_equal

WORLDS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[tuple[int, str]]]:
    root = tmp_path_factory.mktemp("dist")
    for n in WORLDS:
        run_ranks(n, "dist_workers:save_layouts", str(root), LAYOUTS)
    return root, [(n, layout) for n in WORLDS for layout in LAYOUTS]


# Default: every save layout x every load layout, load worlds 1 and 2 (3 and 4 slow) each reading
# other worlds' saves; the slow variant loads every world's saves on every world (make test-slow).
SOURCE_WORLDS = {1: (3,), 2: (1, 4), 3: (4,), 4: (2,)}


@pytest.mark.parametrize("world", [w if w in (1, 2) else pytest.param(w, marks=pytest.mark.slow) for w in WORLDS])
def test_every_layout_loads_into_every_layout(saved, world):
    root, checkpoints = saved
    _check_matrix(root, world, [(n, layout) for n, layout in checkpoints if n in SOURCE_WORLDS[world]])


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_every_layout_loads_into_every_layout_from_every_world(saved, world):
    root, checkpoints = saved
    _check_matrix(root, world, checkpoints)


def _check_matrix(root, world, checkpoints):
    results = run_ranks(world, "dist_workers:load_layouts", str(root), checkpoints, LAYOUTS)
    problems = [p for r in results for p in r["problems"]]
    assert problems == []
    # Dim-0 resharding of a 2 MiB tensor saved by several ranks reads at most 1.05x what a rank needs.
    for r in results:
        for name, (read, need) in r["d_bytes"].items():
            src, dst = name.split("->")
            n = int(src.split("-")[0][1:])
            if dst in DIM0_LAYOUTS and src.split("-", 1)[1] in DIM0_LAYOUTS + ["plain", "dt_rep"] and need:
                assert read <= 1.05 * need, (name, read, need)


def test_consolidation_without_torch_distributed(saved):
    root, checkpoints = saved
    ref = reference()
    for n, layout in checkpoints:
        path = root / f"n{n}-{layout}"
        full = resurgo.load_dict(path)
        for k, v in ref.items():
            assert bits_equal(full[k], v), (path, k)
        assert full["step"] == 11
        # per-rank values come back as PerRank holding every rank's value
        assert full["rng"].saved is not None and len(full["rng"].saved) == n
        assert [t.tolist() for t in full["rng"].saved] == [[r] * 4 for r in range(n)]
        if n > 1:
            assert full["rank_value"].saved == list(range(n))
        else:
            assert full["rank_value"] == 0
        # and into plain full tensors in place
        target = {k: torch.zeros_like(v) for k, v in ref.items()}
        resurgo.load(target, path, strict=False)
        assert all(bits_equal(target[k], ref[k]) for k in ref)


def test_replicas_are_written_once_and_bytes_balance(saved):
    root, _ = saved
    ref = reference()
    total = sum(v.numel() * v.element_size() for v in ref.values())
    for n in WORLDS:
        for layout in ("plain", "dt_rep"):
            m = resurgo.read_manifest(root / f"n{n}-{layout}")
            assert m.world == {"size": n}
            for k, v in ref.items():
                assert len(m.tensors[k].chunks) == 1  # one copy, not n
            per_file = {}
            for k in ref:
                c = m.tensors[k].chunks[0]
                rank = int(c.file.split("rank")[1][:5])
                per_file[rank] = per_file.get(rank, 0) + c.nbytes
            assert sum(per_file.values()) == total
            # largest first to the least loaded: the 2 MiB tensor sits alone on its rank
            if n > 1:
                assert len(per_file) == min(n, len(ref))
        m = resurgo.read_manifest(root / f"n{n}-dt_s0")
        assert sum(c.nbytes for c in m.tensors["d"].chunks) == 512 * 1024 * 4
        assert len(m.tensors["d"].chunks) == n
        # per-rank tensors: one per saving rank, under key@rankN
        assert sorted(k for k in m.tensors if k.startswith("rng@")) == [f"rng@rank{r}" for r in range(n)]


def test_per_rank_values_same_world_and_resized(saved):
    root, _ = saved
    path = str(root / "n3-dt_s0")
    same = run_ranks(3, "dist_workers:per_rank_roundtrip", path, 3)
    assert [r["rank_value"] for r in same] == [0, 1, 2]
    assert [r["rng"] for r in same] == [[r] * 4 for r in range(3)]
    resized = run_ranks(2, "dist_workers:per_rank_roundtrip", path, 3)
    for r, out in enumerate(resized):
        assert "saved per rank by 3 ranks, loaded by 2" in out["plain_error"]
        assert out["resized"] == [r + 100] * 4
        assert out["saved_count"] == 3


def test_repeated_saves_of_one_layout_reuse_the_plan(tmp_path):
    results = run_ranks(2, "dist_workers:repeated_saves", str(tmp_path))
    assert (results[0]["hits"], results[0]["hits_after_new_layout"]) == (2, 2)  # the coordinator's cache
    assert results[1]["hits"] == 0  # other ranks do not plan
    full = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)
    for step in (1, 2, 3):
        got = resurgo.load_dict(tmp_path / f"c{step}")
        assert torch.equal(got["w"], full * step) and got["step"] == step and got["s"].item() == step
    assert torch.equal(resurgo.load_dict(tmp_path / "c4")["w"], full)


def test_overlapping_shards_and_partial_dtensors_fail_on_every_rank_and_commit_nothing(tmp_path):
    path = tmp_path / "overlap"
    outcomes = run_ranks(2, "dist_workers:refused_layouts", str(path))
    partial = {p for _, p in outcomes}
    assert len(partial) == 1 and partial.pop().startswith(
        "UnsupportedValueError: rank 0 failed: key 'p': a DTensor with a Partial placement holds unreduced values")
    results = [o for o, _ in outcomes]
    assert len(set(results)) == 1, results  # the same error on every rank
    assert results[0].startswith("ShardingError: ") and "tensor 'x'" in results[0] and "overlap" in results[0]
    assert not path.exists() and os.listdir(tmp_path) == []


def test_a_failing_rank_fails_every_rank_and_keeps_the_old_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    outcomes = run_ranks(2, "dist_workers:good_then_failing", str(path), str(tmp_path / "new"), 1)
    assert [good for good, _ in outcomes] == ["saved", "saved"]
    results = [bad for _, bad in outcomes]
    assert len(set(results)) == 1, results
    assert results[0].startswith("StorageError: rank 1 failed") and "injected" in results[0]
    assert not (tmp_path / "new").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directory left behind
    assert resurgo.read_manifest(path).world == {"size": 2}  # the earlier checkpoint is intact
    resurgo.load_dict(path)


def test_async_save_on_every_rank_snapshots_and_reshards(tmp_path):
    results = run_ranks(2, "dist_workers:async_then_load", str(tmp_path / "async"))
    assert results == [[], []]
    assert resurgo.read_manifest(tmp_path / "async").world == {"size": 2}


def test_manager_decisions_and_async_commits_do_not_cross(tmp_path):
    results = run_ranks(2, "dist_workers:manager_async_every_step", str(tmp_path / "root"), timeout=120)
    assert results == [[11, 12], [11, 12]]
    full = resurgo.load_dict(tmp_path / "root" / "step_000000012")
    assert full["step"] == 12 and bits_equal(full["w"], torch.arange(4096, dtype=torch.float32).reshape(64, 64) + 12)


def test_shared_reads_read_each_replicated_byte_once(tmp_path):
    results = run_ranks(4, "dist_workers:shared_reads", str(tmp_path))
    ref = reference()
    state_bytes = sum(v.numel() * v.element_size() for v in ref.values())
    d_bytes = ref["d"].numel() * ref["d"].element_size()
    assert all(r["equal"] for r in results)
    assert all(r["shared"][0] for r in results) and not any(r["auto"] for r in results)  # one host, local files
    assert sum(r["shared"][1] for r in results) == state_bytes  # not 4x
    for r in results:
        assert r["shared"][1] + r["shared"][2] == state_bytes  # each rank gets every byte exactly once
        assert 0 < r["shared"][3] < 2048  # one fingerprint each, no need lists: all needs are the same
        assert r["unshared"] == (False, state_bytes, 0)
    # Mixed needs: ranks 0 and 1 need all of "d", ranks 2 and 3 half each: "d" is read once in all.
    assert all(r["mixed"][0] for r in results)
    assert sum(r["mixed"][1] for r in results) == d_bytes
    # The unit shared is a piece of a chunk (up to 16 MiB): the 2 MiB chunk reaches every rank whole.
    assert [r["mixed"][1] + r["mixed"][2] for r in results] == [d_bytes] * 4
    # The same error on every rank; each ends by listing its own tensors loaded and left untouched.
    damaged = {r["damaged"].split(" Of the ")[0] for r in results}
    assert len(damaged) == 1, damaged
    assert all(f" on rank {rank}, " in r["damaged"] for rank, r in enumerate(results))
    message = damaged.pop()
    assert message.startswith("CorruptCheckpointError: rank ") and "'d'" in message and ".safetensors" in message


def test_ranks_passing_different_share_reads_all_refuse_the_load(tmp_path):
    pairs = [(False, None), (True, False), (None, True)]
    results = run_ranks(2, "dist_workers:mixed_share_reads", str(tmp_path), pairs)
    for i, (first, second) in enumerate(pairs):
        refused = {r["refused"][i] for r in results}
        assert len(refused) == 1, refused  # the same error on every rank
        message = refused.pop()
        assert message.startswith(f"UnsupportedValueError: {tmp_path / 'replicated'}: the ranks of one load passed "
                                  f"different share_reads ({first!r} on rank 0; {second!r} on rank 1)"), message
        assert message.endswith("pass the same value on every rank")
    assert all(r["after"] and r["equal"] for r in results)  # no collective was left unpaired


def test_shared_reads_are_on_by_default_for_an_object_store(s3_bucket):
    url, options = s3_bucket
    results = run_ranks(2, "dist_workers:shared_reads_object_store", f"{url}/replicated", options)
    ref = reference()
    state_bytes = sum(v.numel() * v.element_size() for v in ref.values())
    assert all(r["shared"] and r["equal"] for r in results)
    assert sum(r["bytes_read"] for r in results) == state_bytes  # each replicated byte read from storage once
    for r in results:
        assert r["bytes_received"] > 0 and r["bytes_read"] + r["bytes_received"] == state_bytes
