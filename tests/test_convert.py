"""resurgo.convert and `resurgo convert`: safetensors, Hugging Face shards and torch.save outputs.

Outputs are opened with the safetensors library and torch.load and compared bitwise with the
saved tensors. Tensors stored in several chunks come from real two-rank saves (gloo) and, for
chosen layouts, from separately saved pieces described as chunks of one tensor in the manifest.
Memory is measured in a fresh process (peak RSS, VmHWM).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from s3fs import S3FileSystem
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.conversion import json_scalars, parse_size
from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    KeyMismatchError,
    MemoryBudgetError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from resurgo.format import dtypes, values
from resurgo.layout.box import ChunkBox, FlatRange
from resurgo.pipeline.buffers import as_copyable
from resurgo.plan.convert_plan import plan_batches, plan_shards, shard_file_names
from resurgo.state.flatten import flatten_state
from resurgo.storage.fsspec_store import split_url
from resurgo.format.manifest import TMP_MARKER
from dist_harness import run_ranks
from dist_workers import reference
from helpers import bits_equal, random_tensor, sealed_manifest

SCRIPTS = Path(__file__).parent / "scripts"
MiB = 1 << 20


def raw_bytes(t: torch.Tensor) -> bytes:
    return as_copyable(t).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


def flip_byte(path: Path, key: str, chunk: int = 0, at: int = 1) -> None:
    c = resurgo.read_manifest(path).tensors[key].chunks[chunk]
    f = path / c.file
    raw = bytearray(f.read_bytes())
    raw[c.byte_range[0] + at] ^= 0x10
    f.write_bytes(bytes(raw))


def save_chunked(path: Path, tensors: dict[str, torch.Tensor], layouts: dict[str, list], nfiles: int = 2,
                 block_bytes: int | None = None) -> None:
    """A checkpoint in which tensor ``key`` is stored as the chunks ``layouts[key]`` (ChunkBox or
    FlatRange places; default: one whole chunk), spread round robin over ``nfiles`` data files.

    Each piece is saved as a tensor of its own, then the manifest describes the pieces as chunks
    of their tensors (the chunk's ``name`` is the piece's name in the data file).
    """
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(nfiles)]
    placed: dict[str, list[tuple[str, object]]] = {}
    n = 0
    for key, t in tensors.items():
        for i, place in enumerate(layouts.get(key) or [ChunkBox.whole(tuple(t.shape))]):
            if isinstance(place, ChunkBox):
                piece = as_copyable(t)[place.slices()].contiguous().view(t.dtype)
            else:
                piece = as_copyable(t).reshape(-1)[place.start : place.stop].contiguous().view(t.dtype)
            name = f"{key}#{i}"
            groups[n % nfiles][name] = piece
            placed.setdefault(key, []).append((name, place))
            n += 1
    files, entries = {}, {}
    (path / "data").mkdir(parents=True)
    for g, group in enumerate(groups):
        part = path.parent / f"{path.name}.part{g}"
        resurgo.save(group, part, block_bytes=block_bytes)
        doc = json.loads((part / "manifest.json").read_bytes())
        for old, entry in doc["files"].items():
            new = f"data/part{g}-{Path(old).name}"
            (part / old).rename(path / new)
            files[new] = entry
            for e in doc["tensors"].values():
                for c in e["chunks"]:
                    if c["file"] == old:
                        c["file"] = new
        entries.update(doc["tensors"])
    tensor_entries = {}
    for key, t in tensors.items():
        chunks = []
        for name, place in placed[key]:
            (chunk,) = entries[name]["chunks"]
            chunk.setdefault("name", name)
            del chunk["box"]
            if isinstance(place, ChunkBox):
                chunk["box"] = {"offsets": list(place.offsets), "shape": list(place.shape)}
            else:
                chunk["flat"] = {"start": place.start, "stop": place.stop}
            chunks.append(chunk)
        tensor_entries[key] = {"kind": "torch", "dtype": dtypes.TORCH_DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                               "chunks": chunks}
    doc.update(files=files, tensors=tensor_entries,
               tree={"type": "dict", "items": [[k, {"type": "tensor", "key": k}] for k in tensors]})
    (path / "manifest.json").write_bytes(sealed_manifest(doc))
    loaded = resurgo.load_dict(path)  # the helper made a valid checkpoint
    assert all(bits_equal(loaded[k], t) for k, t in tensors.items())


# ------------------------------------------------------------------------------------------------
# to="safetensors"
# ------------------------------------------------------------------------------------------------
def every_dtype_state() -> dict:
    tensors = {name: random_tensor(dt, (3, 2), seed=i) for i, (name, dt) in enumerate(sorted(dtypes.TORCH_DTYPES.items()))}
    return {
        "t": tensors,
        "zero_d": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "strided": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
        "arr": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "epoch": 3, "lr": 0.1, "neg_zero": -0.0, "name": "run", "flag": True, "nothing": None, "big": 1 << 70,
        "betas": (0.9, 0.999),
        "blob": b"\x00\x01", "cplx": 1 + 2j, "nan": float("nan"), "np_scalar": np.float32(1.5),
        "dt": torch.float16, "size": torch.Size([2, 3]), "empty_list": [],
    }


def test_safetensors_holds_every_tensor_bitwise_and_the_plain_values(tmp_path):
    state = every_dtype_state()
    resurgo.save(state, tmp_path / "ck", step=11, metadata={"run": "r1", "tags": [1, 2]})
    report = resurgo.convert(tmp_path / "ck", tmp_path / "out.safetensors", to="safetensors")

    loaded = load_file(tmp_path / "out.safetensors")
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        meta = f.metadata()
    expected = {f"t.{n}": t for n, t in state["t"].items()}
    expected.update({"zero_d": state["zero_d"], "empty": state["empty"], "strided": state["strided"],
                     "arr": torch.from_numpy(state["arr"])})
    assert sorted(loaded) == sorted(expected) and report.num_tensors == len(expected)
    raw_dtypes = json.loads(meta["resurgo.raw_dtypes"])
    for key, t in expected.items():
        name = dtypes.TORCH_DTYPE_NAMES[t.dtype]
        if name in dtypes.SAFETENSORS_CODES:
            assert bits_equal(loaded[key], t), key
            assert key not in raw_dtypes
        else:  # as resurgo's own data files store it: raw bytes, the real dtype in the metadata
            assert loaded[key].dtype == torch.uint8 and loaded[key].shape == (t.numel() * t.element_size(),)
            assert loaded[key].numpy().tobytes() == raw_bytes(t), key
            assert raw_dtypes[key] == {"dtype": name, "shape": list(t.shape)}
    assert sorted(report.raw_dtype_keys) == sorted(raw_dtypes)
    assert "t.complex128" in raw_dtypes and "t.float8_e8m0fnu" in raw_dtypes and "t.bfloat16" not in raw_dtypes

    assert meta["format"] == "pt" and meta["resurgo.step"] == "11"
    assert json.loads(meta["resurgo.metadata"]) == {"run": "r1", "tags": [1, 2]}
    kept = json.loads(meta["resurgo.values"])
    assert kept == {"epoch": 3, "lr": 0.1, "neg_zero": -0.0, "name": "run", "flag": True, "nothing": None,
                    "big": 1 << 70, "betas.0": 0.9, "betas.1": 0.999}
    assert math.copysign(1, kept["neg_zero"]) == -1 and type(kept["flag"]) is bool
    assert report.values_dropped == ["blob", "cplx", "nan", "np_scalar", "dt", "size", "empty_list"]
    assert report.tensor_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert report.bytes_written == (tmp_path / "out.safetensors").stat().st_size
    assert report.bytes_read == report.tensor_bytes and report.files == ["out.safetensors"]
    assert leftovers(tmp_path) == []


def test_plain_values_follow_the_tree_and_the_prefix():
    state = {"model": {"cfg": {"depth": 2}, "w": torch.zeros(1)}, "opt": {"lr": 0.5, 3: "x"}}
    tree, _, _ = flatten_state(state)
    assert json_scalars(tree) == ({"model.cfg.depth": 2, "opt.lr": 0.5, "opt.3": "x"}, [])
    assert json_scalars(tree, "model.") == ({"cfg.depth": 2}, [])
    node = values.encode_scalar(float("inf"))
    assert json_scalars({"type": "dict", "items": [["a", node]]}) == ({}, ["a"])
    # Values saved per rank are keyed like their tensors: <key>@rank<r>.
    per_rank = {"type": "per_rank", "items": [{"type": "dict", "items": [["seed", values.encode_scalar(r)],
                                                                          ["raw", values.encode_scalar(b"x")]]}
                                              for r in (5, 6)]}
    assert json_scalars({"type": "dict", "items": [["rng", per_rank]]}) == (
        {"rng.seed@rank0": 5, "rng.seed@rank1": 6}, ["rng.raw@rank0", "rng.raw@rank1"])


# ------------------------------------------------------------------------------------------------
# to="hf"
# ------------------------------------------------------------------------------------------------
def hf_state() -> dict:
    sizes = [300, 5000, 120, 7000, 64, 64, 9000, 1, 0, 2500]  # float32 elements
    return {"model": {f"layer{i}.weight": random_tensor(torch.float32, (n,), seed=i) for i, n in enumerate(sizes)},
            "optimizer": {"state": {0: {"exp_avg": torch.ones(10)}}, "lr": 0.1}}


def read_hf(directory: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, list[str]]]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    per_file: dict[str, list[str]] = {}
    for name in sorted(set(index["weight_map"].values())):
        shard = load_file(directory / name)
        with safe_open(directory / name, "pt") as f:
            assert f.metadata()["format"] == "pt"
        assert not set(shard) & set(tensors), "a key in two shards"
        tensors.update(shard)
        per_file[name] = list(shard)
    return index, tensors, per_file


def test_hf_shards_index_and_limits(tmp_path):
    state = hf_state()
    resurgo.save(state, tmp_path / "ck")
    limit = 24_000  # bytes of tensor data per shard
    report = resurgo.convert(tmp_path / "ck", tmp_path / "hf", to="hf", max_shard_bytes=limit)

    index, tensors, per_file = read_hf(tmp_path / "hf")
    expected = {f"model.{k}": v for k, v in state["model"].items()} | {"optimizer.state.0.exp_avg": torch.ones(10)}
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {"total_size": sum(t.numel() * 4 for t in expected.values())}
    assert sorted(index["weight_map"]) == sorted(expected) == sorted(tensors)  # every key exactly once
    for key, t in expected.items():
        assert bits_equal(tensors[key], t), key
        assert key in per_file[index["weight_map"][key]]
    names = sorted(per_file)
    assert names == shard_file_names(len(names)) and len(names) == 5  # [1200+20000+480] [28000] [256+256] [36000] [rest]
    assert sorted(os.listdir(tmp_path / "hf")) == names + ["model.safetensors.index.json"]
    for name, keys in per_file.items():
        nbytes = sum(tensors[k].numel() * 4 for k in keys)
        assert nbytes <= limit or len(keys) == 1, (name, nbytes)
    # The order of the checkpoint is kept: shards hold consecutive keys.
    order = [index["weight_map"][k] for k in expected]
    assert order == sorted(order)
    assert report.values_dropped == ["optimizer.lr"] and report.files == names + ["model.safetensors.index.json"]
    assert report.bytes_written == sum(p.stat().st_size for p in (tmp_path / "hf").iterdir())
    assert report.peak_buffer_bytes <= 36_000  # one shard at a time: the 9000-element tensor is alone
    assert leftovers(tmp_path) == []


def test_hf_one_shard_is_model_safetensors_without_index(tmp_path):
    resurgo.save(hf_state(), tmp_path / "ck")
    report = resurgo.convert(tmp_path / "ck", tmp_path / "hf", to="hf")
    assert os.listdir(tmp_path / "hf") == ["model.safetensors"] and report.files == ["model.safetensors"]
    assert len(load_file(tmp_path / "hf" / "model.safetensors")) == 11


def test_hf_prefix_gives_a_state_dict_a_module_loads(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    resurgo.save({"model": model, "optim": opt}, tmp_path / "ck")
    report = resurgo.convert(tmp_path / "ck", tmp_path / "hf", to="hf", only="model.", max_shard_bytes=600)

    index, tensors, _ = read_hf(tmp_path / "hf")
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh.load_state_dict(tensors, strict=True)
    assert all(bits_equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    assert all(k.startswith("optim.") for k in report.tensors_skipped) and len(report.tensors_skipped) == 12


# ------------------------------------------------------------------------------------------------
# to="torch"
# ------------------------------------------------------------------------------------------------
def test_torch_file_holds_the_structure_load_dict_returns(tmp_path):
    state = {"model": {"w": random_tensor(torch.bfloat16, (4, 5)), "f8": random_tensor(torch.float8_e4m3fn, (3,)),
                       "c128": random_tensor(torch.complex128, (2,)), "zero_d": torch.tensor(7)},
             "opt": OrderedDict([("state", {0: {"step": torch.tensor(3.0)}}), ("betas", (0.9, 0.999))]),
             "blob": b"xy", "cplx": 1j, "dt": torch.int8, "size": torch.Size([1, 2]), "none": None, "empty": []}
    resurgo.save(state, tmp_path / "ck")
    report = resurgo.convert(tmp_path / "ck", tmp_path / "state.pt", to="torch")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert bits_equal(loaded, resurgo.load_dict(tmp_path / "ck"))
    assert bits_equal(loaded, state)
    assert report.bytes_written == (tmp_path / "state.pt").stat().st_size and report.values_dropped == []


def test_torch_file_holds_numpy_values_as_torch_ones(tmp_path):
    state = {"arr": np.arange(6, dtype=np.uint16).reshape(2, 3), "w": torch.ones(2), "c": np.complex64(1 - 2j),
             "f16": np.float16(0.1), "u64": np.uint64(2**64 - 1), "by": {np.int64(3): "three", 4: "four"}}
    resurgo.save(state, tmp_path / "ck")
    resurgo.convert(tmp_path / "ck", tmp_path / "state.pt", to="torch")
    loaded = torch.load(tmp_path / "state.pt")  # weights_only=True, torch's default
    assert bits_equal(loaded, {"arr": torch.arange(6, dtype=torch.int32).to(torch.uint16).reshape(2, 3), "w": torch.ones(2),
                               "c": complex(1, -2), "f16": float(np.float16(0.1)), "u64": 2**64 - 1,
                               "by": {3: "three", 4: "four"}})


def test_torch_file_of_a_train_state_loads_with_torch_defaults(tmp_path):
    """RNG states (per rank, with numpy arrays) and a DataLoader position: plain types only."""
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
    ts = resurgo.TrainState(model=model, optimizer=opt, dataloader=loader, step=5)
    next(iter(loader))
    sd = ts.state_dict()
    resurgo.save(ts, tmp_path / "ck")
    resurgo.convert(tmp_path / "ck", tmp_path / "ts.pt", to="torch")
    loaded = torch.load(tmp_path / "ts.pt")  # weights_only=True, torch's default
    rng = sd["rng"].value
    assert bits_equal(loaded, {
        "model": sd["model"], "optimizer": sd["optimizer"], "dataloader": sd["dataloader"], "step": 5,
        "rng": [{"python": {**rng["python"], "state": torch.from_numpy(rng["python"]["state"])},
                 "numpy": {**rng["numpy"], "keys": torch.from_numpy(rng["numpy"]["keys"])},
                 "torch": rng["torch"], "cuda": rng["cuda"]}],  # a list indexed by rank
    })
    assert loaded["dataloader"]["batches_yielded"] == 1


def test_torch_refuses_what_it_cannot_hold(tmp_path):
    resurgo.save({"w": torch.zeros(1000), "v": torch.zeros(24)}, tmp_path / "ck")
    with pytest.raises(MemoryBudgetError, match=r"ck: a torch.save file needs the whole state in memory \(4096 bytes"):
        resurgo.convert(tmp_path / "ck", tmp_path / "x.pt", to="torch", buffer_bytes=4000)
    resurgo.convert(tmp_path / "ck", tmp_path / "x.pt", to="torch", buffer_bytes=4096)

    resurgo.save({"bits": torch.zeros(4, dtype=torch.uint8).view(torch.uint1)}, tmp_path / "ck1")
    with pytest.raises(UnsupportedValueError, match=r"tensor 'bits' has dtype uint1, which torch.save cannot store"):
        resurgo.convert(tmp_path / "ck1", tmp_path / "y.pt", to="torch")
    assert not (tmp_path / "y.pt").exists() and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# Tensors stored in several chunks, in two data files
# ------------------------------------------------------------------------------------------------
def chunked_tensors() -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    tensors = {
        "cols": random_tensor(torch.float32, (6, 10), seed=1),
        "grid": random_tensor(torch.bfloat16, (5, 4, 3), seed=2),
        "flat": random_tensor(torch.int64, (7, 3), seed=3),
        "raw": random_tensor(torch.complex128, (4, 2), seed=4),
        "whole": random_tensor(torch.float16, (9,), seed=5),
    }
    layouts = {
        "cols": [ChunkBox((0, 4), (6, 6)), ChunkBox((0, 0), (6, 4))],
        "grid": [ChunkBox((0, 0, 0), (2, 4, 3)), ChunkBox((2, 0, 0), (3, 2, 3)), ChunkBox((2, 2, 0), (3, 2, 3))],
        "flat": [FlatRange(0, 5), FlatRange(5, 17), FlatRange(17, 21)],
        "raw": [FlatRange(3, 8), FlatRange(0, 3)],
    }
    return tensors, layouts


@pytest.mark.parametrize("to", ["safetensors", "hf", "torch"])
def test_tensors_in_several_chunks_are_assembled(tmp_path, to):
    tensors, layouts = chunked_tensors()
    save_chunked(tmp_path / "ck", tensors, layouts)
    assert len(resurgo.read_manifest(tmp_path / "ck").files) == 2
    out = tmp_path / "out"
    resurgo.convert(tmp_path / "ck", out, to=to, **({"max_shard_bytes": 300} if to == "hf" else {}))
    if to == "torch":
        assert bits_equal(torch.load(out, weights_only=True), tensors)
        return
    got = read_hf(out)[1] if to == "hf" else load_file(out)
    for key, t in tensors.items():
        want = t if key != "raw" else t.view(torch.uint8).reshape(-1)  # complex128: raw bytes
        assert bits_equal(got[key], want), key


def test_checkpoints_saved_by_two_ranks(tmp_path):
    """Real distributed saves (gloo, 2 processes): DTensor column shards and uneven flat ranges,
    per-rank values; every target consolidates them bitwise, also streamed in windows."""
    run_ranks(2, "dist_workers:save_layouts", str(tmp_path), ["dt_s1", "flat"])
    ref = reference()
    for layout in ("dt_s1", "flat"):
        ck = tmp_path / f"n2-{layout}"
        assert max(len(t.chunks) for t in resurgo.read_manifest(ck).tensors.values()) == 2
        out = tmp_path / f"{layout}.safetensors"
        report = resurgo.convert(ck, out, to="safetensors", buffer_bytes=300_000)  # "d" (2 MiB) in windows
        got = load_file(out)
        assert all(bits_equal(got[k], v) for k, v in ref.items())
        assert [got[f"rng@rank{r}"].tolist() for r in range(2)] == [[r] * 4 for r in range(2)]
        with safe_open(out, "pt") as f:
            kept = json.loads(f.metadata()["resurgo.values"])
        assert kept == {"step": 11, "rank_value@rank0": 0, "rank_value@rank1": 1}
        assert report.peak_buffer_bytes <= 300_000
        resurgo.convert(ck, tmp_path / f"{layout}-hf", to="hf", max_shard_bytes=1 << 20)
        shards = read_hf(tmp_path / f"{layout}-hf")[1]
        assert all(bits_equal(shards[k], v) for k, v in ref.items())
        resurgo.convert(ck, tmp_path / f"{layout}.pt", to="torch")
        full = torch.load(tmp_path / f"{layout}.pt")
        assert all(bits_equal(full[k], v) for k, v in ref.items())
        assert full["rank_value"] == [0, 1]  # per-rank values: a list indexed by rank
        assert [t.tolist() for t in full["rng"]] == [[r] * 4 for r in range(2)]


@pytest.mark.parametrize("layout", ["whole", "cols", "rows", "flat"])
def test_tensor_larger_than_the_budget_streams_in_windows(tmp_path, layout):
    t = random_tensor(torch.float32, (96, 1000), seed=7)  # 384,000 bytes
    places = {"whole": None, "cols": [ChunkBox((0, 0), (96, 333)), ChunkBox((0, 333), (96, 667))],
              "rows": [ChunkBox((0, 0), (50, 1000)), ChunkBox((50, 0), (46, 1000))],
              "flat": [FlatRange(0, 12345), FlatRange(12345, 96000)]}[layout]
    small = random_tensor(torch.int8, (1000,), seed=8)
    save_chunked(tmp_path / "ck", {"a": small, "big": t, "z": small + 1}, {"big": places} if places else {},
                 block_bytes=4096)
    budget = 100_003  # windows of 12,500 elements: edges fall inside checksum blocks and rows
    report = resurgo.convert(tmp_path / "ck", tmp_path / "o.safetensors", to="safetensors", buffer_bytes=budget)
    got = load_file(tmp_path / "o.safetensors")
    assert bits_equal(got["big"], t) and bits_equal(got["a"], small) and bits_equal(got["z"], small + 1)
    assert report.peak_buffer_bytes == 100_000  # a window of 50,000 bytes and its reads
    # Each window reads the checksum blocks holding it: at most one block more at each end, per chunk.
    assert report.tensor_bytes <= report.bytes_read <= report.tensor_bytes + 8 * 2 * 2 * 4096


def test_budget_below_one_element_names_the_tensor(tmp_path):
    resurgo.save({"w": torch.zeros(4), "c": torch.zeros(3, dtype=torch.complex128)}, tmp_path / "ck")
    with pytest.raises(MemoryBudgetError, match=r"ck: tensor 'c' has elements of 16 bytes; buffer_bytes=31 cannot hold a window "
                                                r"of one and its read \(at least 32 bytes\)"):
        resurgo.convert(tmp_path / "ck", tmp_path / "o.safetensors", to="safetensors", buffer_bytes=31)
    assert not (tmp_path / "o.safetensors").exists() and leftovers(tmp_path) == []


def test_peak_memory_of_streamed_conversions_stays_near_the_budget(tmp_path):
    # 216 MiB: 24 float32 tensors of 8 MiB and an int8 one of 24 MiB + 4 bytes
    state = {f"layer{i:02d}": torch.full((2 * MiB,), float(i)) for i in range(24)}
    state["tail"] = torch.arange(24 * MiB + 4, dtype=torch.int64).to(torch.int8)
    resurgo.save(state, tmp_path / "ck")
    size = resurgo.read_manifest(tmp_path / "ck").tensor_bytes
    assert size == 216 * MiB + 4

    def run(dst: str, to: str, *options: str) -> tuple[int, dict]:
        proc = subprocess.run([sys.executable, str(SCRIPTS / "convert_memory.py"), str(tmp_path / "ck"),
                               str(tmp_path / dst), to, *options], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        return int(lines[0]) * 1024, json.loads(lines[1])

    # hf, 32 MiB shards: one shard's tensors are held at a time.
    grown, report = run("hf", "hf", f"max_shard_bytes={32 * MiB}")
    assert len(report["files"]) == 8 and report["peak_buffer_bytes"] == 32 * MiB  # 7 shards + index
    assert grown < 48 * MiB, grown
    # One file within 16 MiB: two layers at a time, the 24 MiB tail in windows.
    grown_one, report = run("one.safetensors", "safetensors", f"buffer_bytes={16 * MiB}")
    assert 8 * MiB < report["peak_buffer_bytes"] <= 16 * MiB
    assert grown_one < 32 * MiB, grown_one
    got = load_file(tmp_path / "one.safetensors")
    assert bits_equal(got["tail"], state["tail"]) and bits_equal(got["layer23"], state["layer23"])
    print(f"peak RSS growth for a {size / MiB:.0f} MiB checkpoint: hf (32 MiB shards) {grown / MiB:.1f} MiB, "
          f"one safetensors file (16 MiB budget) {grown_one / MiB:.1f} MiB")


# ------------------------------------------------------------------------------------------------
# Refusals and failures: nothing appears at dst, nothing is left behind
# ------------------------------------------------------------------------------------------------
class Alarm:
    """Unpickling one records it (a stand-in for code a pickle could run)."""

    triggered = False

    def __reduce__(self):
        return (_trigger, ())


def _trigger():
    Alarm.triggered = True
    return Fraction(1, 3)


def test_pickled_values(tmp_path):
    resurgo.save({"w": torch.ones(3), "obj": Alarm()}, tmp_path / "ck", allow_pickle=True)
    Alarm.triggered = False
    with pytest.raises(PickleNotAllowedError, match="holds pickled values"):
        resurgo.convert(tmp_path / "ck", tmp_path / "s.pt", to="torch")
    assert not (tmp_path / "s.pt").exists() and not Alarm.triggered
    report = resurgo.convert(tmp_path / "ck", tmp_path / "s.safetensors", to="safetensors")
    assert report.values_dropped == ["obj"] and not Alarm.triggered  # never unpickled
    resurgo.convert(tmp_path / "ck", tmp_path / "s.pt", to="torch", allow_pickle=True)
    assert Alarm.triggered
    assert torch.load(tmp_path / "s.pt", weights_only=False)["obj"] == Fraction(1, 3)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("to", ["safetensors", "hf", "torch"])
def test_existing_destination(tmp_path, to):
    resurgo.save({"w": torch.arange(4.0)}, tmp_path / "ck")
    dst = tmp_path / "out"
    resurgo.convert(tmp_path / "ck", dst, to=to)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in ([dst] if dst.is_file() else dst.iterdir()))
    with pytest.raises(CheckpointExistsError, match=r"out: already exists; pass overwrite=True"):
        resurgo.convert(tmp_path / "ck", dst, to=to)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in ([dst] if dst.is_file() else dst.iterdir())) == before
    resurgo.save({"w": torch.arange(5.0)}, tmp_path / "ck2")
    resurgo.convert(tmp_path / "ck2", dst, to=to, overwrite=True)
    if to == "torch":
        assert bits_equal(torch.load(dst, weights_only=True), {"w": torch.arange(5.0)})
    else:
        assert bits_equal(load_file(dst / "model.safetensors" if to == "hf" else dst)["w"], torch.arange(5.0))
    assert leftovers(tmp_path) == []
    other = "file" if to == "hf" else "directory"
    (tmp_path / other).mkdir() if other == "directory" else (tmp_path / other).write_text("x")
    with pytest.raises(CheckpointExistsError, match=f"{other}: exists and is not a"):
        resurgo.convert(tmp_path / "ck", tmp_path / other, to=to, overwrite=True)


def test_hf_overwrite_never_deletes_foreign_files(tmp_path):
    resurgo.save({"w": torch.ones(2)}, tmp_path / "ck")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(resurgo.ForeignFilesError, match=r"hf: holds 'config.json', which resurgo did not write; refusing "
                                                        r"to replace it, nothing was changed"):
        resurgo.convert(tmp_path / "ck", tmp_path / "hf", to="hf", overwrite=True)
    assert os.listdir(tmp_path / "hf") == ["config.json"]
    resurgo.convert(tmp_path / "ck", tmp_path / "hf2", to="hf")
    (tmp_path / "hf2" / "model.safetensors").rename(tmp_path / "hf2" / "model-00001-of-00001.safetensors")
    resurgo.convert(tmp_path / "ck", tmp_path / "hf2", to="hf", overwrite=True)  # what a conversion writes: replaced
    assert os.listdir(tmp_path / "hf2") == ["model.safetensors"]


def test_destination_is_the_source(tmp_path):
    resurgo.save({"w": torch.ones(2)}, tmp_path / "ck")
    with pytest.raises(CheckpointExistsError, match="is the source checkpoint"):
        resurgo.convert(tmp_path / "ck", tmp_path / "ck", to="hf", overwrite=True)
    assert resurgo.load_dict(tmp_path / "ck")["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("to", ["safetensors", "hf", "torch"])
def test_corrupt_source_raises_and_writes_nothing(tmp_path, to):
    state = {"a": torch.zeros(1000), "b": torch.ones(1000), "z": torch.arange(1000.0)}
    resurgo.save(state, tmp_path / "ck")
    flip_byte(tmp_path / "ck", "z", at=2001)  # the last tensor: the output is half written when found
    with pytest.raises(CorruptCheckpointError, match=r"ck: tensor 'z' is corrupt in data/rank00000-000.safetensors: block 0"):
        resurgo.convert(tmp_path / "ck", tmp_path / "out", to=to, **({"max_shard_bytes": 4000} if to == "hf" else {}))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    # Replacing an existing output: the old one stays as it was.
    resurgo.save({"w": torch.ones(3)}, tmp_path / "good")
    resurgo.convert(tmp_path / "good", tmp_path / "out", to=to)
    before = {p.name: p.read_bytes() for p in tree_files(tmp_path / "out")}
    with pytest.raises(CorruptCheckpointError):
        resurgo.convert(tmp_path / "ck", tmp_path / "out", to=to, overwrite=True,
                        **({"max_shard_bytes": 4000} if to == "hf" else {}))
    assert {p.name: p.read_bytes() for p in tree_files(tmp_path / "out")} == before and leftovers(tmp_path) == []


def tree_files(path):
    return [path] if path.is_file() else sorted(path.iterdir())


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_overwrite_replaces_only_a_file_resurgo_converted(tmp_path, to):
    resurgo.save({"w": torch.arange(4.0)}, tmp_path / "ck")
    theirs = tmp_path / "theirs"
    if to == "torch":
        torch.save({"w": torch.zeros(4)}, theirs)  # a torch.save file of the user's: no resurgo mark
    else:
        save_file({"w": torch.zeros(4)}, theirs)  # a safetensors file another program wrote
    before = theirs.read_bytes()
    with pytest.raises(resurgo.ForeignFilesError, match=r"theirs: exists and is not a file resurgo wrote .*nothing was "
                                                        r"changed"):
        resurgo.convert(tmp_path / "ck", theirs, to=to, overwrite=True)
    assert theirs.read_bytes() == before and leftovers(tmp_path) == []
    # Its own output carries the mark (torch.load reads the marked archive as any other) and is replaced.
    resurgo.convert(tmp_path / "ck", tmp_path / "ours", to=to)
    resurgo.save({"w": torch.arange(6.0)}, tmp_path / "ck2")
    resurgo.convert(tmp_path / "ck2", tmp_path / "ours", to=to, overwrite=True)
    got = (torch.load(tmp_path / "ours", weights_only=True, mmap=True) if to == "torch"
           else load_file(tmp_path / "ours"))
    assert bits_equal(got, {"w": torch.arange(6.0)})


def test_hf_overwrite_refuses_a_shard_another_program_wrote(tmp_path):
    resurgo.save({"w": torch.ones(2)}, tmp_path / "ck")
    (tmp_path / "hf").mkdir()
    save_file({"w": torch.zeros(2)}, tmp_path / "hf" / "model.safetensors")  # e.g. save_pretrained's
    with pytest.raises(resurgo.ForeignFilesError, match=r"hf: holds 'model.safetensors', which resurgo did not write"):
        resurgo.convert(tmp_path / "ck", tmp_path / "hf", to="hf", overwrite=True)
    assert bits_equal(load_file(tmp_path / "hf" / "model.safetensors"), {"w": torch.zeros(2)})


def test_corrupt_window_of_a_large_tensor(tmp_path):
    resurgo.save({"w": torch.zeros(1 << 16)}, tmp_path / "ck", block_bytes=4096)
    flip_byte(tmp_path / "ck", "w", at=200_000)
    with pytest.raises(CorruptCheckpointError, match=r"ck: tensor 'w' is corrupt in data/rank00000-000.safetensors: "
                                                      r"block 48 \(file bytes 196[0-9]*\.\.200[0-9]*\)"):
        resurgo.convert(tmp_path / "ck", tmp_path / "o", to="safetensors", buffer_bytes=60_000)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_bad_arguments(tmp_path):
    resurgo.save({"model": {"w": torch.ones(2)}, "x": torch.ones(1)}, tmp_path / "ck")
    with pytest.raises(KeyMismatchError, match=r"no tensor key starts with 'encoder.' \(the keys start with: 'model.', 'x.'\)"):
        resurgo.convert(tmp_path / "ck", tmp_path / "o", to="hf", only="encoder.")
    with pytest.raises(UnsupportedValueError, match=r"tensor 'model.w' would be named ''"):
        resurgo.convert(tmp_path / "ck", tmp_path / "o", to="safetensors", only="model.w")
    with pytest.raises(ValueError, match="to must be one of 'safetensors', 'hf', 'torch', 'dcp', 'peft', not 'onnx'"):
        resurgo.convert(tmp_path / "ck", tmp_path / "o", to="onnx")
    with pytest.raises(ValueError, match="max_shard_bytes applies to to='hf' only"):
        resurgo.convert(tmp_path / "ck", tmp_path / "o", to="safetensors", max_shard_bytes=10)
    with pytest.raises(ValueError, match="only= applies to the safetensors, hf and dcp targets"):
        resurgo.convert(tmp_path / "ck", tmp_path / "o", to="torch", only="model.")
    with pytest.raises(resurgo.CheckpointNotFoundError):
        resurgo.convert(tmp_path / "missing", tmp_path / "o", to="hf")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_parse_size():
    assert parse_size("5GB") == 5_000_000_000 and parse_size("2GiB") == 2 << 30 and parse_size("500mb") == 500_000_000
    assert parse_size(" 1.5 KiB ") == 1536 and parse_size("123") == 123 and parse_size(7) == 7 and parse_size("3B") == 3
    for bad in ("", "GB", "5QB", "-1", "0", "1e9", 0, -5, True):
        with pytest.raises(ValueError):
            parse_size(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# Planners (pure)
# ------------------------------------------------------------------------------------------------
sizes_lists = st.lists(st.integers(0, 100), max_size=30).map(lambda s: [(f"k{i}", n) for i, n in enumerate(s)])


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_lists, limit=st.integers(1, 120))
def test_plan_shards_matches_the_hugging_face_rule(sizes, limit):
    shards = plan_shards(sizes, limit)
    assert [k for s in shards for k in s] == [k for k, _ in sizes]  # every key once, in order
    size = dict(sizes)
    for i, shard in enumerate(shards):
        total = sum(size[k] for k in shard)
        assert total <= limit or len(shard) == 1
        if i + 1 < len(shards):  # a new shard starts only when the next tensor does not fit
            nxt = shards[i + 1][0]
            assert total + size[nxt] > limit or size[nxt] > limit or total > limit
    assert all(shards) or shards == [[]]


def test_shard_file_names():
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.tuples(st.integers(0, 50), st.booleans()), max_size=30), budget=st.integers(1, 120))
def test_plan_batches_stay_within_the_budget(items, budget):
    tensors = [(f"k{i}", n, 2 * n if scattered else n) for i, (n, scattered) in enumerate(items)]
    batches = plan_batches(tensors, budget)
    assert [k for b in batches for k in b.keys] == [k for k, _, _ in tensors]
    info = {k: (n, c) for k, n, c in tensors}
    for i, b in enumerate(batches):
        cost = sum(info[k][1] for k in b.keys)
        assert b.keys and b.nbytes == sum(info[k][0] for k in b.keys)
        assert b.windowed == (cost > budget) and (not b.windowed or len(b.keys) == 1)
        if i + 1 < len(batches) and not b.windowed and not batches[i + 1].windowed:
            assert cost + info[batches[i + 1].keys[0]][1] > budget  # greedy: the next one did not fit


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
runner = CliRunner()


def test_cli_convert(tmp_path):
    resurgo.save({"model": {"w": torch.arange(6.0)}, "blob": b"x", "lr": 0.5}, tmp_path / "ck")
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "o.safetensors"), "--to", "safetensors"])
    assert r.exit_code == 0, r.output
    assert re.search(r"OK .*ck -> .*o.safetensors \(safetensors\): 1 tensor, 24 B in 1 file", r.output)
    assert "warning: 1 non-tensor value not kept by safetensors: blob" in r.output
    assert bits_equal(load_file(tmp_path / "o.safetensors")["model.w"], torch.arange(6.0))

    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf", "--only", "model.",
                            "--max-shard-size", "1GB", "--buffer", "2MiB", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["files"] == ["model.safetensors"] and doc["tensor_bytes"] == 24 and doc["to"] == "hf"

    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf"])
    assert r.exit_code == 2 and "already exists" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "p.pt"), "--to", "torch", "--progress"])
    assert r.exit_code == 0 and bits_equal(torch.load(tmp_path / "p.pt", weights_only=True)["model"]["w"], torch.arange(6.0))
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "x"), "--to", "onnx"])
    assert r.exit_code == 2 and "--to must be one of safetensors, hf, torch, dcp, peft" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "x"), "--to", "hf", "--max-shard-size", "lots"])
    assert r.exit_code == 2 and "'lots' is not a size" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "x"), "--to", "torch", "--only", "m."])
    assert r.exit_code == 2 and "only= applies" in r.output
    flip_byte(tmp_path / "ck", "model.w")
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "x"), "--to", "torch"])
    assert r.exit_code == 3 and "tensor 'model.w' is corrupt" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------
# From an object store (s3:// on the SeaweedFS fixture) to local outputs
# ------------------------------------------------------------------------------------------------
def s3_state() -> dict:
    g = torch.Generator().manual_seed(21)
    return {"model": {"w": torch.randn(768, 1024, generator=g),  # 3 MiB: windows of a small budget
                      "b": torch.randn(1024, generator=g).to(torch.bfloat16),
                      "ids": torch.randint(0, 1 << 40, (999,), generator=g)},
            "opt": {"m": torch.randn(333, generator=g, dtype=torch.float64)}, "lr": 0.25, "blob": b"x"}


def test_convert_from_s3_to_every_target_bitwise(s3_bucket, tmp_path):
    url, options = s3_bucket
    state = s3_state()
    resurgo.save(state, f"{url}/ck", step=5, storage_options=options)
    flat = {"model.w": state["model"]["w"], "model.b": state["model"]["b"], "model.ids": state["model"]["ids"],
            "opt.m": state["opt"]["m"]}

    report = resurgo.convert(f"{url}/ck", tmp_path / "o.safetensors", to="safetensors", buffer_bytes="1MiB",
                             storage_options=options)
    out = load_file(tmp_path / "o.safetensors")
    assert sorted(out) == sorted(flat) and all(bits_equal(out[k], t) for k, t in flat.items())
    assert report.src == f"{url}/ck" and report.values_dropped == ["blob"]
    assert report.tensor_bytes == sum(t.numel() * t.element_size() for t in flat.values())
    assert report.peak_buffer_bytes <= 1 * MiB and report.bytes_read >= report.tensor_bytes
    with safe_open(tmp_path / "o.safetensors", "pt") as f:
        assert f.metadata()["resurgo.step"] == "5" and json.loads(f.metadata()["resurgo.values"]) == {"lr": 0.25}

    report = resurgo.convert(f"{url}/ck", tmp_path / "hf", to="hf", only="model.", max_shard_bytes="2MB",
                             storage_options=options)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = {name: load_file(tmp_path / "hf" / name) for name in set(index["weight_map"].values())}
    assert len(shards) == 2 and report.tensors_skipped == ["opt.m"]
    for k in ("w", "b", "ids"):
        assert bits_equal(shards[index["weight_map"][k]][k], state["model"][k])

    resurgo.convert(f"{url}/ck", tmp_path / "o.pt", to="torch", storage_options=options)
    loaded = torch.load(tmp_path / "o.pt", weights_only=True)
    assert all(bits_equal(loaded["model"][k], state["model"][k]) for k in state["model"])
    assert bits_equal(loaded["opt"]["m"], state["opt"]["m"]) and loaded["lr"] == 0.25 and loaded["blob"] == b"x"


def test_convert_from_s3_errors(s3_bucket, tmp_path):
    url, options = s3_bucket
    resurgo.save(s3_state(), f"{url}/ck", storage_options=options)
    with pytest.raises(UnsupportedValueError, match=f"{url}/out: convert writes a local file or directory, not a URL"):
        resurgo.convert(f"{url}/ck", f"{url}/out", to="safetensors", storage_options=options)
    with pytest.raises(CheckpointNotFoundError, match=f"{url}/nothing: not found"):
        resurgo.convert(f"{url}/nothing", tmp_path / "o.safetensors", to="safetensors", storage_options=options)
    # A corrupt object: an error naming the URL and the tensor, and no output.
    fs, root = split_url(f"{url}/ck", options)
    c = resurgo.read_manifest(f"{url}/ck", storage_options=options).tensors["model.w"].chunks[0]
    raw = bytearray(fs.cat_file(f"{root}/{c.file}"))
    raw[c.byte_range[0] + 1000] ^= 0x10
    fs.pipe_file(f"{root}/{c.file}", bytes(raw))
    for to, dst in (("safetensors", tmp_path / "c.safetensors"), ("torch", tmp_path / "c.pt")):
        with pytest.raises(CorruptCheckpointError, match=f"{url}/ck: tensor 'model.w' is corrupt in {c.file}"):
            resurgo.convert(f"{url}/ck", dst, to=to, storage_options=options)
        assert not dst.exists() and not leftovers(tmp_path)


def test_cli_convert_from_s3_with_credentials_from_the_environment(s3_bucket, s3_env, tmp_path, monkeypatch):
    url, options = s3_bucket
    state = s3_state()
    resurgo.save(state, f"{url}/ck", storage_options=options)
    r = runner.invoke(app, ["convert", f"{url}/ck", str(tmp_path / "o.safetensors"), "--to", "safetensors"])
    assert r.exit_code == 0, r.output
    assert f"OK {url}/ck -> {tmp_path / 'o.safetensors'} (safetensors): 4 tensors" in r.output
    out = load_file(tmp_path / "o.safetensors")
    assert bits_equal(out["model.w"], state["model"]["w"]) and bits_equal(out["model.ids"], state["model"]["ids"])
    r = runner.invoke(app, ["convert", f"{url}/missing", str(tmp_path / "m.safetensors"), "--to", "safetensors"])
    assert r.exit_code == 4 and f"{url}/missing: not found" in r.output and "Traceback" not in r.output
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    S3FileSystem.clear_instance_cache()  # s3fs reads the environment anew
    r = runner.invoke(app, ["convert", f"{url}/ck", str(tmp_path / "d.safetensors"), "--to", "safetensors"])
    assert r.exit_code == 4 and f"{url}/ck: access denied" in r.output and not (tmp_path / "d.safetensors").exists()
