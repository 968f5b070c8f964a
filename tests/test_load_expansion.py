"""A load allocates no more than a bounded multiple of the bytes the checkpoint stores.

A manifest may place several tensors on the same byte range of a data file, so a crafted manifest
beside a small data file could make ``load_dict`` (or ``load`` into an empty container) allocate
far more than the checkpoint holds. New tensors beyond 4 times the distinct bytes the chunks read
are refused with ExpansionError before any of them is allocated, unless ``allow_expansion=True``;
tied weights (two keys on one range), incremental checkpoints reading a base's files, and loads
into the caller's own tensors are not refused. Every crafted manifest is built here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import ExpansionError
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.state import unflatten

from helpers import resealed

X = torch.arange(1024.0)  # 4096 bytes, one chunk


def sharing_bytes(path: Path, copies: int, base: Path | None = None) -> Path:
    """A checkpoint of "x" (4096 bytes) whose manifest (resealed) lists ``copies`` more tensors on
    the bytes of "x"; saved on ``base`` (incremental: every byte of "x" read from the base's file)."""
    resurgo.save({"x": X.clone()}, path, **({"base": base} if base is not None else {}))
    doc = json.loads((path / "manifest.json").read_bytes())
    del doc["manifest_checksum"]
    for i in range(copies):
        doc["tensors"][f"y{i}"] = entry = json.loads(json.dumps(doc["tensors"]["x"]))
        for chunk in entry["chunks"]:
            chunk["name"] = chunk.get("name", "x")  # the data file's header names the bytes "x"
        doc["tree"]["items"].append([f"y{i}", {"type": "tensor", "key": f"y{i}"}])
    (path / "manifest.json").write_bytes(resealed(json.dumps(doc).encode()))
    return path


@pytest.fixture
def allocations(monkeypatch) -> list[int]:
    """The bytes of every new tensor a load allocates, in order."""
    sizes: list[int] = []
    real = unflatten.new_array

    def counting(entry):
        out = real(entry)
        sizes.append(out.nbytes)
        return out

    monkeypatch.setattr(unflatten, "new_array", counting)
    return sizes


def test_many_tensors_on_one_range_are_refused_before_they_are_allocated(tmp_path, allocations):
    path = sharing_bytes(tmp_path / "c", 50)  # 51 tensors of 4096 bytes on 4096 stored bytes
    with pytest.raises(ExpansionError, match=r"c: key 'y3': the new tensors the load would allocate take 20480 bytes, "
                                             r"5.0 times the 4096 distinct bytes their chunks read \(more than 4 times "
                                             r"is refused.*pass allow_expansion=True"):
        resurgo.load_dict(path)
    assert allocations == [4096] * 4  # what 4 times the stored bytes allows, never the fifth
    allocations.clear()
    with pytest.raises(ExpansionError):
        resurgo.load({}, path)  # an empty container takes what was saved: new tensors too
    assert sum(allocations) <= 4 * 4096
    out = resurgo.load_dict(path, allow_expansion=True)
    assert len(out) == 51 and all(torch.equal(t, X) for t in out.values())
    report = verify_checkpoint(path)
    assert report.ok  # the manifest is consistent: only its cost is refused
    assert (report.chunks_checked, report.bytes_checked, report.bytes_read) == (51, 51 * 4096, 4096)  # read once


def test_tied_weights_and_the_callers_own_tensors_load(tmp_path, allocations):
    tied = sharing_bytes(tmp_path / "tied", 1)  # two keys on one range: 2 times
    out = resurgo.load_dict(tied)
    assert torch.equal(out["x"], X) and torch.equal(out["y0"], X)
    path = sharing_bytes(tmp_path / "c", 50)
    allocations.clear()
    state = {"x": torch.zeros(1024), **{f"y{i}": torch.zeros(1024) for i in range(50)}}
    resurgo.load(state, path)  # into the caller's tensors: nothing allocated from the file
    assert allocations == [] and all(torch.equal(t, X) for t in state.values())


def test_an_incremental_checkpoint_counts_the_bytes_it_reads_from_its_base(tmp_path):
    resurgo.save({"x": X.clone()}, tmp_path / "a", as_base=True)
    path = sharing_bytes(tmp_path / "b", 2, base=tmp_path / "a")  # stores nothing of its own
    manifest = json.loads((path / "manifest.json").read_bytes())
    assert all(e["file"].startswith("a/") for c in manifest["tensors"]["x"]["chunks"] for e in c["extents"])
    out = resurgo.load_dict(path)  # 3 times the base bytes it reads
    assert all(torch.equal(t, X) for t in out.values())
    sharing_bytes(tmp_path / "d", 4, base=tmp_path / "a")
    with pytest.raises(ExpansionError, match="20480 bytes, 5.0 times the 4096 distinct bytes"):
        resurgo.load_dict(tmp_path / "d")


def test_verify_reads_a_range_shared_by_many_tensors_once_and_names_each_when_damaged(tmp_path):
    path = sharing_bytes(tmp_path / "c", 50)
    data = next((path / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of "x", which every tensor reads
    data.write_bytes(bytes(raw))
    report = verify_checkpoint(path)
    damaged = [p for p in report.problems if "does not match its checksum" in p]
    assert len(damaged) == 51 and any("'y49'" in p for p in damaged)  # a failed range is checked for each


def test_verify_refuses_chunks_overlapping_at_shifted_offsets_without_hashing_them(tmp_path):
    """Spans that overlap at other offsets cannot be read once for all: 100 copies of a 512 KiB
    tensor, each shifted 4 bytes further into a 1 MiB one, would make verify hash 50 MiB more for
    each 512 KiB of manifest-declared data. It reports the expansion and reads nothing."""
    path = tmp_path / "c"
    resurgo.save({"x": torch.arange(float(1 << 18)), "y": torch.zeros(1 << 17)}, path)
    doc = json.loads((path / "manifest.json").read_bytes())
    del doc["manifest_checksum"]
    (x_chunk,), (y_chunk,) = doc["tensors"]["x"]["chunks"], doc["tensors"]["y"]["chunks"]
    assert x_chunk["file"] == y_chunk["file"]
    start = x_chunk["byte_range"][0]
    for i in range(200):
        doc["tensors"][f"y{i}"] = entry = json.loads(json.dumps(doc["tensors"]["y"]))
        entry["chunks"][0]["byte_range"] = [start + 4 * i, start + 4 * i + (1 << 19)]
        doc["tree"]["items"].append([f"y{i}", {"type": "tensor", "key": f"y{i}"}])
    (path / "manifest.json").write_bytes(resealed(json.dumps(doc).encode()))
    report = verify_checkpoint(path)
    assert not report.ok and report.bytes_read == 0
    assert "overlapping at shifted offsets" in report.problems[0] and str(path) in report.problems[0]
    with pytest.raises(ExpansionError):
        resurgo.load_dict(path)
