"""resurgo.import_checkpoint and `resurgo import`: Hugging Face directories (single file, sharded
with an index, pytorch_model.bin), torch.save files and hand-written specs.

Sources are written by the real libraries (safetensors.torch.save_file, torch.save); every import
is loaded back with resurgo.load into another layout and compared bitwise with what the library
itself loads. Bad input: coverage gaps and overlaps, truncated files, unequal replicas, crafted
pickles, unsafe paths.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ImportSpecError,
    MemoryBudgetError,
    KeyMismatchError,
    PickleNotAllowedError,
    UnsupportedValueError,
)
from resurgo.interop import spec as spec_lang
from resurgo.interop.spec import coverage_problem
from resurgo.layout.box import ChunkBox, FlatRange

runner = CliRunner()


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(11, 6, generator=g),
            "layers.0.weight": torch.randn(6, 6, generator=g).bfloat16(),
            "layers.0.bias": torch.randn(6, generator=g).half(),
            "head.weight": torch.randint(-100, 100, (3, 6), generator=g, dtype=torch.int64),
            "empty": torch.empty(0, 6)}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                     b.contiguous().view(-1).view(torch.uint8) if b.numel() else b)


def check_loads_back(dst: Path, expected: dict[str, torch.Tensor]) -> None:
    """Full tensors through load_dict, and the rows 3.. of the first 2-d tensor through a Shard."""
    got = resurgo.load_dict(dst)
    assert {k for k in got if isinstance(got[k], torch.Tensor)} == set(expected)
    for k, v in expected.items():
        assert same(got[k], v), k
    key = next(k for k, v in expected.items() if v.dim() == 2 and v.shape[0] > 3)
    full = expected[key]
    local = torch.zeros(full.shape[0] - 3, full.shape[1], dtype=full.dtype)
    resurgo.load({key: resurgo.Shard(local, full.shape, (3, 0))}, dst, strict=False)
    assert same(local, full[3:])
    assert runner.invoke(app, ["verify", str(dst)]).exit_code == 0


def test_hf_single_safetensors_file(tmp_path):
    sd = model_state()
    (tmp_path / "m").mkdir()
    save_file(sd, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    report = resurgo.import_checkpoint(tmp_path / "m", tmp_path / "out", source="hf")
    assert report.num_tensors == 5 and report.tensor_bytes == sum(v.numel() * v.element_size() for v in sd.values())
    assert report.bytes_read == report.tensor_bytes
    check_loads_back(tmp_path / "out", load_file(str(tmp_path / "m" / "model.safetensors")))


def test_hf_sharded_with_index(tmp_path):
    sd = model_state()
    root = tmp_path / "m"
    root.mkdir()
    shards = {"model-00001-of-00002.safetensors": ["embed.weight", "empty"],
              "model-00002-of-00002.safetensors": ["layers.0.weight", "layers.0.bias", "head.weight"]}
    for name, keys in shards.items():  # as save_pretrained(max_shard_size=...) writes them
        save_file({k: sd[k] for k in keys}, str(root / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    resurgo.import_checkpoint(root, tmp_path / "out", source="hf")
    expected = {k: v for n in shards for k, v in load_file(str(root / n)).items()}
    check_loads_back(tmp_path / "out", expected)


def test_hf_pytorch_model_bin(tmp_path):
    sd = model_state()
    (tmp_path / "m").mkdir()
    torch.save(sd, tmp_path / "m" / "pytorch_model.bin")
    resurgo.import_checkpoint(tmp_path / "m", tmp_path / "out", source="hf")
    check_loads_back(tmp_path / "out", torch.load(tmp_path / "m" / "pytorch_model.bin", weights_only=True))


def test_torch_save_nested_strided_shared_and_values(tmp_path):
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    state = {"model": {"w": base.t(), "row": base[2], "p": torch.nn.Parameter(torch.ones(3, 2))},
             "optimizer": {"state": {0: {"exp_avg": torch.full((4,), 0.5, dtype=torch.float64)}},
                           "param_groups": [{"lr": 0.01, "betas": [0.9, 0.99], "name": None}]},
             "step": 12, "layers": [base[:, 1:3], "tag"]}
    torch.save(state, tmp_path / "ckpt.pt")
    report = resurgo.import_checkpoint(tmp_path / "ckpt.pt", tmp_path / "out", source="torch")
    ref = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    expected = {"model.w": ref["model"]["w"], "model.row": ref["model"]["row"], "model.p": ref["model"]["p"].detach(),
                "optimizer.state.0.exp_avg": ref["optimizer"]["state"][0]["exp_avg"], "layers.0": ref["layers"][0]}
    check_loads_back(tmp_path / "out", expected)
    got = resurgo.load_dict(tmp_path / "out")
    assert got["step"] == 12 and got["layers.1"] == "tag"
    assert got["optimizer.param_groups"] == [{"lr": 0.01, "betas": [0.9, 0.99], "name": None}]
    assert resurgo.read_manifest(tmp_path / "out").step == 12
    assert report.num_values == 3 and report.src == str(tmp_path / "ckpt.pt")


def write_raw(tmp_path: Path, data: bytes, name: str = "src.bin") -> Path:
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


def piece(offset: int, shape: list[int], **dest) -> dict:
    return {"file": "src.bin", "offset": offset, "shape": shape, **dest}


def spec_doc(tensors: list[dict], values: dict | None = None) -> dict:
    return {"format": "resurgo.import-spec", "version": 1, "tensors": tensors, "values": values or {}}


def test_spec_round_trip_and_apply_with_flat_ranges_strides_and_replicas(tmp_path):
    a = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    write_raw(tmp_path, a.numpy().tobytes() * 2)
    doc = spec_doc([
        {"key": "rows", "dtype": "int32", "shape": [4, 6], "pieces": [
            piece(0, [2, 6], box={"offsets": [0, 0], "shape": [2, 6]}, replicas=[{"file": "src.bin", "offset": 96}]),
            piece(48, [2, 6], box={"offsets": [2, 0], "shape": [2, 6]})]},
        {"key": "cols", "dtype": "int32", "shape": [6, 4], "pieces": [
            piece(0, [6, 4], strides=[1, 6], box={"offsets": [0, 0], "shape": [6, 4]})]},
        {"key": "flat", "dtype": "int32", "shape": [4, 6], "pieces": [
            piece(40, [14], flat={"start": 10, "stop": 24}), piece(0, [10], flat={"start": 0, "stop": 10})]},
    ], {"step": 5, "note": "hand-written"})
    spec = spec_lang.loads(json.dumps(doc))
    assert spec_lang.loads(spec_lang.dumps(spec)) == spec
    (tmp_path / "spec.json").write_text(spec_lang.dumps(spec))
    report = resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="spec", spec=tmp_path / "spec.json")
    assert report.bytes_read == 3 * 96 + 48  # the replica is read too, to compare it
    check_loads_back(tmp_path / "out", {"rows": a, "cols": a.t(), "flat": a})
    assert resurgo.load_dict(tmp_path / "out")["note"] == "hand-written"


def import_spec(tmp_path: Path, doc: dict, dst: str = "out") -> resurgo.ImportReport:
    return resurgo.import_checkpoint(tmp_path, tmp_path / dst, source="spec", spec=spec_lang.loads(json.dumps(doc)))


def test_gap_and_overlap_are_named(tmp_path):
    gap = spec_doc([{"key": "w", "dtype": "float32", "shape": [4, 6], "pieces": [
        piece(0, [2, 6], box={"offsets": [0, 0], "shape": [2, 6]}), piece(48, [1, 6], box={"offsets": [3, 0], "shape": [1, 6]})]}])
    with pytest.raises(ImportSpecError, match=r"tensor 'w': no piece covers element 12 \(coordinates \[2, 0\]\), "
                                              r"uncovered: box offsets \[2, 0\] shape \[1, 6\]"):
        spec_lang.loads(json.dumps(gap))
    overlap = spec_doc([{"key": "w", "dtype": "float32", "shape": [4, 6], "pieces": [
        piece(0, [3, 6], box={"offsets": [0, 0], "shape": [3, 6]}), piece(0, [2, 6], box={"offsets": [2, 0], "shape": [2, 6]})]}])
    with pytest.raises(ImportSpecError, match=r"tensor 'w': box offsets \[2, 0\] shape \[1, 6\] is covered twice"):
        spec_lang.loads(json.dumps(overlap))
    flat_gap = spec_doc([{"key": "f", "dtype": "float32", "shape": [2, 5], "pieces": [piece(0, [4], flat={"start": 0, "stop": 4})]}])
    with pytest.raises(ImportSpecError, match=r"tensor 'f': no piece covers element 4 \(coordinates \[0, 4\]\), "
                                              r"uncovered: flat range \[4, 10\)"):
        spec_lang.loads(json.dumps(flat_gap))
    assert not (tmp_path / "out").exists()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3).flatmap(
    lambda cuts: st.tuples(st.just(cuts), st.lists(st.integers(1, 3), min_size=len(cuts), max_size=len(cuts)),
                           st.integers(0, 10**6), st.booleans())))
def test_coverage_problem_names_the_missing_or_doubled_box(case):
    """A grid tiling with one box removed names that box's corner as the first uncovered element,
    and the region it names lies inside the removed box; with one box doubled, names it."""
    blocks, sizes, pick, double = case
    shape = tuple(b * s for b, s in zip(blocks, sizes))
    grid = [ChunkBox(tuple(i * s for i, s in zip(idx, sizes)), tuple(sizes))
            for idx in __import__("itertools").product(*(range(b) for b in blocks))]
    chosen = grid[pick % len(grid)]
    assert coverage_problem(grid, shape) is None
    if double:
        assert coverage_problem(grid + [chosen], shape) == f"{spec_lang.describe(chosen)} is covered twice"
        return
    problem = coverage_problem([b for b in grid if b != chosen], shape)
    assert problem is not None
    assert f"(coordinates {list(chosen.offsets)})" in problem
    offsets, sizes_ = (json.loads(x) for x in problem.split("box offsets ")[1].split(" shape "))
    assert ChunkBox(tuple(offsets), tuple(sizes_)).intersect(chosen) == ChunkBox(tuple(offsets), tuple(sizes_))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=6), st.integers(0, 10**6))
def test_flat_gap_is_the_removed_range(lengths, pick):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ranges = [FlatRange(s, s + n) for s, n in zip(starts, lengths)]
    gone = ranges[pick % len(ranges)]
    problem = coverage_problem([r for r in ranges if r != gone], (sum(lengths),))
    assert problem == (f"no piece covers element {gone.start} (coordinates [{gone.start}]), "
                       f"uncovered: flat range [{gone.start}, {gone.stop})")


@pytest.mark.parametrize("bad, message", [
    ({"file": "/etc/passwd"}, "must be a relative path"),
    ({"file": "../x.bin"}, "must be a relative path"),
    ({"strides": [1]}, "1 strides for a shape of 2 dimensions"),
    ({"strides": [-1, 1]}, "must not be negative"),
    ({"box": {"offsets": [1, 0], "shape": [2, 3]}}, r"destination box offsets \[1, 0\] shape \[2, 3\] lies outside"),
    ({"shape": [3, 3]}, r"source shape \[3, 3\] holds 9 elements, its destination box offsets \[0, 0\] shape \[2, 3\] 6"),
])
def test_invalid_pieces_are_refused(bad, message):
    p = {**piece(0, [2, 3], box={"offsets": [0, 0], "shape": [2, 3]}), **bad}
    with pytest.raises(ImportSpecError, match=message):
        spec_lang.loads(json.dumps(spec_doc([{"key": "w", "dtype": "float32", "shape": [2, 3], "pieces": [p]}])))
    with pytest.raises(ImportSpecError, match="unknown dtype 'float31'"):
        spec_lang.loads(json.dumps(spec_doc([{"key": "w", "dtype": "float31", "shape": [0], "pieces": []}])))


def test_truncated_source_names_file_and_size_and_writes_nothing(tmp_path):
    write_raw(tmp_path, bytes(40))
    doc = spec_doc([{"key": "w", "dtype": "float32", "shape": [2, 6], "pieces": [
        piece(0, [2, 6], box={"offsets": [0, 0], "shape": [2, 6]})]}])
    with pytest.raises(CorruptCheckpointError, match=r"src\.bin: tensor 'w' piece 0 needs bytes \[0, 48\) but it holds "
                                                     r"40 bytes \(expected at least 48\)"):
        import_spec(tmp_path, doc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.bin"]
    (tmp_path / "src.bin").unlink()
    with pytest.raises(CheckpointNotFoundError, match="src.bin: source file not found"):
        import_spec(tmp_path, doc)


def test_truncated_safetensors_shard(tmp_path):
    (tmp_path / "m").mkdir()
    save_file(model_state(), str(tmp_path / "m" / "model.safetensors"))
    data = (tmp_path / "m" / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CorruptCheckpointError, match=rf"model\.safetensors: tensor '.*' piece 0 needs bytes \[\d+, {len(data)}\)"):
        resurgo.import_checkpoint(tmp_path / "m", tmp_path / "out", source="hf")
    assert not (tmp_path / "out").exists()


def test_replicas_must_be_equal(tmp_path):
    a = torch.arange(12, dtype=torch.float32)
    b = a.clone()
    b[7] = -0.0 if a[7] == 0 else float("nan")
    write_raw(tmp_path, a.numpy().tobytes() + a.numpy().tobytes() + b.numpy().tobytes())
    ok = spec_doc([{"key": "w", "dtype": "float32", "shape": [12], "pieces": [
        piece(0, [12], box={"offsets": [0], "shape": [12]}, replicas=[{"file": "src.bin", "offset": 48}])]}])
    import_spec(tmp_path, ok)
    assert same(resurgo.load_dict(tmp_path / "out")["w"], a)
    bad = json.loads(json.dumps(ok))
    bad["tensors"][0]["pieces"][0]["replicas"].append({"file": "src.bin", "offset": 96})
    with pytest.raises(CorruptCheckpointError, match=r"src\.bin: tensor 'w' piece 0 replica 1 differs from the piece at "
                                                     r".*src\.bin offset 0: replicas must be equal"):
        import_spec(tmp_path, bad, "out2")
    assert not (tmp_path / "out2").exists()


def crafted_torch_file(path: Path, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")


@pytest.mark.parametrize("payload_of, global_name", [
    (lambda f: b"cos\nsystem\n(S'touch " + str(f).encode() + b"'\ntR.", "os.system"),
    (lambda f: b"cbuiltins\neval\n(S'open(" + repr(str(f)).encode() + b", \"w\")'\ntR.", "builtins.eval"),
    (lambda f: b"csubprocess\nPopen\n((S'touch'\nS'" + str(f).encode() + b"'\nltR.", "subprocess.Popen"),
    (lambda f: pickle.dumps({"w": io.FileIO}), "_io.FileIO"),
])
def test_crafted_pickle_is_refused_and_has_no_effect(tmp_path, payload_of, global_name):
    marker = tmp_path / "pwned"
    crafted_torch_file(tmp_path / "evil.pt", payload_of(marker))
    with pytest.raises(PickleNotAllowedError, match=rf"evil\.pt:archive/data\.pkl: the pickle needs the global {global_name}"):
        resurgo.import_checkpoint(tmp_path / "evil.pt", tmp_path / "out", source="torch")
    assert not marker.exists() and not (tmp_path / "out").exists()
    result = runner.invoke(app, ["import", str(tmp_path / "evil.pt"), str(tmp_path / "out"), "--from", "torch"])
    assert result.exit_code == 2 and not marker.exists()


def test_unknown_source_and_existing_destination(tmp_path):
    with pytest.raises(UnsupportedValueError, match="source must be one of 'dcp', 'deepspeed', 'megatron', 'hf', 'peft', 'torch', 'spec', not 'tar'"):
        resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="tar")
    (tmp_path / "m").mkdir()
    save_file(model_state(), str(tmp_path / "m" / "model.safetensors"))
    resurgo.import_checkpoint(tmp_path / "m", tmp_path / "out", source="hf")
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    with pytest.raises(CheckpointExistsError):
        resurgo.import_checkpoint(tmp_path / "m", tmp_path / "out", source="hf")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before


def test_cli_import_emit_spec_and_exit_codes(tmp_path):
    (tmp_path / "m").mkdir()
    save_file(model_state(), str(tmp_path / "m" / "model.safetensors"))
    cli = lambda *args: runner.invoke(app, ["import", *map(str, args)])
    r = cli(tmp_path / "m", tmp_path / "a", "--from", "hf", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["num_tensors"] == 5
    assert cli(tmp_path / "m", "--from", "hf", "--emit-spec", tmp_path / "s.json").exit_code == 0
    assert spec_lang.loads((tmp_path / "s.json").read_text()) == resurgo.interop.hf.spec_from_hf(tmp_path / "m")
    assert cli(tmp_path / "m", tmp_path / "b", "--from", "spec", "--spec", tmp_path / "s.json").exit_code == 0
    assert resurgo.load_dict(tmp_path / "b").keys() == resurgo.load_dict(tmp_path / "a").keys()
    assert cli(tmp_path / "m", tmp_path / "c", "--from", "spec").exit_code == 2  # --spec missing
    assert cli(tmp_path / "m", tmp_path / "c", "--from", "tar").exit_code == 2
    assert cli(tmp_path / "m", tmp_path / "c", "--from", "deepspeed").exit_code == 4  # not a DeepSpeed checkpoint
    assert cli(tmp_path / "m", tmp_path / "a", "--from", "hf").exit_code == 2  # exists
    (tmp_path / "bad.json").write_text("{}")
    assert cli(tmp_path / "m", tmp_path / "c", "--from", "spec", "--spec", tmp_path / "bad.json").exit_code == 2
    assert cli(tmp_path / "nowhere", tmp_path / "c", "--from", "hf").exit_code == 4
    data = (tmp_path / "m" / "model.safetensors").read_bytes()
    (tmp_path / "m" / "model.safetensors").write_bytes(data[:-4])
    assert cli(tmp_path / "m", tmp_path / "c", "--from", "hf").exit_code == 3
    assert not (tmp_path / "c").exists()


def reference_mean(copies: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """docs/import.md's averaging written out with numpy: exact float64 of each copy, summed in
    listing order, divided by the count, rounded to float32, then (16-bit dtypes) to the dtype."""
    acc = copies[0].double().numpy().copy()
    for c in copies[1:]:
        acc = acc + c.double().numpy()
    mean = acc / len(copies)
    return torch.from_numpy(mean) if dtype == torch.float64 else torch.from_numpy(mean.astype(np.float32)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16], ids=str)
def test_mean_combines_replicas_with_the_documented_arithmetic(tmp_path, dtype):
    g = torch.Generator().manual_seed(3)
    copies = [torch.randn(5, 7, generator=g).to(dtype) for _ in range(3)]
    for c in copies:  # signed zeros: -0.0 + -0.0 + -0.0 stays -0.0 (a sum started from +0.0 would not)
        c[0, 0] = -0.0
    if dtype == torch.float64:  # listing order matters: (1e16 + 1) - 1e16 is 0, (1e16 - 1e16) + 1 is 1
        copies[0][1, 1], copies[1][1, 1], copies[2][1, 1] = 1e16, 1.0, -1e16
    write_raw(tmp_path, b"".join(c.view(torch.uint8).numpy().tobytes() for c in copies))
    nbytes = copies[0].numel() * copies[0].element_size()
    doc = spec_doc([{"key": "ln", "dtype": str(dtype).removeprefix("torch."), "shape": [5, 7], "pieces": [
        piece(0, [5, 7], box={"offsets": [0, 0], "shape": [5, 7]}, combine="mean",
              replicas=[{"file": "src.bin", "offset": nbytes}, {"file": "src.bin", "offset": 2 * nbytes}])]}])
    report = import_spec(tmp_path, doc)
    got = resurgo.load_dict(tmp_path / "out")["ln"]
    want = reference_mean(copies, dtype)
    assert same(got, want) and report.bytes_read == 3 * nbytes
    assert not same(got, copies[0])  # the copies differ: neither one was written as it is
    assert got[0, 0].item() == 0.0 and torch.signbit(got[0, 0])
    if dtype == torch.float64:
        assert got[1, 1].item() == 0.0


def test_mean_rounds_through_float32_as_torch_converts(tmp_path):
    """Four bfloat16 copies whose float64 mean is 1 + 2^-8 + 2^-30: rounded to float32 it is the
    midpoint 1 + 2^-8, which rounds to even (1.0); rounded once it would be 1 + 2^-7."""
    values = torch.tensor([4.0, 2.0 ** -6, 2.0 ** -28, 0.0], dtype=torch.bfloat16)
    write_raw(tmp_path, values.view(torch.uint8).numpy().tobytes())
    doc = spec_doc([{"key": "x", "dtype": "bfloat16", "shape": [1], "pieces": [
        piece(0, [1], box={"offsets": [0], "shape": [1]}, combine="mean",
              replicas=[{"file": "src.bin", "offset": 2 * i} for i in (1, 2, 3)])]}])
    import_spec(tmp_path, doc)
    assert resurgo.load_dict(tmp_path / "out")["x"].item() == 1.0


def test_mean_is_refused_for_integer_dtypes_and_round_trips_in_json():
    mean_piece = piece(0, [4], box={"offsets": [0], "shape": [4]}, combine="mean", replicas=[{"file": "b.bin"}])
    with pytest.raises(ImportSpecError, match=r"spec: tensor 'step': piece 0: combine 'mean' averages floating-point "
                                              r"elements only \(float64, float32, .*\), not int64; use combine 'equal'"):
        spec_lang.loads(json.dumps(spec_doc([{"key": "step", "dtype": "int64", "shape": [4], "pieces": [mean_piece]}])))
    with pytest.raises(ImportSpecError, match=r"pieces\.0\.combine: Input should be 'equal' or 'mean'"):
        spec_lang.loads(json.dumps(spec_doc([{"key": "w", "dtype": "float32", "shape": [4],
                                               "pieces": [{**mean_piece, "combine": "sum"}]}])))
    spec = spec_lang.loads(json.dumps(spec_doc([{"key": "w", "dtype": "float32", "shape": [4], "pieces": [mean_piece]},
                                                {"key": "v", "dtype": "float32", "shape": [4], "pieces": [piece(0, [4], box={"offsets": [0], "shape": [4]})]}])))
    text = spec_lang.dumps(spec)
    assert spec_lang.loads(text) == spec and spec.tensors[0].pieces[0].combine == "mean"
    assert text.count('"combine":"mean"') == 1 and '"equal"' not in text  # the default is left out


def test_means_beyond_buffer_bytes_are_refused_before_writing(tmp_path):
    n = (5 << 20) // 4  # 5 MiB of float32 averaged: with one writer's 10 MiB, more than a 12 MiB budget
    write_raw(tmp_path, bytes(8 * n))
    doc = spec_doc([{"key": "w", "dtype": "float32", "shape": [n], "pieces": [
        piece(0, [n], box={"offsets": [0], "shape": [n]}, combine="mean", replicas=[{"file": "src.bin", "offset": 4 * n}])]}])
    with pytest.raises(MemoryBudgetError, match=rf"the averaged pieces \(combine 'mean'\) hold {4 * n} bytes in memory until "
                                                rf"written; with one writer's {10 << 20} bytes that is more than "
                                                rf"buffer_bytes={12 << 20}; raise buffer_bytes"):
        resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="spec", spec=spec_lang.loads(json.dumps(doc)),
                                  buffer_bytes=12 << 20)
    assert not (tmp_path / "out").exists()
    resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="spec", spec=spec_lang.loads(json.dumps(doc)),
                              buffer_bytes=16 << 20)
    assert resurgo.load_dict(tmp_path / "out")["w"].count_nonzero() == 0


def test_the_example_spec_of_docs_import_md_is_valid():
    text = (Path(__file__).resolve().parents[1] / "docs" / "import.md").read_text()
    example = text.split("```json\n", 1)[1].split("```", 1)[0]
    spec = spec_lang.loads(example, "docs/import.md")
    assert [p.combine for t in spec.tensors for p in t.pieces] == ["equal", "equal", "equal", "mean", "equal", "equal"]


def test_only_imports_the_matching_keys_and_reads_nothing_else(tmp_path):
    base = torch.arange(40, dtype=torch.float32).reshape(5, 8)
    state = {"model": {"w": base.t(), "fc": {"bias": torch.ones(3)}, "modelx": torch.zeros(2)},
             "optimizer": {"state": {0: {"exp_avg": torch.full((4,), 0.5, dtype=torch.float64)}}}, "step": 12}
    torch.save(state, tmp_path / "ckpt.pt")
    report = resurgo.import_checkpoint(tmp_path / "ckpt.pt", tmp_path / "glob", source="torch", only="model.*")
    got = resurgo.load_dict(tmp_path / "glob")
    assert sorted(got) == ["model.fc.bias", "model.modelx", "model.w"]  # '*' crosses dots
    assert same(got["model.w"], base.t()) and report.num_tensors == 3 and report.num_values == 0
    assert report.bytes_read == report.tensor_bytes == (40 + 3 + 2) * 4
    resurgo.import_checkpoint(tmp_path / "ckpt.pt", tmp_path / "prefix", source="torch", only=["model.fc", "step"])
    assert sorted(resurgo.load_dict(tmp_path / "prefix")) == ["model.fc.bias", "step"]  # a prefix ends at a dot


def test_only_skips_the_other_pieces_unread_and_a_pattern_matching_nothing_is_named(tmp_path):
    write_raw(tmp_path, torch.arange(6, dtype=torch.float32).numpy().tobytes())
    doc = spec_doc([{"key": "model.w", "dtype": "float32", "shape": [6], "pieces": [piece(0, [6], flat={"start": 0, "stop": 6})]},
                    {"key": "optim.m", "dtype": "float32", "shape": [6], "pieces": [piece(1 << 20, [6], flat={"start": 0, "stop": 6})]}])
    (tmp_path / "s.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="truncated"):  # optim.m lies beyond the end of src.bin
        resurgo.import_checkpoint(tmp_path, tmp_path / "all", source="spec", spec=tmp_path / "s.json")
    resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="spec", spec=tmp_path / "s.json", only="model.*")
    assert list(resurgo.load_dict(tmp_path / "out")) == ["model.w"]
    with pytest.raises(KeyMismatchError, match=r"pattern\(s\) 'opt\.\*', 'x' match no key of the source \(it has 2 keys: model\.w, optim\.m\)"):
        resurgo.import_checkpoint(tmp_path, tmp_path / "none", source="spec", spec=tmp_path / "s.json", only=["opt.*", "model", "x"])
    assert not (tmp_path / "none").exists()
    cli = lambda *args: runner.invoke(app, ["import", str(tmp_path), *map(str, args), "--from", "spec", "--spec", str(tmp_path / "s.json")])
    assert cli(tmp_path / "cli", "--only", "optim.m", "--only", "nothing").exit_code == 2
    assert cli(tmp_path / "cli", "--only", "model").exit_code == 0
    assert list(resurgo.load_dict(tmp_path / "cli")) == ["model.w"]
    (tmp_path / "m").mkdir()
    save_file(model_state(), str(tmp_path / "m" / "model.safetensors"))
    assert runner.invoke(app, ["import", str(tmp_path / "m"), "--from", "hf", "--emit-spec", str(tmp_path / "e.json"),
                               "--only", "layers"]).exit_code == 0
    assert [t.key for t in spec_lang.loads((tmp_path / "e.json").read_text()).tensors] == ["layers.0.weight", "layers.0.bias"]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def test_buffer_bytes_bounds_the_peak_resident_memory(tmp_path):
    """A 96 MiB source imported with a 16 MiB budget: the process's peak resident memory (VmHWM,
    reset first) grows by less than the budget: the sources are read into the writers' slice
    buffers, not mapped (a mapping's pages would all be resident by the end)."""
    size = 96 << 20
    with open(tmp_path / "src.bin", "wb") as f:
        for i in range(size >> 20):
            f.write(torch.full((1 << 18,), float(i)).numpy().tobytes())
    n = size // 4
    doc = spec_doc([{"key": "a", "dtype": "float32", "shape": [n // 2], "pieces": [piece(0, [n // 2], flat={"start": 0, "stop": n // 2})]},
                    {"key": "b", "dtype": "float32", "shape": [n // 2], "pieces": [piece(size // 2, [n // 2], flat={"start": 0, "stop": n // 2})]}])
    spec = spec_lang.loads(json.dumps(doc))
    resurgo.import_checkpoint(tmp_path, tmp_path / "warm", source="spec", spec=spec)  # imports, caches: not the import's memory
    with pytest.raises(resurgo.errors.MemoryBudgetError, match=r"buffer_bytes=9437184 is below what one writer holds \(10485760 bytes"):
        resurgo.import_checkpoint(tmp_path, tmp_path / "small", source="spec", spec=spec, buffer_bytes="9MiB")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status_bytes("VmRSS:")
    report = resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="spec", spec=spec, buffer_bytes="16MiB")
    peak_growth = _status_bytes("VmHWM:") - before
    assert report.bytes_read == size
    assert list(report.seconds) == ["spec", "check", "prepare", "write_and_commit", "read", "checksum", "write", "fsync",
                                    "commit", "total"]
    assert 0 < report.seconds["read"] and report.seconds["write_and_commit"] < report.seconds["total"]
    assert peak_growth < 16 << 20, f"peak resident memory grew by {peak_growth} bytes"
    got = resurgo.load_dict(tmp_path / "out")
    assert torch.equal(got["b"][-1:], torch.tensor([95.0])) and torch.equal(got["a"][:1], torch.tensor([0.0]))


def test_a_source_cut_short_while_it_is_read_is_named(tmp_path):
    from resurgo.interop.execute import _FileStream

    (tmp_path / "src.bin").write_bytes(bytes(range(100)))
    fd = os.open(tmp_path / "src.bin", os.O_RDONLY)
    try:
        stream = _FileStream(torch.empty(50, dtype=torch.int32), fd, 40, "src.bin")  # needs bytes [40, 240)
        out = np.empty(200, dtype=np.uint8)
        with pytest.raises(CorruptCheckpointError, match=r"src.bin: ended at byte 60 of a piece that needs 200 bytes \(from byte 40\); the file was truncated"):
            stream.read_into(0, out)
        assert bytes(stream.read_into(8, out[:40])) == bytes(range(48, 88))
    finally:
        os.close(fd)
