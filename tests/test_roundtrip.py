"""Exact round trips through save / load_dict / load for every kind of leaf."""

from __future__ import annotations

import json
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch

import resurgo
from resurgo.format import dtypes
from helpers import bits_equal, nan_with_payload, random_tensor


ALL_DTYPES = sorted(dtypes.TORCH_DTYPES.values(), key=str)


def test_every_torch_dtype_is_covered():
    names = set(dtypes.TORCH_DTYPES)
    for required in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                     "float8_e8m0fnu", "bool", "complex32", "complex64", "complex128", "uint16", "uint32",
                     "uint64", "float4_e2m1fn_x2", "bits8"):
        assert required in names


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips_bitwise(tmp_path, dtype):
    state = {
        "t": random_tensor(dtype, (5, 7), seed=1),
        "zero_d": random_tensor(dtype, (), seed=2),
        "empty": random_tensor(dtype, (0, 3), seed=3),
        "noncontig": random_tensor(dtype, (6, 4), seed=4).t(),
    }
    assert not state["noncontig"].is_contiguous()
    resurgo.save(state, tmp_path / "c")
    out = resurgo.load_dict(tmp_path / "c")
    for k, v in state.items():
        assert out[k].dtype == dtype and out[k].shape == v.shape
        assert bits_equal(out[k], v), k
    target = {k: torch.empty(v.shape, dtype=dtype) for k, v in state.items()}
    target["noncontig"] = torch.empty(6, 4, dtype=dtype).t()  # non-contiguous destination
    report = resurgo.load(target, tmp_path / "c")
    for k, v in state.items():
        assert bits_equal(target[k], v), k
    assert report.bytes_read == sum(v.numel() * dtype.itemsize for v in state.values())


def test_float_specials_keep_their_bits(tmp_path):
    specials = [0.0, -0.0, float("inf"), float("-inf"), nan_with_payload(0x12345), nan_with_payload(1), 5e-324]
    t = torch.tensor(specials, dtype=torch.float64)
    state = {"py": specials, "tensor": t, "f32": t.float(), "np": np.array(specials), "c": complex(-0.0, nan_with_payload(7))}
    resurgo.save(state, tmp_path / "c")
    out = resurgo.load_dict(tmp_path / "c")
    assert [struct.pack("<d", x) for x in out["py"]] == [struct.pack("<d", x) for x in specials]
    assert bits_equal(out, state)


def test_python_values_and_structure_are_exact(tmp_path):
    state = {
        "tuple": (1, (2, 3), [4, (5,)]),
        "list": [1, 2.5, "x", b"\x00\xff", None, True, False],
        "int_keys": {0: "a", 1: "b", -7: "c", 10**30: "big"},
        "mixed_keys": {1: 1, "1": 2, None: 4, 2.5: 5, b"k": 6},
        "bool_keys": {True: "t", False: "f"},
        "ordered": OrderedDict([("z", 1), ("a", 2)]),
        "bigint": -(10**40),
        "nested": {"a": {"b": {"c": [{"d": ()}]}}},
        "empty": {"d": {}, "l": [], "t": ()},
        "unicode": "ü 漢字 \u0000 \udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
        "numpy_scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(200), np.float16(np.nan)],
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "complex": 1 + 2j,
    }
    resurgo.save(state, tmp_path / "c")
    out = resurgo.load_dict(tmp_path / "c")
    assert bits_equal(out, state)
    assert type(out["ordered"]) is OrderedDict
    assert type(out["tuple"][2][1]) is tuple
    assert [type(k) for k in out["mixed_keys"]] == [int, str, type(None), float, bytes]
    assert [type(k) for k in out["bool_keys"]] == [bool, bool]
    assert type(out["size"]) is torch.Size


def test_numpy_arrays(tmp_path):
    rng = np.random.default_rng(0)
    state = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "u64": rng.integers(0, 2**63, size=5, dtype=np.uint64),
        "c128": (rng.standard_normal(3) + 1j * rng.standard_normal(3)),
        "bool": rng.integers(0, 2, size=(2, 2)).astype(bool),
        "noncontig": rng.standard_normal((4, 6))[:, ::2],
        "zero_d": np.array(3.0),
        "empty": np.zeros((0, 4), dtype=np.int16),
    }
    resurgo.save(state, tmp_path / "c")
    out = resurgo.load_dict(tmp_path / "c")
    for k, v in state.items():
        assert isinstance(out[k], np.ndarray)
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and out[k].tobytes() == np.ascontiguousarray(v).tobytes(), k
    target = {k: np.zeros_like(v) for k, v in state.items()}
    resurgo.load(target, tmp_path / "c")
    for k, v in state.items():
        assert target[k].tobytes() == np.ascontiguousarray(v).tobytes()


class Counter:
    """A user Stateful holding plain values."""

    def __init__(self):
        self.n = 0
        self.history = []

    def state_dict(self):
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.history = list(sd["history"])


def test_stateful_objects_model_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    counter = Counter()
    counter.n, counter.history = 3, [1, 2, 3]
    resurgo.save({"model": model, "opt": opt, "counter": counter, "step": 3}, tmp_path / "c")

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    counter2 = Counter()
    state2 = {"model": model2, "opt": opt2, "counter": counter2, "step": 0}
    resurgo.load(state2, tmp_path / "c")  # fresh optimizer: empty 'state' accepts the saved one
    assert state2["step"] == 3
    assert counter2.n == 3 and counter2.history == [1, 2, 3]
    assert bits_equal(dict(model2.state_dict()), dict(model.state_dict()))
    assert bits_equal(opt2.state_dict(), opt.state_dict())
    # load_dict gives the plain state dicts.
    plain = resurgo.load_dict(tmp_path / "c")
    assert bits_equal(plain["opt"], opt.state_dict())
    assert list(plain["model"].keys()) == list(model.state_dict().keys())


def test_load_fills_tensors_in_place(tmp_path):
    src = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3, dtype=torch.int64)}
    resurgo.save(src, tmp_path / "c")
    w = torch.zeros(3, 4)
    target = {"w": w, "b": torch.zeros(3, dtype=torch.int64)}
    ptr = w.data_ptr()
    resurgo.load(target, tmp_path / "c")
    assert target["w"] is w and w.data_ptr() == ptr
    assert torch.equal(w, src["w"])


def test_parameters_with_grad_load_in_place(tmp_path):
    lin = torch.nn.Linear(3, 3)
    resurgo.save({"p": lin.weight}, tmp_path / "c")
    other = torch.nn.Linear(3, 3)
    resurgo.load({"p": other.weight}, tmp_path / "c")
    assert torch.equal(other.weight, lin.weight) and other.weight.requires_grad


def test_large_tensor_split_across_threads_and_files(tmp_path):
    state = {f"big{i}": random_tensor(torch.float32, (9 << 20,), seed=i) for i in range(3)}
    state["small"] = torch.arange(10)
    report = resurgo.save(state, tmp_path / "c", io_threads=4)
    assert report.tensor_bytes == 3 * (36 << 20) + 80
    data_files = [f for f in report.files if f.startswith("data/")]
    assert len(data_files) >= 2  # 108 MiB spread over several files written in parallel
    disk = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert report.bytes_written == disk
    assert disk <= report.tensor_bytes * 1.001 + 65536
    target = {k: torch.empty_like(v) for k, v in state.items()}
    lr = resurgo.load(target, tmp_path / "c", io_threads=4)
    assert lr.bytes_read == report.tensor_bytes
    assert all(bits_equal(target[k], v) for k, v in state.items())


def test_report_phases(tmp_path):
    r = resurgo.save({"a": torch.ones(1000)}, tmp_path / "c", step=7, metadata={"run": "x"})
    assert set(r.seconds) >= {"stage", "write", "checksum", "fsync", "commit", "total"}
    assert all(v >= 0 for v in r.seconds.values())
    lr = resurgo.load({"a": torch.zeros(1000)}, tmp_path / "c")
    assert set(lr.seconds) >= {"plan", "read", "checksum", "total"}
    assert lr.step == 7 and lr.bytes_read == 4000
    m = resurgo.read_manifest(tmp_path / "c")
    assert m.step == 7 and m.metadata == {"run": "x"}


def test_duplicate_flat_keys_are_refused(tmp_path):
    with pytest.raises(resurgo.UnsupportedValueError, match="same key"):
        resurgo.save({0: torch.ones(1), "0": torch.ones(1)}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_save_info_is_apart_from_metadata(tmp_path):
    resurgo.save({"t": torch.ones(2)}, tmp_path / "a", metadata={"run": 1}, save_info={"host": "h"})
    m = resurgo.read_manifest(tmp_path / "a")
    assert m.metadata == {"run": 1} and m.save_info == {"host": "h"}
    resurgo.save({"t": torch.ones(2)}, tmp_path / "b")
    assert "save_info" not in json.loads((tmp_path / "b" / "manifest.json").read_bytes())


@pytest.mark.parametrize("dtype", [torch.bits16, torch.uint4, torch.float4_e2m1fn_x2, torch.float32], ids=str)
def test_loads_with_deterministic_algorithms_on(tmp_path, dtype):
    """torch.empty fills new memory when deterministic algorithms are on, and raises for dtypes it
    cannot fill; loads allocate bytes and view them, so they work under Lightning's deterministic=True."""
    state = {"t": random_tensor(dtype, (5, 7), seed=1), "zero_d": random_tensor(dtype, (), seed=2)}
    resurgo.save(state, tmp_path / "c")
    torch.use_deterministic_algorithms(True)  # the conftest fixture turns it back off
    out = resurgo.load_dict(tmp_path / "c")
    assert all(out[k].dtype == dtype and bits_equal(out[k], v) for k, v in state.items())

