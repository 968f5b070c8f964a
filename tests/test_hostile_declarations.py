"""A checkpoint crafted so that its data files or its manifest JSON say two things at once: a data
file's safetensors header declaring another dtype or shape than the manifest (resurgo and a plain
safetensors reader would return different tensors), and a manifest or rank index naming a member
twice (readers keeping the first or the last would disagree). ``verify`` and the CLI report the
first, naming the file, the tensor and both declarations; the parsers refuse the second."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
import xxhash
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.errors import ManifestError
from resurgo.format.manifest import parse_manifest
from resurgo.format.safetensors_file import read_header
from resurgo.pipeline.verify import verify_checkpoint

from helpers import resealed

runner = CliRunner()


def _rewrite_header(ckpt: Path, edit) -> str:
    """Apply ``edit`` to the header JSON of the checkpoint's one data file, keeping its length (space
    padding), and record the new header's checksum in a resealed manifest, as a forger would."""
    (data,) = sorted((ckpt / "data").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    assert len(body) <= n
    raw[8:8 + n] = body + b" " * (n - len(body))
    data.write_bytes(bytes(raw))
    rel = f"data/{data.name}"
    manifest = json.loads((ckpt / "manifest.json").read_bytes())
    manifest["files"][rel]["header_checksum"] = xxhash.xxh3_128_hexdigest(bytes(raw[:8 + n]))
    (ckpt / "manifest.json").write_bytes(resealed(json.dumps(manifest, separators=(",", ":")).encode()))
    return rel


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    state = {"w": torch.arange(1, 7, dtype=torch.float32).reshape(2, 3), "bf": torch.ones(4, dtype=torch.bfloat16)}
    resurgo.save(state, tmp_path / "ck")
    assert verify_checkpoint(tmp_path / "ck").ok
    return tmp_path / "ck"


def test_a_header_declaring_another_dtype_is_reported_naming_file_tensor_and_both_declarations(saved: Path):
    rel = _rewrite_header(saved, lambda doc: doc["w"].update(dtype="I32"))
    # The forgery: both readers accept the file, and see different tensors.
    assert resurgo.load_dict(saved)["w"].tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert safetensors.torch.load_file(saved / rel)["w"].tolist()[0][0] == 1065353216
    report = verify_checkpoint(saved)
    assert not report.ok
    (problem,) = report.problems
    assert rel in problem and "'w'" in problem and "I32" in problem and "float32 (F32)" in problem
    result = runner.invoke(app, ["verify", str(saved)])
    assert result.exit_code == 3, result.output
    assert "I32" in result.output and "CORRUPT" in result.output


def test_a_header_declaring_another_shape_is_reported(saved: Path):
    rel = _rewrite_header(saved, lambda doc: doc["w"].update(shape=[3, 2]))
    (problem,) = verify_checkpoint(saved).problems
    assert rel in problem and "'w'" in problem and "[3, 2]" in problem and "[2, 3]" in problem


def test_a_dtype_safetensors_lacks_must_stay_declared_as_its_raw_bytes(saved: Path):
    """bfloat16 has a safetensors code; declaring its 8 bytes as U8 [8] is the raw form of a dtype
    safetensors lacks, not of this one: refused. Declaring it BF16 [2, 2] is another shape."""
    _rewrite_header(saved, lambda doc: doc["bf"].update(dtype="U8", shape=[8]))
    (problem,) = verify_checkpoint(saved).problems
    assert "'bf'" in problem and "U8" in problem and "BF16" in problem


def test_raw_byte_declarations_of_dtypes_safetensors_lacks_verify(tmp_path: Path):
    state = {"f8": torch.zeros(6, dtype=torch.uint8).view(torch.float8_e8m0fnu), "b": torch.zeros(3, dtype=torch.bool)}
    resurgo.save(state, tmp_path / "ck")
    assert verify_checkpoint(tmp_path / "ck").ok
    _rewrite_header(tmp_path / "ck", lambda doc: doc["f8"].update(shape=[2, 3]))
    (problem,) = verify_checkpoint(tmp_path / "ck").problems
    assert "'f8'" in problem and "raw bytes of float8_e8m0fnu (U8) shape [6]" in problem


def test_a_header_entry_that_is_not_an_object_is_reported(saved: Path):
    def edit(doc):
        doc["w"] = {"data_offsets": doc["w"]["data_offsets"], "dtype": ["F32"], "shape": [2, 3]}
    _rewrite_header(saved, edit)
    (problem,) = verify_checkpoint(saved).problems
    assert "'w'" in problem and "['F32']" in problem


def test_a_manifest_naming_a_member_twice_is_refused(saved: Path):
    raw = (saved / "manifest.json").read_bytes()
    assert b'"step"' not in raw  # saved without a step
    forged = resealed(b'{"step":1,"step":2,' + raw[1:])  # json.loads alone reads step 2
    with pytest.raises(ManifestError, match="'step' appears twice"):
        parse_manifest(forged, "m.json")
    nested = resealed(raw.replace(b'"dtype":"float32"', b'"dtype":"float64","dtype":"float32"', 1))
    assert nested != raw
    (saved / "manifest.json").write_bytes(nested)
    with pytest.raises(ManifestError, match=r"manifest.json: the key 'dtype' appears twice"):
        resurgo.load_dict(saved)
    result = runner.invoke(app, ["verify", str(saved)])
    assert result.exit_code == 3 and "appears twice" in result.output


def test_a_safetensors_header_naming_a_tensor_twice_is_not_valid():
    body = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    with pytest.raises(ValueError, match="'a' appears twice"):
        read_header(struct.pack("<Q", len(body)), lambda n: body[:n])
