"""Format version 4 on real processes: an O(tensors) core, one index per rank, and loads that read
only the indexes they need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import resurgo
from dist_harness import run_ranks
from indexed_workers import _rows, sharded_state
from resurgo.errors import CorruptCheckpointError, ManifestError
from resurgo.format.index import index_file_name
from test_format_spec import load_reader

TENSORS = 1000


@pytest.mark.parametrize("worlds", [(2, 4), pytest.param((2, 4, 8), marks=pytest.mark.slow)])
def test_metadata_a_loading_rank_reads_stays_flat_as_the_world_grows(tmp_path, worlds):
    """Each rank of 2 and 4 (and 8, in the slow run) saves and reloads 1,000 sharded tensors and a
    replicated one: the manifest stays one entry per tensor, and a rank reads the manifest, its own
    index and the index of the rank that wrote the replicated tensor, nothing else."""
    read, core = {}, {}
    for world in worlds:
        path = tmp_path / f"w{world}"
        results = run_ranks(world, "indexed_workers:save_then_load", str(path), TENSORS, timeout=300)
        assert all(same for _, _, same in results)
        raw = (path / "manifest.json").read_bytes()
        m = json.loads(raw)
        assert m["version"] == 4 and m["files"] == {}
        assert all("grid" in m["tensors"][f"t{i:04d}"] for i in range(TENSORS))
        sizes = m["ranks"]["index_bytes"]
        writer = m["tensors"]["replicated"]["grid"]["offset"]
        for rank, (metadata, _, _) in enumerate(results):
            holds = any(rank * -(-_rows(i) // world) < _rows(i) for i in range(TENSORS))  # a row of some tensor
            assert metadata == len(raw) + sum(sizes[r] for r in {writer} | ({rank} if holds else set()))
        read[world], core[world] = max(r[0] for r in results), len(raw)
    assert max(read.values()) <= 1.25 * min(read.values()), read
    assert max(core.values()) <= 1.25 * min(core.values()), core


def test_a_resharded_load_reads_the_indexes_of_the_ranks_it_overlaps(tmp_path):
    path = tmp_path / "c"
    run_ranks(4, "indexed_workers:save_only", str(path), 20)
    back = resurgo.load_dict(path)  # one process: every rank's index
    full = sharded_state(0, 1, 20)
    for key, value in full.items():
        if isinstance(value, resurgo.Shard):
            assert torch.equal(back[key], value.local)
    assert back["step"] == 7 and torch.equal(back["replicated"], full["replicated"])
    target = {"t0000": torch.zeros(9, 4)}
    report = resurgo.load(target, path, strict=False)
    m = json.loads((path / "manifest.json").read_bytes())
    assert report.metadata_bytes_read == len((path / "manifest.json").read_bytes()) + sum(m["ranks"]["index_bytes"][:3])
    assert torch.equal(target["t0000"], full["t0000"].local)  # 9 rows of 3: ranks 0, 1 and 2


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("v4") / "c"
    run_ranks(4, "indexed_workers:save_only", str(path), 6)
    return path


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_damaged_index_is_corruption_named_by_its_file(four_ranks, tmp_path):
    path = _copy(four_ranks, tmp_path / "c")
    writer = json.loads((path / "manifest.json").read_bytes())["tensors"]["replicated"]["grid"]["offset"]
    damaged = (writer + 1) % 4
    index = path / index_file_name(damaged)
    raw = bytearray(index.read_bytes())
    raw[-5] ^= 1
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=rf"rank0000{damaged}-index\.safetensors.*rank {damaged}'s index"):
        resurgo.load_dict(path)
    target = {"t0000": torch.zeros(9, 4)}
    with pytest.raises(CorruptCheckpointError, match=f"rank {damaged}'s index"):
        resurgo.load(target, path, strict=False)
    assert torch.equal(target["t0000"], torch.zeros(9, 4))  # nothing changed
    # A load that needs nothing of that rank reads neither its index nor its data files.
    alone = {"replicated": torch.zeros(10)}
    resurgo.load(alone, path, strict=False)
    assert torch.equal(alone["replicated"], torch.arange(10.0))
    index.unlink()
    with pytest.raises(CorruptCheckpointError):
        resurgo.load_dict(path)


def test_an_index_that_disagrees_with_the_core_is_refused(four_ranks, tmp_path):
    """An index rewritten (and its size and checksum put in the core, resealed) that holds a chunk
    the core places on another rank: a ManifestError naming the index."""
    from resurgo.format import checksum
    from resurgo.format.index import RankIndex
    from resurgo.format.manifest import seal

    path = _copy(four_ranks, tmp_path / "c")
    core = json.loads((path / "manifest.json").read_bytes())
    raw = (path / index_file_name(1)).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    doc = json.loads(raw[8 + n + json.loads(raw[8:8 + n])["resurgo.index"]["data_offsets"][0]:])
    doc["chunks"]["t0000"][0]["box"]["offsets"] = [0, 0]  # rank 0's cell
    forged = RankIndex.model_validate(doc).encode()
    (path / index_file_name(1)).write_bytes(forged)
    core["ranks"]["index_bytes"][1], core["ranks"]["index_checksums"][1] = len(forged), checksum.digest(forged)
    del core["manifest_checksum"]
    (path / "manifest.json").write_bytes(seal(json.dumps(core, separators=(",", ":")).encode()))
    with pytest.raises(ManifestError, match=r"rank00001-index\.safetensors.*not place on rank 1"):
        resurgo.load_dict(path)


def test_verify_inspect_and_the_reader_sketch_on_version_4(four_ranks, tmp_path):
    from typer.testing import CliRunner

    from resurgo.cli.app import app

    result = CliRunner().invoke(app, ["verify", str(four_ranks)])
    assert result.exit_code == 0, result.output
    assert "in 8 files" in result.output  # 4 data files and 4 indexes
    read_tensor = load_reader()
    assert read_tensor(str(four_ranks), "replicated").tobytes() == torch.arange(10.0).numpy().tobytes()
    with pytest.raises(ValueError, match="several chunks"):
        read_tensor(str(four_ranks), "t0000")
    path = _copy(four_ranks, tmp_path / "c")
    m = json.loads((path / "manifest.json").read_bytes())
    writer = m["tensors"]["replicated"]["grid"]["offset"]
    index = path / index_file_name(writer)
    index.write_bytes(index.read_bytes()[:-1] + b" ")
    with pytest.raises(ValueError, match="does not match the size and checksum"):
        read_tensor(str(path), "replicated")


def test_new_tensors_of_a_version_4_load_are_weighed_against_every_index(four_ranks):
    """A load into an empty container allocates every tensor: what the chunks store is read from
    every rank's index first (the core lists none), so a real checkpoint is never an expansion."""
    whole = resurgo.load_dict(four_ranks)
    state: dict = {}
    report = resurgo.load(state, four_ranks)
    assert state.keys() == whole.keys()
    assert report.num_tensors == sum(isinstance(v, torch.Tensor) for v in whole.values()) > 1
    assert all(torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v for k, v in whole.items())
    assert report.metadata_bytes_read > (four_ranks / "manifest.json").stat().st_size  # the indexes too
