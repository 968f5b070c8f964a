"""resurgo.convert(..., to="dcp") and `resurgo convert --to dcp`: a directory PyTorch's own
``torch.distributed.checkpoint`` reads.

The output is read with DCP itself: ``dcp.load`` in one process (no process group) into fresh
model and optimizer state dicts, nested or flat; ``dcp_to_torch_save``; and ``dcp.load`` on two
gloo ranks into FSDP2 modules sharded otherwise than the job that saved. Compared bitwise.
"""

from __future__ import annotations

import os
import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.conversion import is_dcp_output_file, weights_only_loadable
from resurgo.errors import CheckpointExistsError, KeyMismatchError, MemoryBudgetError, UnsupportedValueError
from resurgo.format.manifest import TMP_MARKER
from dcp_workers import build
from dist_harness import run_ranks
from helpers import bits_equal, random_tensor


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


def load_dcp(target: dict, path: Path) -> None:
    """``dcp.load`` in this one process, without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(target, checkpoint_id=path, no_dist=True)


def trained(seed: int = 0, lr: float = 1e-3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.95))
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    return model, opt


def save_train_state(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model, opt = trained()
    ts = resurgo.TrainState(model=model, optimizer=opt, step=42)
    sd = ts.state_dict()
    resurgo.save(ts, path)
    return model, opt, sd


def test_train_state_loads_into_fresh_model_and_optimizer(tmp_path):
    model, opt, sd = save_train_state(tmp_path / "ck")
    report = resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")

    assert sorted(os.listdir(tmp_path / "dcp")) == [".metadata", "__0_0.distcp"] == report.files
    assert report.bytes_written == sum(p.stat().st_size for p in (tmp_path / "dcp").iterdir())
    expected_tensors = {**{f"model.{k}": v for k, v in model.state_dict().items()},
                        **{f"optimizer.state.{i}.{n}": v for i, st in opt.state_dict()["state"].items()
                           for n, v in st.items()},
                        "rng.0.torch": sd["rng"].value["torch"]}
    assert report.num_tensors == len(expected_tensors) + 2  # and the python and numpy RNG arrays
    assert leftovers(tmp_path) == []

    fresh, fresh_opt = trained(seed=1, lr=0.5)  # other weights, other moments, other hyperparameters
    target = {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict(), "step": 0}
    load_dcp(target, tmp_path / "dcp")
    fresh.load_state_dict(target["model"])
    fresh_opt.load_state_dict(target["optimizer"])
    assert target["step"] == 42
    assert bits_equal(fresh.state_dict(), model.state_dict())
    assert bits_equal(fresh_opt.state_dict(), opt.state_dict())
    assert fresh_opt.param_groups[0]["lr"] == 1e-3 and fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)

    # The keys are the flat keys of the checkpoint: a flat target loads the same bytes.
    flat = {k: torch.empty_like(v) for k, v in expected_tensors.items()}
    load_dcp(flat, tmp_path / "dcp")
    assert bits_equal(flat, expected_tensors)


def test_dcp_to_torch_save_gives_the_checkpoint_flattened(tmp_path):
    save_train_state(tmp_path / "ck")
    resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "full.pt")
    got = torch.load(tmp_path / "full.pt", weights_only=False)
    want, _ = flatten_state_dict(weights_only_loadable(resurgo.load_dict(tmp_path / "ck")))
    assert bits_equal(got, want)
    assert got["step"] == 42 and got["optimizer.param_groups.0.betas"] == (0.8, 0.95)
    assert isinstance(got["rng.0.python.state"], torch.Tensor)  # a numpy array, as a torch tensor


def test_dtypes_strides_and_values(tmp_path):
    dts = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int64,
           torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.uint16]
    state = {
        "t": {str(dt).removeprefix("torch."): random_tensor(dt, (3, 2), seed=i) for i, dt in enumerate(dts)},
        "bool": torch.tensor([[True, False]] * 3),  # random bytes would not be valid bools
        "strided": torch.arange(12, dtype=torch.int32).reshape(3, 4).t(),
        "zero_d": torch.tensor(2.5, dtype=torch.float64), "empty": torch.empty(0, 4),
        "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
        "epoch": 3, "nan": float("nan"), "blob": b"\x00\x01", "cplx": 1 + 2j, "name": "run", "none": None,
        "ints": [1, 2, 3], "nested": {"list": [torch.ones(2), {"x": 5}]},
    }
    resurgo.save(state, tmp_path / "ck")
    resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "full.pt")
    got = torch.load(tmp_path / "full.pt", weights_only=False)
    want = {f"t.{k}": v for k, v in state["t"].items()}
    want.update({"bool": state["bool"], "strided": state["strided"], "zero_d": state["zero_d"], "empty": state["empty"],
                 "arr": torch.from_numpy(state["arr"]), "epoch": 3, "nan": got["nan"], "blob": b"\x00\x01",
                 "cplx": 1 + 2j, "name": "run", "none": None, "ints": [1, 2, 3],
                 "nested.list.0": torch.ones(2), "nested.list.1.x": 5})
    assert bits_equal(got, want) and np.isnan(got["nan"])


def test_only_keeps_and_strips_a_prefix(tmp_path):
    model, opt, _ = save_train_state(tmp_path / "ck")
    report = resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp", only="model.")
    fresh, _ = trained(seed=3)
    sd = fresh.state_dict()
    load_dcp(sd, tmp_path / "dcp")  # a module's own state dict, as is
    fresh.load_state_dict(sd)
    assert bits_equal(fresh.state_dict(), model.state_dict())
    assert report.num_tensors == 4 and len(report.tensors_skipped) == 12 + 3  # moments and steps, RNG
    assert sorted(dcp.FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata) == sorted(sd)

    # Values under the prefix are kept too.
    report = resurgo.convert(tmp_path / "ck", tmp_path / "opt", to="dcp", only="optimizer.param_groups.0.")
    groups = {k: None for k in opt.state_dict()["param_groups"][0]}
    load_dcp(groups, tmp_path / "opt")
    assert groups == opt.state_dict()["param_groups"][0] and report.num_tensors == 0
    with pytest.raises(KeyMismatchError, match=r"ck: no key starts with 'modle\.' \(the keys start with: "
                                               r"'model\.', 'optimizer\.', 'rng\.', 'step'\)"):
        resurgo.convert(tmp_path / "ck", tmp_path / "x", to="dcp", only="modle.")
    assert not (tmp_path / "x").exists() and leftovers(tmp_path) == []


def test_refused_over_buffer_bytes_and_sub_byte_dtypes(tmp_path):
    resurgo.save({"w": torch.zeros(1000), "v": torch.zeros(24)}, tmp_path / "ck")
    with pytest.raises(MemoryBudgetError, match=r"ck: a DCP checkpoint needs the whole state in memory \(4096 bytes "
                                                r"of tensors\), more than buffer_bytes=4000; raise buffer_bytes, or "
                                                r"convert to safetensors or hf, which stream"):
        resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp", buffer_bytes=4000)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp", buffer_bytes="4096B")

    resurgo.save({"bits": torch.zeros(4, dtype=torch.uint8).view(torch.uint1)}, tmp_path / "ck1")
    with pytest.raises(UnsupportedValueError, match=r"tensor 'bits' has dtype uint1, which torch.save cannot store"):
        resurgo.convert(tmp_path / "ck1", tmp_path / "d1", to="dcp")
    assert not (tmp_path / "d1").exists() and leftovers(tmp_path) == []


def test_overwrite_replaces_only_a_dcp_directory(tmp_path):
    resurgo.save({"w": torch.arange(4.0)}, tmp_path / "ck")
    resurgo.save({"w": torch.arange(4.0) + 10}, tmp_path / "ck2")
    dst = tmp_path / "dcp"
    resurgo.convert(tmp_path / "ck", dst, to="dcp")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in dst.iterdir())
    with pytest.raises(CheckpointExistsError, match=r"dcp: already exists; pass overwrite=True"):
        resurgo.convert(tmp_path / "ck2", dst, to="dcp")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in dst.iterdir()) == before
    (dst / "__1_0.distcp").write_bytes(b"from a save on more ranks")  # DCP's names: still a DCP directory
    resurgo.convert(tmp_path / "ck2", dst, to="dcp", overwrite=True)
    target = {"w": torch.zeros(4)}
    load_dcp(target, dst)
    assert bits_equal(target["w"], torch.arange(4.0) + 10) and sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp"]

    (dst / "config.json").write_text("{}")
    with pytest.raises(resurgo.ForeignFilesError, match=r"dcp: holds 'config.json', which resurgo did not write; "
                                                        r"refusing to replace it, nothing was changed"):
        resurgo.convert(tmp_path / "ck", dst, to="dcp", overwrite=True)
    assert sorted(os.listdir(dst)) == [".metadata", "__0_0.distcp", "config.json"]
    (dst / "config.json").unlink()
    (dst / "sub").mkdir()
    (dst / "sub" / "x.distcp").write_bytes(b"")
    with pytest.raises(resurgo.ForeignFilesError, match=r"holds 'sub'"):
        resurgo.convert(tmp_path / "ck", dst, to="dcp", overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointExistsError, match=r"file: exists and is not a directory"):
        resurgo.convert(tmp_path / "ck", tmp_path / "file", to="dcp", overwrite=True)
    assert leftovers(tmp_path) == []


def test_dcp_output_names():
    assert is_dcp_output_file(".metadata") and is_dcp_output_file("__0_0.distcp") and is_dcp_output_file("__12_3.distcp")
    assert not any(map(is_dcp_output_file, ["metadata", ".metadata.tmp", "sub/__0_0.distcp", "x.distcp.tmp", "a.pt"]))


def test_corrupt_source_writes_nothing(tmp_path):
    resurgo.save({"a": torch.zeros(1000), "z": torch.arange(1000.0)}, tmp_path / "ck")
    chunk = resurgo.read_manifest(tmp_path / "ck").tensors["z"].chunks[0]
    raw = bytearray((tmp_path / "ck" / chunk.file).read_bytes())
    raw[chunk.byte_range[0] + 5] ^= 0x10
    (tmp_path / "ck" / chunk.file).write_bytes(bytes(raw))
    with pytest.raises(resurgo.CorruptCheckpointError, match=r"ck: tensor 'z' is corrupt"):
        resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_cli_convert_to_dcp(tmp_path):
    runner = CliRunner()
    resurgo.save({"model": {"w": torch.arange(6.0)}, "opt": {"m": torch.ones(2)}, "lr": 0.5}, tmp_path / "ck")
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "dcp"), "--to", "dcp", "--only", "model."])
    assert r.exit_code == 0, r.output
    assert "(dcp): 1 tensor, 24 B in 2 files" in r.output and "1 tensor outside --only 'model.' not converted" in r.output
    target = {"w": torch.zeros(6)}
    load_dcp(target, tmp_path / "dcp")
    assert bits_equal(target["w"], torch.arange(6.0))
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "dcp"), "--to", "dcp"])
    assert r.exit_code == 2 and "already exists" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "d2"), "--to", "dcp", "--buffer", "10B"])
    assert r.exit_code == 2 and "needs the whole state in memory" in r.output, r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "ck"), str(tmp_path / "d3"), "--to", "dcp", "--json"])
    assert r.exit_code == 0 and '"to": "dcp"' in r.stdout


def test_fsdp2_checkpoint_of_two_ranks_loads_into_another_sharding(tmp_path):
    """Saved by 2 gloo ranks (FSDP2, rows sharded), converted in one process, loaded by ``dcp.load``
    on 2 ranks into FSDP2 sharded by columns, and in one process into a plain module."""
    run_ranks(2, "dcp_workers:save_fsdp", str(tmp_path))
    reference = torch.load(tmp_path / "reference.pt")
    assert max(len(t.chunks) for t in resurgo.read_manifest(tmp_path / "ck").tensors.values()) == 2
    report = resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    assert report.files == [".metadata", "__0_0.distcp"]
    metadata = dcp.FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata
    assert all(len(metadata[k].chunks) == 1 for k in reference)  # full tensors, one chunk each

    placements = run_ranks(2, "dcp_workers:load_dcp_fsdp", str(tmp_path))
    assert placements[0] == ['0.weight: (Shard(dim=1),)', '0.bias: (Shard(dim=0),)', '2.weight: (Shard(dim=1),)',
                             '2.bias: (Shard(dim=0),)']
    loaded = torch.load(tmp_path / "loaded.pt")
    assert loaded.pop("step") == 3 and loaded.pop("lr") == 0.1
    assert bits_equal(loaded, reference)

    model = build()
    sd = model.state_dict()
    load_dcp({"model": sd}, tmp_path / "dcp")
    assert bits_equal({f"model.{k}": v for k, v in sd.items()}, {k: v for k, v in reference.items() if k.startswith("model.")})


def test_pickled_values_need_allow_pickle(tmp_path):
    resurgo.save({"w": torch.ones(3), "obj": Fraction(1, 3)}, tmp_path / "ck", allow_pickle=True)
    with pytest.raises(resurgo.PickleNotAllowedError, match="holds pickled values"):
        resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    resurgo.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp", allow_pickle=True)
    target = {"w": torch.zeros(3), "obj": None}
    load_dcp(target, tmp_path / "dcp")
    assert target["obj"] == Fraction(1, 3) and bits_equal(target["w"], torch.ones(3))
