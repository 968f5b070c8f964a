"""Any single flipped byte in any data file is detected on load, naming the file (and the tensor)."""

from __future__ import annotations

import json

import pytest
import torch

import resurgo
from resurgo.errors import CorruptCheckpointError


def small_state():
    return {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "b": torch.arange(3, dtype=torch.bfloat16),
        "n": torch.tensor(7, dtype=torch.int64),
        "e": torch.zeros(0),
    }


def test_every_single_flipped_byte_is_detected(tmp_path):
    path = tmp_path / "c"
    resurgo.save(small_state(), path)
    manifest = json.loads((path / "manifest.json").read_text())
    owner = {}  # byte offset -> tensor key
    for key, t in manifest["tensors"].items():
        for c in t["chunks"]:
            for off in range(*c["byte_range"]):
                owner[(c["file"], off)] = key
    checked = 0
    for rel in manifest["files"]:
        f = path / rel
        original = f.read_bytes()
        for i in range(len(original)):
            for flip in (0x01, 0x80):
                corrupted = bytearray(original)
                corrupted[i] ^= flip
                f.write_bytes(corrupted)
                target = {k: torch.empty_like(v) for k, v in small_state().items()}
                with pytest.raises(CorruptCheckpointError) as ei:
                    resurgo.load(target, path)
                msg = str(ei.value)
                assert rel in msg, (i, msg)
                if (rel, i) in owner:
                    assert repr(owner[(rel, i)]) in msg, (i, msg)
                checked += 1
        f.write_bytes(original)
    assert checked == 2 * sum(len((path / rel).read_bytes()) for rel in manifest["files"])
    assert resurgo.load_dict(path)["n"].item() == 7


def test_verify_false_skips_checksums(tmp_path):
    path = tmp_path / "c"
    resurgo.save({"w": torch.zeros(8, dtype=torch.uint8)}, path)
    m = json.loads((path / "manifest.json").read_text())
    c = m["tensors"]["w"]["chunks"][0]
    f = path / c["file"]
    data = bytearray(f.read_bytes())
    data[c["byte_range"][0] + 3] = 9
    f.write_bytes(data)
    with pytest.raises(CorruptCheckpointError):
        resurgo.load_dict(path)
    out = resurgo.load_dict(path, verify=False)
    assert out["w"].tolist() == [0, 0, 0, 9, 0, 0, 0, 0]


def test_truncated_or_missing_data_file(tmp_path):
    path = tmp_path / "c"
    resurgo.save(small_state(), path)
    rel = next(iter(json.loads((path / "manifest.json").read_text())["files"]))
    f = path / rel
    data = f.read_bytes()
    f.write_bytes(data[:-1])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        resurgo.load_dict(path)
    f.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        resurgo.load_dict(path)


def test_multi_block_chunk_names_the_block(tmp_path):
    path = tmp_path / "c"
    resurgo.save({"big": torch.zeros(1 << 16)}, path, block_bytes=4096)  # 256 KiB, 64 blocks
    m = json.loads((path / "manifest.json").read_text())
    c = m["tensors"]["big"]["chunks"][0]
    assert len(c["checksums"]) == 64
    f = path / c["file"]
    data = bytearray(f.read_bytes())
    data[c["byte_range"][0] + 4096 * 37 + 5] ^= 0x10
    f.write_bytes(data)
    with pytest.raises(CorruptCheckpointError, match="block 37"):
        resurgo.load_dict(path)
