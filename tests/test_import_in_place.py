"""Import in place (format version 5): chunks point into the foreign files, no tensor byte copied.

What must hold: the result verifies, loads on another layout and converts; retention and gc
never touch the foreign files; a foreign file changed afterwards is corrupt, named; and a manifest
may not make a load read files it was not allowed to (outside the root, a root nobody allowed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import resurgo
from dist_harness import run_ranks
from typer.testing import CliRunner

from resurgo.cli import app
from resurgo.conversion import convert
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.errors import CorruptCheckpointError, ExternalFilesError, ManifestError
from resurgo.format import manifest as manifest_mod
from resurgo.format.manifest import seal
from resurgo.storage import external


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """This test's user key (the import writes it; loads check checkpoints against it)."""
    monkeypatch.setenv(external.KEY_ENV, str(tmp_path / "key" / "import.key"))
    monkeypatch.delenv(external.ROOTS_ENV, raising=False)


def dcp_source(path: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    import warnings

    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(40, 30), "b": torch.randn(7).to(torch.bfloat16)}, "step": 3,
             "ids": torch.arange(12, dtype=torch.int64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: DCP says so
        dcp.save(state, checkpoint_id=str(path))
    return {"w": state["model"]["w"], "model.b": state["model"]["b"], "ids": state["ids"]}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def imported(tmp_path: Path) -> tuple[Path, Path, dict, resurgo.reports.ImportReport]:
    src, dst = tmp_path / "src", tmp_path / "dst"
    expected = dcp_source(src)
    report = resurgo.import_checkpoint(src, dst, source="dcp", in_place=True)
    return src, dst, expected, report


def test_dcp_in_place_writes_no_tensor_bytes_loads_bit_for_bit_and_verifies(tmp_path):
    src, dst, expected, report = imported(tmp_path)
    tensor_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert report.in_place and report.copied == {} and report.in_place_bytes == tensor_bytes
    written = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    assert report.bytes_written == written and written < tensor_bytes // 2  # the manifest, an empty data file
    assert sum(p.stat().st_size for p in (dst / "data").iterdir()) < 200  # not one tensor byte in it
    m = json.loads((dst / "manifest.json").read_bytes())
    assert m["version"] == 5 and m["external"]["root"] == str(src.resolve())
    assert set(m["external"]["files"]) == {"__0_0.distcp"} and len(m["external"]["tag"]) == 64
    assert {c["file"] for c in m["tensors"]["model.w"]["chunks"]} == {"external:__0_0.distcp"}
    loaded = resurgo.load_dict(dst)
    assert bits(loaded["model.w"]) == bits(expected["w"]) and bits(loaded["model.b"]) == bits(expected["model.b"])
    assert bits(loaded["ids"]) == bits(expected["ids"]) and loaded["step"] == 3
    report_v = verify_checkpoint(dst)
    assert report_v.ok and report_v.bytes_checked == tensor_bytes
    result = CliRunner().invoke(app, ["verify", str(dst)])
    assert result.exit_code == 0, result.output
    shown = json.loads(CliRunner().invoke(app, ["inspect", str(dst), "--json"]).output)
    assert shown["external"] == {"root": str(src.resolve()), "files": {"__0_0.distcp": (src / "__0_0.distcp").stat().st_size},
                                 "tagged": True}


def test_loads_a_part_and_converts(tmp_path):
    src, dst, expected, _ = imported(tmp_path)
    w = expected["w"]
    rows = torch.empty(15, 30)  # rows 25..39: a read from the middle of the chunk in the foreign file
    resurgo.load({"model.w": resurgo.Shard(rows, tuple(w.shape), (25, 0))}, dst, strict=False)
    assert bits(rows) == bits(w[25:])
    out = tmp_path / "one.safetensors"
    convert(dst, out, to="safetensors")
    converted = load_file(str(out))
    assert bits(converted["model.w"]) == bits(w) and bits(converted["ids"]) == bits(expected["ids"])


def test_strided_tensor_is_copied_and_named_the_rest_in_place(tmp_path):
    src = tmp_path / "model.pt"
    a, t = torch.randn(6, 5), torch.randn(4, 9).t()  # t: a transposed view, strided in its storage
    torch.save({"a": a, "t": t}, src)
    report = resurgo.import_checkpoint(src, tmp_path / "dst", source="torch", in_place=True)
    assert list(report.copied) == ["t"] and "strided" in report.copied["t"]
    assert report.in_place_bytes == a.numel() * 4 and report.tensor_bytes == t.numel() * 4
    loaded = resurgo.load_dict(tmp_path / "dst")
    assert bits(loaded["a"]) == bits(a) and bits(loaded["t"]) == bits(t)


def test_hf_safetensors_in_place(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    w = {"embed.weight": torch.randn(50, 8), "head.bias": torch.randn(3).to(torch.float16)}
    save_file(w, str(src / "model.safetensors"))
    report = resurgo.import_checkpoint(src, tmp_path / "dst", source="hf", in_place=True)
    assert report.copied == {} and report.in_place_bytes == 50 * 8 * 4 + 3 * 2
    loaded = resurgo.load_dict(tmp_path / "dst")
    assert {k: bits(v) for k, v in loaded.items()} == {k: bits(v) for k, v in w.items()}


def test_a_foreign_file_changed_afterwards_is_corrupt_and_named(tmp_path):
    src, dst, expected, _ = imported(tmp_path)
    foreign = src / "__0_0.distcp"
    m = json.loads((dst / "manifest.json").read_bytes())
    start = m["tensors"]["model.w"]["chunks"][0]["byte_range"][0]
    data = bytearray(foreign.read_bytes())
    data[start + 5] ^= 0x01
    foreign.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"model.w.*foreign file {foreign.resolve()}"):
        resurgo.load_dict(dst)
    problems = verify_checkpoint(dst).problems
    assert len(problems) == 1 and str(foreign.resolve()) in problems[0]
    foreign.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(CorruptCheckpointError, match=f"foreign file {foreign.resolve()} has {len(data) - 10} bytes"):
        resurgo.load_dict(dst)
    foreign.unlink()
    with pytest.raises(CorruptCheckpointError, match=f"foreign file {foreign.resolve()}.*missing"):
        resurgo.load_dict(dst)


def test_retention_and_gc_never_touch_the_foreign_files(tmp_path):
    root = tmp_path / "run"
    src = root / "foreign_dcp"  # the source inside the manager's root, beside the checkpoints
    dcp_source(src)
    before = tree_bytes(src)
    resurgo.import_checkpoint(src, root / "step_000000003", source="dcp", in_place=True)  # the source's step is 3
    with resurgo.CheckpointManager(root, keep_last=1, async_save=False) as mgr:
        for step in (4, 5):
            mgr.save({"x": torch.full((4,), float(step))}, step)
    assert not (root / "step_000000003").exists()  # retention deleted the import, not its source
    assert tree_bytes(src) == before
    from resurgo.manager.gc import run_gc

    resurgo.import_checkpoint(src, root / "step_000000003", source="dcp", in_place=True)  # again, for gc
    run = run_gc(root, keep_last=1, stale_after=0.0)
    assert [item.entry.name for item in run.deleted] == ["step_000000003"] and not run.refused
    assert sorted(os.listdir(root)) == ["foreign_dcp", "step_000000005"]
    assert tree_bytes(src) == before and sorted(os.listdir(src)) == [".metadata", "__0_0.distcp"]


def _crafted(dst: Path, edit) -> None:
    """Rewrite ``dst``'s manifest through ``edit`` (of its parsed JSON), sealed again as a writer would."""
    doc = json.loads((dst / "manifest.json").read_bytes())
    doc.pop("manifest_checksum")
    edit(doc)
    (dst / "manifest.json").write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))


def test_a_crafted_manifest_reading_outside_its_root_is_refused(tmp_path, monkeypatch):
    src, dst, _, _ = imported(tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(300 * 200))

    def to_secret(doc: dict) -> None:  # the source root moved to '/', the file named from there
        rel = str(secret.resolve())[1:]
        doc["external"] = {"root": "/", "files": {rel: {"bytes": secret.stat().st_size}}}
        for c in doc["tensors"]["model.w"]["chunks"]:
            c["file"] = "external:" + rel
        for key in ("model.b", "ids"):
            doc["tensors"][key]["chunks"][0]["file"] = "external:" + rel

    _crafted(dst, to_secret)
    with pytest.raises(ExternalFilesError, match="carries no tag"):
        resurgo.load_dict(dst)
    assert not verify_checkpoint(dst).ok
    # a tag made with another user's key does not pass either
    _crafted(dst, lambda doc: doc["external"].__setitem__("tag", "ab" * 32))
    with pytest.raises(ExternalFilesError, match="does not match this user's key"):
        resurgo.load_dict(dst)
    # '..' never gets as far as a load: the manifest is refused
    _crafted(dst, lambda doc: doc["external"].__setitem__("files", {"a/../../x": {"bytes": 1}}))
    with pytest.raises(ManifestError, match="canonical form"):
        resurgo.load_dict(dst)


def test_a_symlink_out_of_the_root_is_refused_even_when_tagged(tmp_path):
    src, dst, _, _ = imported(tmp_path)
    outside = tmp_path / "outside.distcp"
    os.replace(src / "__0_0.distcp", outside)
    os.symlink(outside, src / "__0_0.distcp")
    with pytest.raises(ExternalFilesError, match="outside that root"):
        resurgo.load_dict(dst)


def test_a_checkpoint_from_elsewhere_loads_once_its_root_is_allowed(tmp_path, monkeypatch):
    src, dst, expected, _ = imported(tmp_path)
    monkeypatch.setenv(external.KEY_ENV, str(tmp_path / "another-user.key"))  # another user's key: not made here
    with pytest.raises(ExternalFilesError, match=external.ROOTS_ENV):
        resurgo.load_dict(dst)
    monkeypatch.setenv(external.ROOTS_ENV, str(tmp_path))
    assert bits(resurgo.load_dict(dst)["model.w"]) == bits(expected["w"])


def test_a_reader_of_versions_2_to_4_refuses_version_5(tmp_path, monkeypatch):
    _, dst, _, _ = imported(tmp_path)
    monkeypatch.setattr(manifest_mod, "READABLE_VERSIONS", (2, 3, 4))
    with pytest.raises(ManifestError, match="format version '5' is not supported"):
        resurgo.load_dict(dst)


def test_external_needs_version_5_and_version_5_needs_external(tmp_path):
    _, dst, _, _ = imported(tmp_path)
    _crafted(dst, lambda doc: doc.__setitem__("version", 3))
    with pytest.raises(ManifestError, match="'external' and format version 5 go together"):
        resurgo.load_dict(dst)


@pytest.mark.slow
def test_loads_on_two_ranks_by_rows(tmp_path):
    src, dst, expected, _ = imported(tmp_path)
    w = expected["w"]
    halves = run_ranks(2, "inplace_workers:load_rows", str(dst), "model.w", tuple(w.shape))
    assert halves[0] + halves[1] == bits(w)  # rows 0..19 and 20..39, each read from the foreign file


def test_a_save_with_an_import_in_place_as_base_writes_the_foreign_bytes(tmp_path):
    """An incremental save never references a foreign file: references stay inside the root."""
    src = tmp_path / "src"
    expected = dcp_source(src)
    root = tmp_path / "run"
    resurgo.import_checkpoint(src, root / "step_000000003", source="dcp", in_place=True)
    state = resurgo.load_dict(root / "step_000000003")
    resurgo.save(state, root / "step_000000004", base=root / "step_000000003")
    m = json.loads((root / "step_000000004" / "manifest.json").read_bytes())
    assert m["version"] == 2 and "external" not in m and "references" not in m
    (src / "__0_0.distcp").unlink()  # the new checkpoint does not need the source
    assert bits(resurgo.load_dict(root / "step_000000004")["model.w"]) == bits(expected["w"])


def test_replicas_compared_are_referenced_averaged_ones_copied(tmp_path):
    from resurgo.interop import spec as spec_lang

    a, b = torch.arange(6, dtype=torch.float32), torch.arange(6, dtype=torch.float32) + 2
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.bin").write_bytes(bits(a) + bits(a) + bits(b))
    piece = {"file": "x.bin", "shape": [6], "flat": {"start": 0, "stop": 6}}
    doc = {"format": "resurgo.import-spec", "version": 1, "values": {}, "tensors": [
        {"key": "same", "dtype": "float32", "shape": [6], "pieces": [{**piece, "replicas": [{"file": "x.bin", "offset": 24}]}]},
        {"key": "mean", "dtype": "float32", "shape": [6],
         "pieces": [{**piece, "offset": 24, "replicas": [{"file": "x.bin", "offset": 48}], "combine": "mean"}]}]}
    report = resurgo.import_checkpoint(tmp_path / "src", tmp_path / "dst", source="spec",
                                       spec=spec_lang.loads(json.dumps(doc)), in_place=True)
    assert list(report.copied) == ["mean"] and "averaged" in report.copied["mean"] and report.in_place_bytes == 24
    loaded = resurgo.load_dict(tmp_path / "dst")
    assert bits(loaded["same"]) == bits(a) and bits(loaded["mean"]) == bits(a + 1)


def test_a_copy_by_resurgo_holds_the_foreign_bytes_and_loads_without_them(tmp_path):
    """A tier copy (pipeline.copy) of an import in place is self-contained: each foreign file's
    chunks become a data file of the copy, a valid safetensors file, with the same checksums."""
    from resurgo.pipeline.copy import copy_checkpoint
    from resurgo.pipeline.verify import verify_checkpoint

    src, dst, expected, _ = imported(tmp_path)
    source_files = tree_bytes(src)
    copy_checkpoint(dst, tmp_path / "copy")
    assert tree_bytes(src) == source_files  # the foreign files are only read
    m = json.loads((tmp_path / "copy" / "manifest.json").read_bytes())
    assert m["version"] == 2 and "external" not in m
    made = [name for name in m["files"] if name.startswith("data/rank1")]
    assert made == ["data/rank100000-000.safetensors"]  # one foreign file, one data file
    declared = load_file(tmp_path / "copy" / made[0])
    assert {k: bits(v) for k, v in declared.items()} == {"model.w#0": bits(expected["w"]),
                                                          "model.b#0": bits(expected["model.b"]),
                                                          "ids#0": bits(expected["ids"])}
    (src / "__0_0.distcp").rename(tmp_path / "moved.distcp")  # the source is gone
    assert verify_checkpoint(tmp_path / "copy").problems == []
    loaded = resurgo.load_dict(tmp_path / "copy")
    assert bits(loaded["model.w"]) == bits(expected["w"]) and bits(loaded["model.b"]) == bits(expected["model.b"])
    assert bits(loaded["ids"]) == bits(expected["ids"]) and loaded["step"] == 3
    with pytest.raises(CorruptCheckpointError, match="moved or deleted"):
        resurgo.load_dict(dst)  # the import itself still reads the source
