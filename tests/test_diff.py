"""``resurgo diff``: checksums when the chunks match, bitwise reads when they do not, values by node."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.cli.render import human_bytes
from resurgo.diff import diff_checkpoints
from resurgo.format.tree import iter_values
from resurgo.errors import CorruptCheckpointError

from helpers import flip_stored_bit, resealed

runner = CliRunner()
BLOCK = 1024  # 1000 float32 = 4000 bytes: blocks 0-3, the last one short


def _state(w: torch.Tensor | None = None, **over) -> dict:
    state = {
        "model": {"w": torch.arange(1000, dtype=torch.float32) if w is None else w,
                  "b": torch.zeros(5), "gone": torch.ones(3)},
        "opt": {"state": {0: {"step": 3}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999)}]},
        "order": np.arange(4),
    }
    for key, value in over.items():
        state["model"][key] = value
    return state


def _save(path: Path, state: dict, **kw) -> Path:
    resurgo.save(state, path, block_bytes=BLOCK, **kw)
    return path


def test_identical_checkpoints_compare_by_checksums_and_read_nothing(tmp_path: Path):
    a = _save(tmp_path / "a", _state(), step=1)
    b = _save(tmp_path / "b", _state(), step=1)
    d = diff_checkpoints(a, b)
    assert d.identical and d.fields == [] and d.values == []
    assert (d.equal_by_checksums, d.equal_by_data, d.tensors_compared, d.bytes_read) == (4, 0, 4, 0)
    result = runner.invoke(app, ["diff", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "SAME 4 tensors equal (4 by checksums, 0 by reading); 0 B read" in result.stdout


def test_every_kind_of_difference_is_reported(tmp_path: Path):
    a = _save(tmp_path / "a", _state(), step=1, metadata={"run": "x", "lr": 0.1})
    w = torch.arange(1000, dtype=torch.float32)
    w[0] += 1.5  # block 0
    w[999] -= 0.25  # block 3
    state = _state(w)
    state["model"]["b"] = torch.zeros(5, dtype=torch.float64)
    state["model"]["new"] = torch.ones(2)
    del state["model"]["gone"]
    state["opt"]["state"][0]["step"] = 4
    state["opt"]["param_groups"][0]["betas"] = (0.9, 0.99)
    state["order"] = np.arange(5)
    b = _save(tmp_path / "b", state, step=2, metadata={"run": "x", "note": 1})
    d = diff_checkpoints(a, b)
    assert d.fields == [("step", 1, 2), ("metadata.lr", 0.1, None), ("metadata.note", None, 1)]
    got = {t.key: t for t in d.tensors}
    assert sorted(got) == ["model.b", "model.gone", "model.new", "model.w", "order"]
    assert (got["model.b"].change, got["model.b"].a, got["model.b"].b) == ("dtype", "float32 [5]", "float64 [5]")
    assert (got["model.gone"].change, got["model.new"].change) == ("only_a", "only_b")
    assert (got["order"].change, got["order"].b) == ("shape", "int64 [5] (numpy)")
    w_diff = got["model.w"]
    assert (w_diff.change, w_diff.compared_by, w_diff.blocks_differing, w_diff.blocks_total) == ("data", "checksums", 2, 4)
    assert w_diff.elements_differing is None and d.bytes_read == 0
    assert [(v.key, v.a["type"], v.b["type"]) for v in d.values] == [
        ("opt.param_groups.0.betas.1", "float", "float"), ("opt.state.0.step", "int", "int")]
    assert not d.identical

    stats = diff_checkpoints(a, b, stats=True)
    w_stats = {t.key: t for t in stats.tensors}["model.w"]
    assert (w_stats.compared_by, w_stats.elements_differing, w_stats.max_abs_diff) == ("data", 2, 1.5)
    assert (w_stats.blocks_differing, w_stats.blocks_total) == (2, 4)
    assert stats.bytes_read == 2 * 4000  # only the tensor that differs, from both sides

    result = runner.invoke(app, ["diff", str(a), str(b), "--stats"])
    assert result.exit_code == 1, result.output
    for text in ("step", "metadata.note", "only in A", "only in B", "dtype differs", "shape differs",
                 "2 of 4 checksum blocks differ, 2 elements differ, max |a-b| 1.5", "opt.state.0.step",
                 "0.999", "DIFFERENT 3 fields, 5 tensors, 2 values differ"):
        assert text in result.stdout, (text, result.stdout)
    doc = json.loads(runner.invoke(app, ["diff", str(a), str(b), "--json"]).stdout)
    assert doc["identical"] is False and doc["fields"][0] == {"field": "step", "a": 1, "b": 2}
    assert {t["key"]: t["blocks_differing"] for t in doc["tensors"]}["model.w"] == 2


def test_other_chunks_are_read_and_compared_bit_for_bit_in_windows(tmp_path: Path):
    w = torch.arange(1000, dtype=torch.float32)
    a = _save(tmp_path / "a", {"w": w})
    same = _save(tmp_path / "same", {"w": resurgo.FlatShard(w.clone(), (1000,), 0)})  # a flat chunk, not a box
    d = diff_checkpoints(a, same, buffer_bytes=1 << 20)
    assert d.identical and (d.equal_by_checksums, d.equal_by_data) == (0, 1) and d.bytes_read == 2 * 4000
    d = diff_checkpoints(a, same, buffer_bytes=64)  # 4 elements a window: 250 windows, each reading its block
    assert d.identical and d.equal_by_data == 1 and d.bytes_read == 500_864
    w2 = w.clone()
    w2[3], w2[500], w2[998] = -w2[3], w2[500] + 7, float("nan")
    other = _save(tmp_path / "other", {"w": resurgo.FlatShard(w2, (1000,), 0)})
    t = diff_checkpoints(a, other, buffer_bytes=64).tensors[0]
    assert (t.compared_by, t.elements_differing, t.blocks_differing) == ("data", 3, None)
    assert t.max_abs_diff != t.max_abs_diff  # a NaN against a number: NaN, not hidden
    t = diff_checkpoints(a, other, only="w", buffer_bytes=1 << 20).tensors[0]
    assert t.elements_differing == 3


def test_bitwise_zero_signs_and_nan_payloads(tmp_path: Path):
    x = torch.tensor([0.0, float("nan"), 1.0])
    a = _save(tmp_path / "a", {"x": resurgo.FlatShard(x, (3,), 0)})
    y = torch.tensor([-0.0, float("nan"), 1.0])
    b = _save(tmp_path / "b", {"x": y})
    t = diff_checkpoints(a, b).tensors[0]
    assert t.elements_differing == 1 and t.max_abs_diff == 0.0  # -0.0 is another bit pattern
    assert diff_checkpoints(a, _save(tmp_path / "c", {"x": x.clone()})).identical  # the same NaN is equal


def test_only_restricts_tensors_and_values_and_skips_fields(tmp_path: Path):
    a = _save(tmp_path / "a", _state(), step=1)
    state = _state()
    state["opt"]["state"][0]["step"] = 9
    b = _save(tmp_path / "b", state, step=2)
    d = diff_checkpoints(a, b, only="model.")
    assert d.identical and d.tensors_compared == 3
    d = diff_checkpoints(a, b, only="opt.")
    assert [v.key for v in d.values] == ["opt.state.0.step"] and d.fields == [] and d.tensors_compared == 0


def test_corrupt_data_read_for_a_comparison_is_an_error(tmp_path: Path):
    a = _save(tmp_path / "a", {"w": torch.arange(1000, dtype=torch.float32)})
    b = _save(tmp_path / "b", {"w": resurgo.FlatShard(torch.arange(1000, dtype=torch.float32), (1000,), 0)})
    flip_stored_bit(b, "w")
    with pytest.raises(CorruptCheckpointError):
        diff_checkpoints(a, b)
    result = runner.invoke(app, ["diff", str(a), str(b)])
    assert result.exit_code == 3 and "block 0 (file bytes 128..1152) does not match its xxh3-128 checksum" in result.stderr
    result = runner.invoke(app, ["diff", str(a), str(tmp_path / "missing")])
    assert result.exit_code == 4 and "no such checkpoint" in result.stderr


def test_value_keys_follow_tensor_keys():
    tree = {"type": "dict", "items": [
        ["opt", {"type": "dict", "items": [[{"type": "int", "value": 0}, {"type": "int", "value": 7}]]}],
        ["betas", {"type": "tuple", "items": [{"type": "float", "bits": "3feccccccccccccd"}]}],
        ["empty", {"type": "list", "items": []}],
        ["w", {"type": "tensor", "key": "w"}],
        ["rng", {"type": "per_rank", "items": [{"type": "int", "value": 1}, {"type": "int", "value": 2}]}],
        ["mod", {"type": "stateful", "class": "M", "state": {"type": "dict", "items": [["n", {"type": "none"}]]}}],
    ]}
    assert sorted(leaf.key for leaf in iter_values(tree)) == ["betas.0", "empty", "mod.n", "opt.0", "rng@rank0", "rng@rank1"]


def test_checkpoints_at_urls_compare_too(tmp_path: Path, mem_url: str):
    a = _save(tmp_path / "a", _state(), step=1)
    state = _state()
    state["model"]["b"] = torch.ones(5)
    resurgo.save(state, f"{mem_url}/b", block_bytes=BLOCK, step=1)
    d = diff_checkpoints(a, f"{mem_url}/b", stats=True)
    assert [(t.key, t.elements_differing, t.max_abs_diff) for t in d.tensors] == [("model.b", 5, 1.0)]
    assert d.fields == [] and d.values == [] and d.bytes_read == 2 * 20


# -- damage is never "the same" ----------------------------------------------------------------
def _pair(tmp_path: Path) -> tuple[Path, Path]:
    """Two saves of one layout: 'model.w' differs (by checksums), every other tensor is equal."""
    a = _save(tmp_path / "a", _state(), step=1)
    w = torch.arange(1000, dtype=torch.float32)
    w[0] = -1.0
    return a, _save(tmp_path / "b", _state(w), step=1)


def _file_of(path: Path, key: str) -> Path:
    return path / resurgo.read_manifest(path).tensors[key].chunks[0].file


def _exit_codes(a: Path, b: Path) -> dict[str, tuple[int, str]]:
    """The exit code and stderr of diff in each mode."""
    out = {}
    for mode in ("plain", "--stats", "--verify", "--stats --verify"):
        result = runner.invoke(app, ["diff", str(a), str(b)] + ([] if mode == "plain" else mode.split()))
        assert "Traceback" not in result.output
        out[mode] = (result.exit_code, result.stderr)
    return out


def test_undamaged_pair_differs_in_one_tensor_in_every_mode(tmp_path: Path):
    a, b = _pair(tmp_path)
    assert {m: code for m, (code, _) in _exit_codes(a, b).items()} == {
        "plain": 1, "--stats": 1, "--verify": 1, "--stats --verify": 1}
    assert [t.key for t in diff_checkpoints(a, b, verify=True).tensors] == ["model.w"]


@pytest.mark.parametrize("damage", ["truncated", "deleted", "grown"])
def test_a_missing_or_resized_data_file_is_damage_in_every_mode(tmp_path: Path, damage: str):
    """A data file's existence and size are checked in both checkpoints on every diff (no data read)."""
    a, b = _pair(tmp_path)
    for victim, key in ((b, "model.b"), (a, "model.w")):  # an equal tensor's file; the differing one's
        f = _file_of(victim, key)
        keep = f.read_bytes()
        if damage == "truncated":
            f.write_bytes(keep[:-3])
        elif damage == "grown":
            f.write_bytes(keep + b"\0")
        else:
            f.unlink()
        for mode, (code, err) in _exit_codes(a, b).items():
            assert code == 3, (damage, key, mode, err)
            assert str(victim) in err and f.name in err, (mode, err)
            assert ("is missing" if damage == "deleted" else "(truncated or altered)") in err, err
        with pytest.raises(CorruptCheckpointError, match=re.escape(f.name)):
            diff_checkpoints(a, b)
        f.write_bytes(keep)


def test_a_flipped_byte_is_damage_wherever_diff_reads(tmp_path: Path):
    """Data compared by checksums alone is not read; --verify reads every byte of both, --stats
    the tensors that differ, and what is read is verified."""
    a, b = _pair(tmp_path)
    flip_stored_bit(b, "model.b")  # in a tensor equal by checksums: only --verify reads it
    codes = _exit_codes(a, b)
    assert {m: c for m, (c, _) in codes.items()} == {"plain": 1, "--stats": 1, "--verify": 3, "--stats --verify": 3}
    assert f"{b}: does not verify: tensor 'model.b' chunk 0 in {_file_of(b, 'model.b').relative_to(b)}: block 0 " \
           "does not match its checksum" in codes["--verify"][1]
    with pytest.raises(CorruptCheckpointError, match=f"{re.escape(str(b))}: does not verify: tensor 'model.b'"):
        diff_checkpoints(a, b, verify=True)

    a, b = _pair(tmp_path / "again")
    flip_stored_bit(b, "model.w")  # in the tensor that differs: --stats reads and verifies it
    codes = _exit_codes(a, b)
    assert {m: c for m, (c, _) in codes.items()} == {"plain": 1, "--stats": 3, "--verify": 3, "--stats --verify": 3}
    assert f"{b}: tensor 'model.w' is corrupt in {_file_of(b, 'model.w').relative_to(b)}" in codes["--stats"][1]

    same = _save(tmp_path / "same", _state(), step=1)
    flip_stored_bit(same, "model.w")
    codes = _exit_codes(a, same)  # equal by checksums: without --verify diff trusts them (documented)
    assert (codes["plain"][0], codes["--stats"][0]) == (0, 0)
    assert codes["--verify"][0] == 3 and str(same) in codes["--verify"][1]


def test_verify_reads_every_byte_of_both(tmp_path: Path):
    a, b = _pair(tmp_path)
    d = diff_checkpoints(a, b, verify=True)
    tensor_bytes = resurgo.read_manifest(a).tensor_bytes + resurgo.read_manifest(b).tensor_bytes
    assert d.verified and d.bytes_verified == tensor_bytes and d.bytes_read == 0
    assert not diff_checkpoints(a, b).verified
    result = runner.invoke(app, ["diff", str(a), str(a), "--verify"])
    assert result.exit_code == 0 and f"both verified ({human_bytes(2 * resurgo.read_manifest(a).tensor_bytes)})" \
        in result.stdout, result.output


# -- what describes the save is not the state ----------------------------------------------------
def _edit_manifest(path: Path, old: bytes, new: bytes) -> None:
    raw = (path / "manifest.json").read_bytes()
    assert raw.count(old) == 1
    (path / "manifest.json").write_bytes(resealed(raw.replace(old, new)))


def test_save_info_creation_time_and_versions_are_compared_only_when_asked(tmp_path: Path):
    a = _save(tmp_path / "a", _state(), step=1, metadata={"run": "x"}, save_info={"save_cost_seconds": 0.5})
    b = _save(tmp_path / "b", _state(), step=1, metadata={"run": "x"}, save_info={"save_cost_seconds": 0.7, "host": "n2"})
    ma = resurgo.read_manifest(a)
    _edit_manifest(b, f'"created_at":"{resurgo.read_manifest(b).created_at}"'.encode(),
                   b'"created_at":"2001-01-01T00:00:00.000+00:00"')
    _edit_manifest(b, f'"torch":"{torch.__version__}"'.encode(), b'"torch":"9.9.9"')
    d = diff_checkpoints(a, b)
    assert d.identical and d.fields == []
    d = diff_checkpoints(a, b, include_save_info=True)
    assert not d.identical and d.fields == [
        ("created_at", ma.created_at, "2001-01-01T00:00:00.000+00:00"),
        ("library.torch", torch.__version__, "9.9.9"),
        ("save_info.host", None, "n2"),
        ("save_info.save_cost_seconds", 0.5, 0.7),
    ]
    assert runner.invoke(app, ["diff", str(a), str(b)]).exit_code == 0
    result = runner.invoke(app, ["diff", str(a), str(b), "--save-info"])
    assert result.exit_code == 1
    for text in ("created_at", "library.torch", "9.9.9", "save_info.save_cost_seconds", "0.7", "DIFFERENT 4 fields"):
        assert text in result.stdout, (text, result.stdout)
    c = _save(tmp_path / "c", _state(), step=1, metadata={"run": "y"})  # metadata describes the state
    assert diff_checkpoints(a, c).fields == [("metadata.run", "x", "y")]
