"""Foreign files crafted as an attacker would: each importer (DCP, torch.save, Hugging Face,
DeepSpeed, a spec) reads nothing outside its source, walks a pickle at a cost bounded by its size,
writes no more than a bounded multiple of its source without consent, and refuses hostile
geometry with an ImportSpecError (CLI exit 2) naming the file and the entry. And a data file
swapped with a symlink while a checkpoint is read gives a resurgo error, never a raw OSError.

Every input is built here: DCP ``.metadata`` from DCP's own classes, torch.save zips whose
``data.pkl`` is replaced with zipfile, safetensors headers edited by hand.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
import struct
import subprocess
import sys
import time
import tracemalloc
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.errors import ExpansionError, ImportSpecError, ResurgoError, StorageError
from resurgo import conversion
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.storage import direct_io, local
from resurgo.storage.open import open_checkpoint

from helpers import resealed

runner = CliRunner()


# ------------------------------------------------------------------------------------------------
# Building hostile inputs
# ------------------------------------------------------------------------------------------------
def dcp_checkpoint(path: Path) -> Path:
    state = {"w": torch.arange(8, dtype=torch.float32).reshape(2, 4), "b": torch.ones(3), "step": 7}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def edit_metadata(path: Path, edit) -> None:
    """Rewrite ``path/.metadata`` with ``edit(md)`` applied: DCP's own dataclasses, pickled as DCP does."""
    md = pickle.loads((path / ".metadata").read_bytes())  # our own file: a plain load is fine here
    edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))


def storage_entry(md, fqn: str):
    return next(k for k in md.storage_data if k.fqn == fqn)


class _StorageId:
    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _Rebuild:
    """Pickles as torch.save pickles a tensor, with the storage offset, size and stride chosen."""

    def __init__(self, storage: _StorageId, offset, size, stride):
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageId):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def torch_file_with_pickle(path: Path, obj, raw_pickle: bytes | None = None) -> Path:
    """A torch.save file of one float32 storage '0' of 16 elements whose data.pkl is replaced by
    ``obj`` pickled as torch pickles (or by ``raw_pickle``), rewritten with zipfile."""
    torch.save({"t": torch.arange(16, dtype=torch.float32)}, path)
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    pkl = next(n for n in members if n.endswith("/data.pkl"))
    if raw_pickle is None:
        buf = __import__("io").BytesIO()
        _TorchPickler(buf, protocol=2).dump(obj)
        raw_pickle = buf.getvalue()
    members[pkl] = raw_pickle
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def safetensors_with_header(path: Path, edit) -> Path:
    """A safetensors file of two tensors whose JSON header is edited by ``edit(doc)``."""
    save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 2)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8: 8 + n])
    edit(doc)
    header = json.dumps(doc).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    return path


def shared_lists(levels: int) -> list:
    """Lists ``levels`` deep, each holding its child twice: a pickle of a few hundred bytes that a
    tree walk expands to 2**levels leaves."""
    node: list = [1]
    for _ in range(levels):
        node = [node, node]
    return node


def deep_list_pickle(depth: int) -> bytes:
    """A pickle of {'t': <a tensor>, 'v': [[[...]]]} nested ``depth`` levels (written opcode by
    opcode: pickle.dumps itself recurses)."""
    head = b"\x80\x02}X\x01\x00\x00\x00v"
    return head + b"]" * depth + b"a" * (depth - 1) + b"s."


def bounded(fn, seconds: float = 1.0, megabytes: int = 300):
    """Run ``fn``; the issue's bound for an input under 10 KB: at most 1 s and 300 MB."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < seconds, f"took {elapsed:.2f} s"
    assert peak < megabytes << 20, f"peaked at {peak >> 20} MB"


# ------------------------------------------------------------------------------------------------
# 1. Every path stays inside the source, symlinks followed
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_dcp_storage_entry_naming_a_file_outside_is_refused(tmp_path, how):
    src = dcp_checkpoint(tmp_path / "src")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"S" * 12)  # exactly "b"'s 3 float32 elements, raw: the old import took it

    def edit(md):
        key = storage_entry(md, "b")
        rel = str(secret) if how == "absolute" else "../secret.bin"
        md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path=rel, offset=0, length=12)

    edit_metadata(src, edit)
    with pytest.raises(ImportSpecError, match=r"\.metadata: storage entry of 'b': relative_path: .* must be a relative path"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="dcp")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--from", "dcp"])
    assert result.exit_code == 2, result.output


def test_dcp_data_file_symlinked_outside_is_refused(tmp_path):
    src = dcp_checkpoint(tmp_path / "src")
    distcp = next(src.glob("*.distcp"))
    outside = tmp_path / "elsewhere.distcp"
    distcp.rename(outside)
    distcp.symlink_to(outside)
    with pytest.raises(ImportSpecError, match=rf"{distcp.name}' leads to {outside}, outside the source directory"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="dcp")
    assert not (tmp_path / "out").exists()


def test_dcp_metadata_symlinked_outside_is_refused(tmp_path):
    src = dcp_checkpoint(tmp_path / "src")
    outside = tmp_path / "md"
    (src / ".metadata").rename(outside)
    (src / ".metadata").symlink_to(outside)
    with pytest.raises(ImportSpecError, match="the DCP metadata: '.metadata' leads to"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="dcp")


def test_a_symlink_inside_the_source_that_stays_inside_is_followed(tmp_path):
    src = dcp_checkpoint(tmp_path / "src")
    distcp = next(src.glob("*.distcp"))
    (src / "sub").mkdir()
    distcp.rename(src / "sub" / distcp.name)
    distcp.symlink_to(Path("sub") / distcp.name)
    resurgo.import_checkpoint(src, tmp_path / "out", source="dcp")
    got = resurgo.load_dict(tmp_path / "out")
    assert torch.equal(got["w"], torch.arange(8, dtype=torch.float32).reshape(2, 4))


def spec_doc(file: str, shape: list[int], strides: list[int] | None = None, offset: int = 0) -> dict:
    piece = {"file": file, "offset": offset, "shape": shape, "box": {"offsets": [0] * len(shape), "shape": shape}}
    if strides is not None:
        piece["strides"] = strides
    return {"format": "resurgo.import-spec", "version": 1, "values": {},
            "tensors": [{"key": "x", "dtype": "float32", "shape": shape, "pieces": [piece]}]}


def test_user_spec_file_symlinked_outside_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\x00" * 16)
    (tmp_path / "src" / "data.bin").symlink_to(tmp_path / "secret.bin")
    (tmp_path / "spec.json").write_text(json.dumps(spec_doc("data.bin", [4])))
    with pytest.raises(ImportSpecError, match="'data.bin' leads to .*secret.bin, outside the source directory"):
        resurgo.import_checkpoint(tmp_path / "src", tmp_path / "out", source="spec", spec=tmp_path / "spec.json")
    result = runner.invoke(app, ["import", str(tmp_path / "src"), str(tmp_path / "out"), "--from", "spec",
                                 "--spec", str(tmp_path / "spec.json")])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()


def hf_cache(tmp_path: Path) -> tuple[Path, Path]:
    """A Hugging Face cache repository as huggingface_hub lays it out: the snapshot's files are
    relative symlinks into the repository's blobs/. Returns (the snapshot, the repository)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    save_file({"a": torch.arange(6, dtype=torch.float32)}, str(repo / "blobs" / "f00d"))
    (snap / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / "f00d")
    return snap, repo


@pytest.mark.parametrize("swapped", ["file", "folder"])
def test_a_path_swapped_for_a_link_after_its_check_is_not_followed(tmp_path, monkeypatch, swapped):
    """The attacker's best moment: right after a source file's path was checked inside the source,
    the file (or the folder holding it) becomes a link to elsewhere. The import opens the very
    file checked or raises StorageError; it never reads what the link leads to."""
    from resurgo.interop import execute

    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "sub" / "one.bin").write_bytes(struct.pack("<4f", 1, 2, 3, 4))
    (tmp_path / "outside" / "sub").mkdir(parents=True)
    (tmp_path / "outside" / "sub" / "one.bin").write_bytes(b"SECRET!!" * 2)
    (tmp_path / "spec.json").write_text(json.dumps(spec_doc("sub/one.bin", [4])))
    checked = execute.resolve_inside

    def then_swapped(root, rel, what):
        real = checked(root, rel, what)
        inside = tmp_path / "src" / ("sub/one.bin" if swapped == "file" else "sub")
        inside.rename(inside.with_name(inside.name + ".old"))
        inside.symlink_to(tmp_path / "outside" / ("sub/one.bin" if swapped == "file" else "sub"))
        return real

    monkeypatch.setattr(execute, "resolve_inside", then_swapped)
    with pytest.raises(StorageError, match=r"sub/one.bin: .*was the source changed during the import\?"):
        resurgo.import_checkpoint(tmp_path / "src", tmp_path / "out", source="spec", spec=tmp_path / "spec.json")
    assert not (tmp_path / "out").exists()


def test_hf_cache_snapshot_symlinks_into_its_blobs_are_followed(tmp_path):
    snap, _ = hf_cache(tmp_path)
    resurgo.import_checkpoint(snap, tmp_path / "out", source="hf")
    assert torch.equal(resurgo.load_dict(tmp_path / "out")["a"], torch.arange(6, dtype=torch.float32))


def test_hf_cache_snapshot_symlink_leaving_its_repository_is_refused(tmp_path):
    snap, repo = hf_cache(tmp_path)
    other = tmp_path / "hub" / "models--other--repo" / "blobs"
    other.mkdir(parents=True)
    (repo / "blobs" / "f00d").rename(other / "f00d")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(other / "f00d")
    with pytest.raises(ImportSpecError, match="outside the source directory"):
        resurgo.import_checkpoint(snap, tmp_path / "out", source="hf")


def test_hf_file_symlinked_outside_a_plain_directory_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    save_file({"a": torch.ones(2)}, str(tmp_path / "elsewhere.safetensors"))
    (tmp_path / "m" / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ImportSpecError, match="'model.safetensors' leads to"):
        resurgo.import_checkpoint(tmp_path / "m", tmp_path / "out", source="hf")


def test_deepspeed_latest_symlinked_outside_is_refused(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "tag.txt").write_text("global_step1")
    (tmp_path / "ds" / "latest").symlink_to(tmp_path / "tag.txt")
    with pytest.raises(ImportSpecError, match="the tag file: 'latest' leads to"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "out", source="deepspeed")


def test_a_torch_file_named_through_a_symlink_is_read(tmp_path):
    """The file the caller names is trusted as named: a link to it is the caller's own choice."""
    torch.save({"x": torch.arange(3.0)}, tmp_path / "real.pt")
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "ckpt.pt").symlink_to(tmp_path / "real.pt")
    resurgo.import_checkpoint(tmp_path / "links" / "ckpt.pt", tmp_path / "out", source="torch")
    assert torch.equal(resurgo.load_dict(tmp_path / "out")["x"], torch.arange(3.0))


def test_importer_specs_are_validated_like_user_specs(tmp_path):
    """A DCP chunk placed outside its tensor: the importer's spec fails the validation a --spec gets."""
    src = dcp_checkpoint(tmp_path / "src")

    def edit(md):
        md.state_dict_metadata["b"].chunks[0].offsets = torch.Size([5])
        key = storage_entry(md, "b")
        info = md.storage_data.pop(key)
        md.storage_data[dataclasses.replace(key, offset=torch.Size([5]))] = info

    edit_metadata(src, edit)
    with pytest.raises(ImportSpecError, match=r"\(dcp\): tensor 'b': piece 0: destination box offsets \[5\] shape \[3\] "
                                              r"lies outside the shape \[3\]"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="dcp")


# ------------------------------------------------------------------------------------------------
# 3. Pickles walked with a budget that counts shared objects once, and a depth limit
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("levels", [21, 24])
def test_shared_lists_small_on_disk_are_refused_at_once(tmp_path, levels):
    path = torch_file_with_pickle(tmp_path / "bomb.pt", {"t": _Rebuild(_StorageId("0", 16), 0, (16,), (1,)),
                                                         "v": shared_lists(levels)})
    assert path.stat().st_size < 2048

    def run():
        with pytest.raises(ImportSpecError, match=r"bomb.pt:bomb/data.pkl: the pickled structure expands to more "
                                                  r"than \d+ nodes when walked .* from \d+ bytes"):
            resurgo.import_checkpoint(path, tmp_path / "out", source="torch")

    bounded(run)
    assert not (tmp_path / "out").exists()


def test_shared_lists_in_a_hugging_face_bin_are_refused(tmp_path):
    (tmp_path / "m").mkdir()
    torch_file_with_pickle(tmp_path / "m" / "pytorch_model.bin",
                           {"t": _Rebuild(_StorageId("0", 16), 0, (16,), (1,)), "v": shared_lists(24)})
    bounded(lambda: pytest.raises(ImportSpecError, resurgo.import_checkpoint, tmp_path / "m", tmp_path / "out",
                                  source="hf"))


def test_sharing_that_stays_small_is_imported(tmp_path):
    """A value the pickle shares a few times (a memoized list) expands by little: imported as is."""
    shared = [1, 2, 3]
    path = torch_file_with_pickle(tmp_path / "ok.pt", {"t": _Rebuild(_StorageId("0", 16), 2, (2, 3), (3, 1)),
                                                       "v": [shared, shared, shared]})
    resurgo.import_checkpoint(path, tmp_path / "out", source="torch")
    got = resurgo.load_dict(tmp_path / "out")
    assert got["v"] == [[1, 2, 3]] * 3
    assert torch.equal(got["t"], torch.arange(2, 8, dtype=torch.float32).reshape(2, 3))


def test_hundred_thousand_deep_nesting_is_a_clear_error(tmp_path):
    path = torch_file_with_pickle(tmp_path / "deep.pt", None, raw_pickle=deep_list_pickle(100_000))
    with pytest.raises(ImportSpecError, match="deep.pt:deep/data.pkl: the pickled structure nests deeper than 200 levels"):
        resurgo.import_checkpoint(path, tmp_path / "out", source="torch")


def test_a_pickle_that_contains_itself_is_refused(tmp_path):
    loop: list = []
    loop.append(loop)
    path = torch_file_with_pickle(tmp_path / "cycle.pt", {"v": loop})
    with pytest.raises(ImportSpecError, match="contains itself"):
        resurgo.import_checkpoint(path, tmp_path / "out", source="torch")


# ------------------------------------------------------------------------------------------------
# 4. Outputs bounded by inputs
# ------------------------------------------------------------------------------------------------
def test_a_stride_zero_tensor_needs_consent(tmp_path):
    torch.save({"x": torch.ones(1).expand(2 ** 24)}, tmp_path / "expand.pt")
    assert (tmp_path / "expand.pt").stat().st_size < 2048
    with pytest.raises(ExpansionError, match=r"would write 67108864 bytes of tensors from \d+ bytes of source files, "
                                              r".* tensor 'x' \(float32 \[16777216\]\) is 67108864 bytes read from 4 "
                                              r"bytes of its source \(strides \[0\]\); pass allow_expansion=True"):
        resurgo.import_checkpoint(tmp_path / "expand.pt", tmp_path / "out", source="torch")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["import", str(tmp_path / "expand.pt"), str(tmp_path / "out"), "--from", "torch"])
    assert result.exit_code == 2 and "--allow-expansion" in result.output
    torch.save({"x": torch.full((1,), 2.5).expand(2 ** 20)}, tmp_path / "small.pt")
    result = runner.invoke(app, ["import", str(tmp_path / "small.pt"), str(tmp_path / "out"), "--from", "torch",
                                 "--allow-expansion"])
    assert result.exit_code == 0, result.output
    assert torch.equal(resurgo.load_dict(tmp_path / "out")["x"], torch.full((2 ** 20,), 2.5))


def test_a_four_tebibyte_spec_over_four_bytes_is_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "one.bin").write_bytes(struct.pack("<f", 1.0))
    (tmp_path / "spec.json").write_text(json.dumps(spec_doc("one.bin", [2 ** 40], strides=[0])))
    with pytest.raises(ExpansionError, match=r"would write 4398046511104 bytes of tensors from 4 bytes"):
        resurgo.import_checkpoint(tmp_path / "src", tmp_path / "out", source="spec", spec=tmp_path / "spec.json")
    assert not (tmp_path / "out").exists()


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    torch.save({"x": torch.arange(1000.0)}, tmp_path / "m.pt")
    real = conversion.shutil.disk_usage
    monkeypatch.setattr(conversion.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=3999))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(StorageError, match=r"the import needs 4000 bytes for its tensors, but the filesystem .* has "
                                           r"3999 bytes free; nothing was written"):
        resurgo.import_checkpoint(tmp_path / "m.pt", tmp_path / "out", source="torch")
    assert sorted(os.listdir(tmp_path)) == before
    result = runner.invoke(app, ["import", str(tmp_path / "m.pt"), str(tmp_path / "out"), "--from", "torch"])
    assert result.exit_code == 4


class _QuotaOS:
    """``os`` whose ``write`` fails with ENOSPC once ``left`` bytes are written: a full disk."""

    def __init__(self, left: int):
        self.left = left

    def __getattr__(self, name: str):
        return getattr(os, name)

    def write(self, fd: int, data) -> int:
        if self.left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, memoryview(data)[: self.left])
        self.left -= n
        return n


def test_a_disk_that_fills_during_the_import_leaves_nothing(tmp_path, monkeypatch):
    torch.save({"x": torch.arange(1 << 20, dtype=torch.float32)}, tmp_path / "m.pt")
    (tmp_path / "dst").mkdir()
    quota = _QuotaOS(64 << 10)
    monkeypatch.setattr(local, "os", quota)
    monkeypatch.setattr(direct_io, "os", quota)
    with pytest.raises(StorageError):
        resurgo.import_checkpoint(tmp_path / "m.pt", tmp_path / "dst" / "out", source="torch")
    assert os.listdir(tmp_path / "dst") == []


def checkpoint_sharing_bytes(path: Path, copies: int) -> None:
    """A checkpoint whose manifest (resealed) lists ``copies`` more tensors on the bytes of "x"."""
    resurgo.save({"x": torch.arange(1024.0)}, path)
    doc = json.loads((path / "manifest.json").read_bytes())
    del doc["manifest_checksum"]
    for i in range(copies):
        doc["tensors"][f"y{i}"] = json.loads(json.dumps(doc["tensors"]["x"]))
        doc["tree"]["items"].append([f"y{i}", {"type": "tensor", "key": f"y{i}"}])
    (path / "manifest.json").write_bytes(resealed(json.dumps(doc).encode()))


def test_convert_of_chunks_sharing_bytes_needs_consent(tmp_path):
    checkpoint_sharing_bytes(tmp_path / "c", 50)
    with pytest.raises(ExpansionError, match=r"its 51 tensors take 208896 bytes, 51.0 times the 4096 distinct bytes "
                                             r"their chunks read .* pass allow_expansion=True"):
        resurgo.convert(tmp_path / "c", tmp_path / "out.safetensors", to="safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    result = runner.invoke(app, ["convert", str(tmp_path / "c"), str(tmp_path / "out.safetensors"), "--to",
                                 "safetensors"])
    assert result.exit_code == 2 and "--allow-expansion" in result.output
    result = runner.invoke(app, ["convert", str(tmp_path / "c"), str(tmp_path / "out.safetensors"), "--to",
                                 "safetensors", "--allow-expansion"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out.safetensors").stat().st_size > 51 * 4096


def test_convert_checks_free_space_first(tmp_path, monkeypatch):
    resurgo.save({"x": torch.arange(1024.0)}, tmp_path / "c")
    real = conversion.shutil.disk_usage
    monkeypatch.setattr(conversion.shutil, "disk_usage", lambda p: real(p)._replace(free=4095))
    with pytest.raises(StorageError, match="the conversion needs 4096 bytes for its tensors, .* 4095 bytes free"):
        resurgo.convert(tmp_path / "c", tmp_path / "out.safetensors", to="safetensors")
    assert not (tmp_path / "out.safetensors").exists()


# ------------------------------------------------------------------------------------------------
# 5. Hostile geometry: ImportSpecError naming the file and the entry, never a raw error
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset,size,stride,match", [
    (-4, (4,), (1,), r"storage offset -4, size \[4\], stride \[1\]\): offset, sizes and strides must be non-negative"),
    (0, (-1,), (1,), r"size \[-1\].*must be non-negative"),
    (4, (4,), (-1,), r"stride \[-1\]\).*must be non-negative"),
    (0, (2, 2), (1,), r"one stride per dimension"),
    (12, (8,), (1,), r"reaches past its storage of 16 elements"),
    (0, (2 ** 62, 2 ** 62), (1, 1), r"reaches past its storage of 16 elements"),
    (0, ("4",), (1,), r"must be ints"),
    (0.5, (4,), (1,), r"must be ints"),
])
def test_hostile_torch_geometry(tmp_path, offset, size, stride, match):
    path = torch_file_with_pickle(tmp_path / "g.pt", {"t": _Rebuild(_StorageId("0", 16), offset, size, stride)})
    with pytest.raises(ImportSpecError, match=r"g.pt.*storage '0'.*" + match):
        resurgo.import_checkpoint(path, tmp_path / "out", source="torch")
    result = runner.invoke(app, ["import", str(path), str(tmp_path / "out"), "--from", "torch"])
    assert result.exit_code == 2 and "Traceback" not in result.output


@pytest.mark.parametrize("offsets", [[-8, 8], [8, 4], [-16, 0]])
def test_hostile_safetensors_data_offsets(tmp_path, offsets):
    (tmp_path / "m").mkdir()

    def edit(doc):
        doc["a"]["data_offsets"] = offsets

    safetensors_with_header(tmp_path / "m" / "model.safetensors", edit)
    with pytest.raises(ImportSpecError, match=rf"model.safetensors: tensor 'a' has data_offsets \[{offsets[0]}, "
                                              rf"{offsets[1]}\]; expected 0 <= begin <= end"):
        resurgo.import_checkpoint(tmp_path / "m", tmp_path / "out", source="hf")


def _set(path: str, value):
    """An edit of the metadata: the attribute at ``path`` (from the Metadata; 'b' and 'w' are items,
    '@b' the storage entry of item 'b') set to ``value``."""
    def edit(md):
        first, *rest = path.split(".")
        node = (md.storage_data[storage_entry(md, first[1:])] if first.startswith("@")
                else md.state_dict_metadata[first] if first in md.state_dict_metadata else getattr(md, first))
        for name in rest[:-1]:
            node = node[int(name)] if name.isdigit() else getattr(node, name)
        if rest:
            object.__setattr__(node, rest[-1], value)
        else:
            md.state_dict_metadata[first] = value
    return edit


@pytest.mark.parametrize("where,value,match", [
    ("w.chunks.0.offsets", "ab", r"item 'w': chunk 0 offsets is 'ab', expected a list"),
    ("w.chunks.0.sizes", None, r"item 'w': chunk 0 sizes is None"),
    ("w.chunks.0.sizes", torch.Size([2, -4]), r"item 'w': chunk 0 sizes is Size\(\(2, -4\)\)"),
    ("w.chunks.0.sizes", torch.Size([8]), r"item 'w': chunk 0 has offsets \[0, 0\] and sizes \[8\]"),
    ("w.chunks", {"a": 1}, r"item 'w': chunks is \{'a': 1\}, expected a list"),
    ("w.size", None, r"item 'w': size is None"),
    ("w.properties.dtype", "float32", r"item 'w': properties.dtype is not a torch dtype"),
    ("w", 5, r"item 'w': is a int, neither a tensor nor a bytes item"),
    ("@b.relative_path", 5, r"storage entry of 'b': relative_path: found a int, expected a relative path"),
    ("@b.offset", "x", r"storage entry of 'b': offset is 'x', expected a non-negative int"),
    ("@b.offset", -3, r"storage entry of 'b': offset is -3"),
    ("@b.length", -1, r"storage entry of 'b': length is -1"),
    ("@b.transform_descriptors", 7, r"storage entry of 'b': transform_descriptors is 7"),
])
def test_wrongly_typed_dcp_metadata(tmp_path, where, value, match):
    src = dcp_checkpoint(tmp_path / "src")
    edit_metadata(src, _set(where, value))
    with pytest.raises(ImportSpecError, match=r"\.metadata: " + match):
        resurgo.import_checkpoint(src, tmp_path / "out", source="dcp")
    result = runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--from", "dcp"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# 8. A data file swapped with a symlink while it is read: a resurgo error, never a raw OSError
# ------------------------------------------------------------------------------------------------
def test_a_path_that_cannot_be_resolved_is_a_storage_error(tmp_path, monkeypatch):
    """What os.path.realpath raises when a symlink on the way becomes a file between its lstat and
    its readlink (EINVAL) reaches the caller as StorageError."""
    resurgo.save({"x": torch.arange(4.0)}, tmp_path / "c")
    real = os.path.realpath

    def racing(path, *args, **kwargs):
        if "data" in os.fspath(path):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(local.os.path, "realpath", racing)
    with pytest.raises(StorageError, match="could not be resolved: Invalid argument; was the checkpoint changed while it was read"):
        resurgo.load_dict(tmp_path / "c")
    report = verify_checkpoint(tmp_path / "c")  # verify reports what it cannot read
    assert not report.ok and "could not be resolved" in " ".join(report.problems)


SWAPPER = """
import os, sys
target, link_to, spare = sys.argv[1:]
while True:  # the data file, in turns a symlink to a copy and the file itself (hard link), atomically
    os.symlink(link_to, target + ".l")
    os.replace(target + ".l", target)
    os.link(spare, target + ".f")
    os.replace(target + ".f", target)
"""


def test_loads_while_a_data_file_is_swapped_with_a_symlink(tmp_path):
    """A concurrent process swaps a data file with a symlink (to a copy of the same bytes, inside the
    checkpoint) as fast as it can; 200 load_dict and 50 verify calls, and 5,000 openings of the data
    file as both open it (each resolves its path, the step the swap can break: about 2 in 100 did
    raise a raw OSError before), each succeed or raise a ResurgoError."""
    resurgo.save({"x": torch.arange(64.0)}, tmp_path / "c")
    data = next((tmp_path / "c" / "data").iterdir())
    os.link(data, tmp_path / "c" / "data" / "copy.bin")
    os.link(data, tmp_path / "spare")
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(data), "copy.bin", str(tmp_path / "spare")])
    outcomes: dict[str, int] = {}
    rel = f"data/{data.name}"
    try:
        for _ in range(5000):  # until the swapper has started (at most 5 s)
            if data.is_symlink():
                break
            time.sleep(0.001)
        for i in range(5250):
            try:
                if i < 200:
                    resurgo.load_dict(tmp_path / "c")
                elif i < 250:
                    verify_checkpoint(tmp_path / "c")
                else:
                    open_checkpoint(tmp_path / "c").open_read(rel).close()
                outcome = "ok"
            except ResurgoError as e:
                outcome = type(e).__name__
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        swapper.kill()
        swapper.wait()
    assert sum(outcomes.values()) == 5250, outcomes


@pytest.mark.parametrize("shape", [["2", 3], [2, -3], [2.0, 3], 6, None])
def test_deepspeed_param_shapes_of_another_type_are_named(tmp_path, shape):
    """A ZeRO-2 checkpoint whose model states give a parameter a shape that is not a torch.Size of
    non-negative ints: CorruptCheckpointError naming the file, the group, the parameter and what was
    found (exit 3), nothing written."""
    from test_import_fuzz import _deepspeed_fixture

    src = tmp_path / "ds"
    _deepspeed_fixture(src)
    path = src / "global_step1" / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)  # our own file
    states["param_shapes"][0]["fc.weight"] = shape
    torch.save(states, path)
    with pytest.raises(resurgo.CorruptCheckpointError,
                       match=rf"mp_rank_00_model_states.pt: param_shapes group 0 gives 'fc.weight' the shape "
                             rf".*expected a torch.Size of non-negative ints"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="deepspeed")
    result = runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--from", "deepspeed"])
    assert result.exit_code == 3 and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_what_zipfile_raises_is_a_damaged_archive_and_a_resurgo_error_passes_as_raised():
    from resurgo.interop.torch_file import damaged_archive

    with pytest.raises(resurgo.CorruptCheckpointError) as info:
        with damaged_archive("m.pt: not a readable zip archive", "was it truncated?"):
            raise zipfile.BadZipFile("File is not a zip file")
    assert str(info.value) == "m.pt: not a readable zip archive (BadZipFile: File is not a zip file); was it truncated?"
    assert info.value.__suppress_context__
    with pytest.raises(resurgo.CorruptCheckpointError, match=r"^m.pt \(EOFError: x\); was it truncated or damaged\?$"):
        with damaged_archive("m.pt"):
            raise EOFError("x")
    refused = ImportSpecError("m.pt: member 'a/data.pkl' is compressed")  # a ValueError too, yet passes as raised
    for raised in (refused, KeyError("a/data/0")):  # a missing member is the caller's to name
        with pytest.raises(type(raised)) as passed:
            with damaged_archive("m.pt"):
                raise raised
        assert passed.value is raised



def test_a_stored_member_is_found_and_a_damaged_archive_is_named(tmp_path):
    """stored_member (one lookup for the spec executor and the Megatron bucket reader): where a
    member's bytes begin and how many there are; a missing member is the caller's KeyError; an
    archive zipfile cannot read, whatever zipfile raises (here its end record naming 2 disks),
    is CorruptCheckpointError."""
    from resurgo.interop.torch_file import stored_member

    torch.save({"t": torch.arange(6, dtype=torch.float32)}, tmp_path / "m.pt")
    with zipfile.ZipFile(tmp_path / "m.pt") as z:
        member = next(n for n in z.namelist() if n.endswith("/data/0"))
    with open(tmp_path / "m.pt", "rb") as f:
        start, size = stored_member(f, member, "m.pt")
        with pytest.raises(KeyError):
            stored_member(f, "m/data/9", "m.pt")
    assert size == 24
    assert (tmp_path / "m.pt").read_bytes()[start : start + size] == torch.arange(6, dtype=torch.float32).numpy().tobytes()
    raw = (tmp_path / "m.pt").read_bytes()
    (tmp_path / "m.pt").write_bytes(raw[:-22] + struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 2) + raw[-22:])
    with open(tmp_path / "m.pt", "rb") as f, pytest.raises(resurgo.CorruptCheckpointError,
                                                         match=r"^m.pt: not a readable zip archive \(BadZipFile"):
        stored_member(f, member, "m.pt")

def test_a_zip_end_record_naming_several_disks_is_a_damaged_file(tmp_path):
    """zipfile raises BadZipFile (not OSError) while merely asking whether a file is a zip whose
    zip64 locator names several disks: a damaged file (exit 3), for torch.save and DeepSpeed files alike."""
    from test_import_fuzz import _deepspeed_fixture

    def spanning(path: Path) -> None:
        raw = path.read_bytes()
        locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 2)  # the end record's zip64 locator: 2 disks
        path.write_bytes(raw[:-22] + locator + raw[-22:])

    torch.save({"t": torch.ones(2)}, tmp_path / "m.pt")
    spanning(tmp_path / "m.pt")
    with pytest.raises(resurgo.CorruptCheckpointError, match=r"m.pt: not a readable zip archive \(BadZipFile"):
        resurgo.import_checkpoint(tmp_path / "m.pt", tmp_path / "out", source="torch")
    _deepspeed_fixture(tmp_path / "ds")
    spanning(tmp_path / "ds" / "global_step1" / "mp_rank_00_model_states.pt")
    with pytest.raises(resurgo.CorruptCheckpointError, match="mp_rank_00_model_states.pt: not a readable torch.save"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "out", source="deepspeed")
    result = runner.invoke(app, ["import", str(tmp_path / "m.pt"), str(tmp_path / "out"), "--from", "torch"])
    assert result.exit_code == 3 and "Traceback" not in result.output
