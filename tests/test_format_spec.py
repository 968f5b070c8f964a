"""docs/format.md cannot drift from the code.

- The reader sketch of section 10 (plain json/struct/numpy/xxhash) is extracted from the document
  and run against real checkpoints: it must return every tensor bitwise, and refuse corruption.
- The example manifest of section 9 must pass resurgo's own validation.
- The dtype table and the tree-node table must match ``resurgo.format.dtypes`` and
  ``resurgo.format.tree``.
- Every data file must open with the ``safetensors`` library, which must find each chunk under its
  name with the same bytes (raw U8 bytes for dtypes safetensors lacks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

import resurgo
from resurgo.format import dtypes
from resurgo.errors import ManifestError
from resurgo.format.manifest import parse_manifest
from resurgo.format.tree import FIELDS

from helpers import sealed_manifest

SPEC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


# ------------------------------------------------------------------------------------------------
# Reading the spec
# ------------------------------------------------------------------------------------------------
def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def section(heading: str) -> str:
    """The text of the section whose heading line starts with ``heading``, up to the next one of its level."""
    text = spec_text()
    m = re.search(rf"^(#+) {re.escape(heading)}.*$", text, re.MULTILINE)
    assert m, f"docs/format.md has no heading {heading!r}"
    level = len(m.group(1))
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def code_block(heading: str, lang: str) -> str:
    m = re.search(rf"^```{lang}\n(.*?)^```$", section(heading), re.MULTILINE | re.DOTALL)
    assert m, f"no ```{lang} block under {heading!r}"
    return m.group(1)


def table_after(marker: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table that follows the HTML comment ``marker``."""
    text = spec_text()
    start = text.index(marker)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= set("-: "):
            continue
        rows.append(cells)
    return rows[1:]  # without the header row


def load_reader() -> Any:
    """The ``read_tensor`` function of the spec's reader sketch, in a namespace of its own."""
    code = code_block("10. A minimal reader", "python")
    assert not re.search(r"^\s*(import|from)\s+resurgo", code, re.MULTILINE), "the sketch must not use resurgo"
    namespace: dict[str, Any] = {"__name__": "format_spec_reader"}
    exec(compile(code, "docs/format.md#10", "exec"), namespace)
    return namespace["read_tensor"]


# ------------------------------------------------------------------------------------------------
# A state covering many dtypes
# ------------------------------------------------------------------------------------------------
def raw(t: Any) -> bytes:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    t = t.detach().contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaN patterns included)."""
    n = int(np.prod(shape)) * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def many_dtypes_state() -> dict:
    g = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "f64": torch.randn(2, 2, dtype=torch.float64, generator=g),
        "f8_e4m3fn": random_bits((5, 2), torch.float8_e4m3fn, g),
        "f8_e5m2": random_bits((3,), torch.float8_e5m2, g),
        "c64": torch.randn(3, dtype=torch.complex64, generator=g),
        "c128": torch.randn(2, 3, dtype=torch.complex128, generator=g),  # safetensors lacks it: U8
        "c32": random_bits((4,), torch.complex32, g),  # safetensors lacks it: U8
        "bool": torch.rand(9, generator=g) > 0.5,
        "u8": torch.randint(0, 256, (6,), dtype=torch.uint8, generator=g),
        "i8": torch.randint(-128, 128, (2, 3), dtype=torch.int8, generator=g),
        "u16": random_bits((5,), torch.uint16, g),
        "u32": random_bits((2, 2), torch.uint32, g),
        "u64": random_bits((3,), torch.uint64, g),
        "i64": torch.randint(-(2**62), 2**62, (4,), dtype=torch.int64, generator=g),
        "scalar0d": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "np": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        "np_u16": np.arange(5, dtype=np.uint16) * 1000,
        "np_bool": np.array([True, False, True]),
        "np_c128": np.array([1 + 2j, -0.0 - 1j]),
        "np_0d": np.array(7, dtype=np.int32),
        "nested": {"w": torch.arange(4, dtype=torch.int32), "steps": [torch.tensor([1.0, -0.0])]},
    }
    if hasattr(torch, "float8_e8m0fnu"):
        state["f8_e8m0fnu"] = random_bits((4,), torch.float8_e8m0fnu, g)  # safetensors lacks it: U8
    return state


def leaves(state: Any, prefix: str = "") -> dict[str, Any]:
    """{flat key: tensor}, keys formed as docs/format.md section 8 says."""
    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (torch.Tensor, np.ndarray)):
            out[key] = v
        else:
            out.update(leaves(v, key))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    state = many_dtypes_state()
    path = tmp_path_factory.mktemp("spec") / "ckpt"
    resurgo.save(state, path, block_bytes=8)  # tiny blocks: every chunk has several checksums
    return path, state


# ------------------------------------------------------------------------------------------------
# The reader sketch
# ------------------------------------------------------------------------------------------------
def test_reader_sketch_reads_every_tensor_bitwise(saved):
    path, state = saved
    read_tensor = load_reader()
    want = leaves(state)
    manifest = json.loads((path / "manifest.json").read_bytes())
    assert set(manifest["tensors"]) == set(want)  # the flat keys are as section 8 says
    for key, original in want.items():
        got = read_tensor(str(path), key)
        assert isinstance(got, np.ndarray)
        assert got.tobytes() == raw(original), key
        name = manifest["tensors"][key]["dtype"]
        if isinstance(original, np.ndarray):
            assert got.dtype == original.dtype and got.shape == original.shape, key
        elif name in dtypes.NUMPY_DTYPES:
            assert got.dtype == np.dtype(name) and list(got.shape) == list(original.shape), key
        else:
            assert got.dtype == np.uint8 and list(got.shape) == list(original.shape) + [original.itemsize], key


def test_reader_sketch_on_the_default_block_size(tmp_path):
    state = {"big": torch.randn(300, 257), "small": torch.arange(3)}
    resurgo.save(state, tmp_path / "c")
    read_tensor = load_reader()
    for key, t in state.items():
        assert read_tensor(str(tmp_path / "c"), key).tobytes() == raw(t)


def test_reader_sketch_example_of_the_spec(tmp_path):
    """Section 9's state, read by section 10's reader, gives what the spec says it gives."""
    state = {
        "model": {"weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                  "bias": torch.tensor([0.5, -2.0], dtype=torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(10.0)}},
                      "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}]},
        "data": {"epoch": 2, "order": np.array([3, 1, 2], dtype=np.int64), "name": "train",
                 "salt": b"\x01\x02", "note": None},
    }
    resurgo.save(state, tmp_path / "c", step=10, metadata={"run": "demo"})
    mine = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    spec = json.loads(code_block("9. Example", "json"))
    assert re.fullmatch("[0-9a-f]{32}", mine.pop("manifest_checksum"))  # the example leaves it out
    for doc in (mine, spec):
        doc.pop("created_at")
        doc.pop("library")
    assert mine == spec  # the example is what resurgo writes (apart from time, versions, its seal)
    weight = load_reader()(str(tmp_path / "c"), "model.weight")
    np.testing.assert_array_equal(weight, np.array([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], dtype=np.float32))


def _copy(saved, tmp_path: Path) -> Path:
    path, _ = saved
    out = tmp_path / "ckpt"
    shutil.copytree(path, out)
    return out


def test_reader_sketch_refuses_a_flipped_byte(saved, tmp_path):
    path = _copy(saved, tmp_path)
    m = json.loads((path / "manifest.json").read_bytes())
    chunk = m["tensors"]["f32"]["chunks"][0]
    data = path / chunk["file"]
    b = bytearray(data.read_bytes())
    b[chunk["byte_range"][0] + 17] ^= 0x01
    data.write_bytes(bytes(b))
    read_tensor = load_reader()
    with pytest.raises(ValueError, match="block 2 does not match"):
        read_tensor(str(path), "f32")
    b[5] ^= 0x01  # inside the safetensors header's length prefix
    data.write_bytes(bytes(b))
    with pytest.raises(ValueError, match="header"):
        read_tensor(str(path), "bf16")


def test_reader_sketch_refuses_paths_outside(saved, tmp_path):
    path = _copy(saved, tmp_path)
    m = json.loads((path / "manifest.json").read_bytes())
    name = m["tensors"]["f32"]["chunks"][0]["file"]
    outside = tmp_path / "outside.safetensors"
    shutil.move(path / name, outside)
    (path / name).symlink_to(outside)
    read_tensor = load_reader()
    with pytest.raises(ValueError, match="leaves the checkpoint"):
        read_tensor(str(path), "f32")
    for bad in ("../outside.safetensors", "/etc/passwd", "data/../manifest.json"):
        m2 = json.loads(json.dumps(m))
        m2["tensors"]["f32"]["chunks"][0]["file"] = bad
        m2["files"][bad] = m2["files"][name]
        (path / "manifest.json").write_bytes(sealed_manifest(m2))
        with pytest.raises(ValueError, match="bad data file path"):
            read_tensor(str(path), "f32")


def test_reader_sketch_refuses_an_unsealed_manifest(saved, tmp_path):
    """A manifest relabelled as version 1 (unsealed), its step edited: refused, as resurgo refuses it."""
    path = _copy(saved, tmp_path)
    m = json.loads((path / "manifest.json").read_bytes())
    del m["manifest_checksum"]
    (path / "manifest.json").write_bytes(json.dumps({**m, "version": 1, "step": 99}).encode())
    with pytest.raises(ValueError, match="version 1 is unsealed"):
        load_reader()(str(path), "f32")
    with pytest.raises(ManifestError, match="format version 1 is unsealed"):
        resurgo.read_manifest(path)
    (path / "manifest.json").write_bytes(json.dumps(m).encode())  # version 2 without its seal
    with pytest.raises(ValueError, match="manifest_checksum is missing"):
        load_reader()(str(path), "f32")


def test_reader_sketch_refuses_sizes_that_disagree(saved, tmp_path):
    path = _copy(saved, tmp_path)
    m = json.loads((path / "manifest.json").read_bytes())
    m["tensors"]["f32"]["shape"] = [3, 6]
    m["tensors"]["f32"]["chunks"][0]["box"]["shape"] = [3, 6]
    (path / "manifest.json").write_bytes(sealed_manifest(m))
    with pytest.raises(ValueError, match="wrong size"):
        load_reader()(str(path), "f32")


# ------------------------------------------------------------------------------------------------
# The example and the tables
# ------------------------------------------------------------------------------------------------
def test_example_manifest_is_valid():
    doc = json.loads(code_block("9. Example", "json"))
    m = parse_manifest(sealed_manifest(doc), "docs/format.md#9")  # sealed as resurgo writes it
    assert m.tensor_bytes == 24 + 4 + 4 + 24


def test_dtype_table_matches_the_code():
    rows = table_after("<!-- dtype-table")
    documented: dict[str, tuple[int, str]] = {}
    for name_cell, size, code in rows:
        names = re.findall(r"`([a-z0-9_]+)`", name_cell)
        if "..." in name_cell:  # `int1` ... `int7`
            first, last = names
            stem = first.rstrip("0123456789")
            names = [f"{stem}{i}" for i in range(int(first[len(stem):]), int(last[len(stem):]) + 1)]
        st_code = code.strip("`") if code.startswith("`") else "U8"
        for n in names:
            documented[n] = (int(size), st_code)
    actual = {n: (d.itemsize, dtypes.SAFETENSORS_CODES.get(n, "U8")) for n, d in dtypes.TORCH_DTYPES.items()}
    assert documented == actual
    # Every numpy name of section 4.2 is in the code's numpy table, and no other.
    numpy_names = set(re.findall(r"`([a-z0-9]+)`", section("4.2 Element types").split("MUST have one of")[1].split(".")[0]))
    assert numpy_names == set(dtypes.NUMPY_DTYPES)


def test_node_table_matches_the_code():
    rows = table_after("<!-- node-table")
    documented = {}
    for type_cell, fields_cell, _ in rows:
        (t,) = re.findall(r"`([a-z_]+)`", type_cell)
        documented[t] = frozenset(re.findall(r"`([a-z0-9_]+)`", fields_cell))
    assert documented == FIELDS


def test_limits_in_the_spec_match_the_code():
    from resurgo.format import manifest, tree

    text = spec_text()
    assert f"nest at most {tree.MAX_TREE_DEPTH} deep" in text
    assert f"at most {manifest.MAX_NDIM} dimensions" in text
    assert manifest.MAX_BLOCK_BYTES == 1 << 30 and "`1 <= block_bytes <= 2^30`" in text
    assert manifest.MAX_MANIFEST_BYTES == 1 << 30 and "at most 1 GiB" in text
    assert manifest.MAX_TENSOR_BYTES == (1 << 62) - 1 and "<= 2^62 - 1" in text
    assert manifest.DATA_FILE_RE.pattern.strip("^$") in text


# ------------------------------------------------------------------------------------------------
# The data files are safetensors files
# ------------------------------------------------------------------------------------------------
def test_every_data_file_opens_with_safetensors(saved):
    path, state = saved
    want = leaves(state)
    m = json.loads((path / "manifest.json").read_bytes())
    seen = set()
    for name in m["files"]:
        with safe_open(str(path / name), framework="pt") as f:
            stored = set(f.keys())
            assert f.metadata() == {"format": "pt", "producer": "resurgo"}
            for key, entry in m["tensors"].items():
                for chunk in entry["chunks"]:
                    if chunk["file"] != name:
                        continue
                    assert chunk.get("name", key) in stored, key
                    t = f.get_tensor(chunk.get("name", key))
                    original = want[key]
                    if entry["dtype"] in dtypes.SAFETENSORS_CODES:
                        assert t.dtype == dtypes.TORCH_DTYPES[entry["dtype"]], key
                        assert list(t.shape) == chunk["box"]["shape"], key
                    else:  # stored as raw bytes
                        assert t.dtype == torch.uint8 and list(t.shape) == [len(raw(original))], key
                    assert raw(t) == raw(original), key
                    seen.add(key)
    assert seen == set(want)
    for needs_u8 in ("c128", "c32"):
        assert m["tensors"][needs_u8]["dtype"] not in dtypes.SAFETENSORS_CODES


def test_data_files_open_with_safetensors_numpy(saved):
    """framework='numpy' reads every chunk whose dtype numpy has, with the same bytes."""
    path, state = saved
    want = leaves(state)
    m = json.loads((path / "manifest.json").read_bytes())
    checked = 0
    for name in m["files"]:
        with safe_open(str(path / name), framework="numpy") as f:
            for key, entry in m["tensors"].items():
                (chunk,) = entry["chunks"]
                if chunk["file"] != name or entry["dtype"] not in dtypes.NUMPY_DTYPES:
                    continue
                if entry["dtype"] not in dtypes.SAFETENSORS_CODES:  # complex128: raw bytes
                    continue
                a = f.get_tensor(chunk.get("name", key))
                assert a.dtype == np.dtype(entry["dtype"]) and a.tobytes() == raw(want[key]), key
                checked += 1
    assert checked >= 15


def test_reader_sketch_refuses_non_regular_and_truncated_files(saved, tmp_path):
    path = _copy(saved, tmp_path)
    m = json.loads((path / "manifest.json").read_bytes())
    data = path / m["tensors"]["f32"]["chunks"][0]["file"]
    content = data.read_bytes()
    read_tensor = load_reader()
    data.write_bytes(content[:-1])
    with pytest.raises(ValueError, match="the manifest says"):
        read_tensor(str(path), "f32")
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(ValueError, match="not a regular file"):
        read_tensor(str(path), "f32")
