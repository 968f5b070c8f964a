"""The command line: inspect, verify and ls, through typer's CliRunner (and once the installed script)."""

from __future__ import annotations

import datetime
import errno
import json
import os
import pickle
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.cli.render import human_bytes
from helpers import flip_stored_bit, sealed_manifest

runner = CliRunner()


def _state() -> dict:
    return {
        "model": {"weight": torch.zeros(3, 4), "bias": torch.ones(3, dtype=torch.bfloat16)},
        "opt": {"lr": 0.5, "betas": (0.9, 0.999), "name": "adam", "groups": []},
        "np": np.arange(4, dtype=np.int64).reshape(2, 2),
        "step": 7,
    }


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    resurgo.save(_state(), path, step=7, metadata={"run": "r1", "lr": 0.5})
    return path


def _data_files(path: Path) -> list[Path]:
    return sorted((path / "data").iterdir())


def _no_traceback(result) -> None:
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


# -- inspect ----------------------------------------------------------------------------------
def test_inspect_json_exact(saved: Path):
    result = runner.invoke(app, ["inspect", str(saved), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["tensors"] == {
        "model.weight": {"kind": "torch", "dtype": "float32", "shape": [3, 4], "bytes": 48, "num_chunks": 1},
        "model.bias": {"kind": "torch", "dtype": "bfloat16", "shape": [3], "bytes": 6, "num_chunks": 1},
        "np": {"kind": "numpy", "dtype": "int64", "shape": [2, 2], "bytes": 32, "num_chunks": 1},
    }
    assert doc["values"] == {
        "opt.lr": {"type": "float", "value": "0.5"},
        "opt.betas": {"type": "tuple", "value": "(0.9, 0.999)"},
        "opt.name": {"type": "str", "value": "'adam'"},
        "opt.groups": {"type": "list", "value": "[]"},
        "step": {"type": "int", "value": "7"},
    }
    files = _data_files(saved)
    data_bytes = sum(f.stat().st_size for f in files)
    manifest_bytes = (saved / "manifest.json").stat().st_size
    assert doc["totals"] == {
        "tensors": 3, "tensor_bytes": 86, "chunks": 3, "data_files": len(files), "data_bytes": data_bytes,
        "manifest_bytes": manifest_bytes, "bytes_on_disk": data_bytes + manifest_bytes,
        "owned_tensor_bytes": 86, "referenced_tensor_bytes": 0,
    }
    assert doc["references"] == {}
    assert doc["step"] == 7
    assert doc["metadata"] == {"run": "r1", "lr": 0.5}
    assert doc["library"]["resurgo"] == resurgo.__version__
    assert doc["library"]["torch"] == torch.__version__
    assert doc["world"] == {"size": 1}
    assert doc["pickled"] is False
    assert doc["warnings"] == []
    assert doc["created_at"] == resurgo.read_manifest(saved).created_at


def test_inspect_text(saved: Path):
    result = runner.invoke(app, ["inspect", str(saved)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert re.search(r"^\s*model\.weight\s+torch\s+float32\s+\[3, 4\]\s+48 B\s+1\s*$", out, re.M), out
    assert re.search(r"^\s*model\.bias\s+torch\s+bfloat16\s+\[3\]\s+6 B\s+1\s*$", out, re.M), out
    assert re.search(r"^\s*np\s+numpy\s+int64\s+\[2, 2\]\s+32 B\s+1\s*$", out, re.M), out
    assert re.search(r"^\s*step\s+7\s*$", out, re.M)
    assert re.search(r"^\s*opt\.betas\s+tuple\s+\(0\.9, 0\.999\)\s*$", out, re.M)
    assert re.search(r"^\s*opt\.name\s+str\s+'adam'\s*$", out, re.M)
    assert re.search(r"^\s*tensors\s+3\s+86 B in 3 chunks\s*$", out, re.M)
    on_disk = sum(f.stat().st_size for f in _data_files(saved)) + (saved / "manifest.json").stat().st_size
    assert re.search(rf"^\s*on disk\s+2\s+{re.escape(human_bytes(on_disk))} \({on_disk} bytes\)\s*$", out, re.M)
    assert '{"run": "r1", "lr": 0.5}' in out
    assert f"torch {torch.__version__}" in out
    assert "Chunks" not in out


def test_inspect_shows_save_info(tmp_path: Path):
    resurgo.save(_state(), tmp_path / "c", save_info={"save_cost_seconds": 1.25, "host": "n7"})
    doc = json.loads(runner.invoke(app, ["inspect", str(tmp_path / "c"), "--json"]).stdout)
    assert doc["save_info"] == {"save_cost_seconds": 1.25, "host": "n7"} and doc["metadata"] == {}
    out = runner.invoke(app, ["inspect", str(tmp_path / "c")]).stdout
    assert re.search(r'^\s*save info\s+\{"save_cost_seconds": 1.25, "host": "n7"\}\s*$', out, re.M), out
    assert re.search(r"^\s*metadata\s+-\s*$", out, re.M), out


def test_inspect_chunks(saved: Path):
    c = resurgo.read_manifest(saved).tensors["model.weight"].chunks[0]
    result = runner.invoke(app, ["inspect", str(saved), "--chunks"])
    assert result.exit_code == 0, result.output
    line = rf"^\s*model\.weight\s+0\s+\[0:3, 0:4\]\s+{re.escape(c.file)}\s+\[{c.byte_range[0]}, {c.byte_range[1]}\)\s*$"
    assert re.search(line, result.stdout, re.M), result.stdout
    doc = json.loads(runner.invoke(app, ["inspect", str(saved), "--chunks", "--json"]).stdout)
    assert doc["tensors"]["model.weight"]["chunks"] == [
        {"box": {"offsets": [0, 0], "shape": [3, 4]}, "file": c.file, "byte_range": list(c.byte_range)}
    ]


def test_inspect_never_unpickles(tmp_path: Path, monkeypatch):
    path = tmp_path / "p"
    resurgo.save({"when": datetime.date(2020, 1, 2), "x": torch.zeros(2)}, path, allow_pickle=True)

    def boom(*a, **k):
        raise AssertionError("inspect must not unpickle")

    monkeypatch.setattr(pickle, "loads", boom)
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["values"] == {"when": {"type": "pickle", "value": "<pickled datetime.date>"}}
    assert doc["pickled"] is True


def test_inspect_errors_exit_4(tmp_path: Path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "missing")])
    assert result.exit_code == 4
    assert "no such checkpoint" in result.stderr
    _no_traceback(result)


# -- verify -----------------------------------------------------------------------------------
def test_verify_clean(saved: Path):
    result = runner.invoke(app, ["verify", str(saved)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("OK ")
    assert "3 chunks in 1 file, 86 B checked" in result.stdout
    result = runner.invoke(app, ["verify", str(saved), "--progress"])  # the bar renders off a terminal too
    assert result.exit_code == 0, result.output


def test_verify_flipped_byte(saved: Path):
    name = flip_stored_bit(saved, "model.weight")
    result = runner.invoke(app, ["verify", str(saved)])
    assert result.exit_code == 3, result.output
    assert f"tensor 'model.weight' chunk 0 in {name}: block 0 does not match its checksum" in result.stdout
    assert "CORRUPT" in result.stdout and "1 problem" in result.stdout
    doc = json.loads(runner.invoke(app, ["verify", str(saved), "--json"]).stdout)
    assert doc["ok"] is False and doc["chunks_checked"] == 3 and len(doc["problems"]) == 1


def test_verify_a_manifest_that_fails_its_own_checksum_is_corrupt(saved: Path):
    manifest = saved / "manifest.json"
    raw = manifest.read_bytes()
    at = raw.index(b'"step":') + len(b'"step":')
    manifest.write_bytes(raw[:at] + (b"8" if raw[at:at + 1] != b"8" else b"9") + raw[at + 1:])  # one digit
    result = runner.invoke(app, ["verify", str(saved)])
    assert result.exit_code == 3, result.output
    assert "manifest.json: the manifest's bytes do not match its manifest_checksum" in result.stdout
    assert "CORRUPT" in result.stdout and "1 problem (0 chunks in 0 files" in result.stdout
    result = runner.invoke(app, ["verify", str(saved), "--json"])
    assert result.exit_code == 3
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["chunks_checked"] == 0 and doc["data_files"] is None
    assert len(doc["problems"]) == 1 and "manifest_checksum" in doc["problems"][0]


def test_verify_a_manifest_that_is_not_json_is_damaged(saved: Path):
    (saved / "manifest.json").write_text("{truncated")
    result = runner.invoke(app, ["verify", str(saved)])
    assert result.exit_code == 3, result.output
    assert "not valid JSON" in result.stdout and "CORRUPT" in result.stdout


@pytest.mark.parametrize("case", ["missing", "no_manifest", "data_without_manifest"])
def test_verify_unreadable_exit_4(tmp_path: Path, saved: Path, case: str):
    expected = {
        "missing": "no such checkpoint",
        "no_manifest": "not a resurgo checkpoint (no manifest.json)",
        "data_without_manifest": "has data files but no manifest.json",
    }[case]
    path = tmp_path / case
    if case == "no_manifest":
        path.mkdir()
    elif case == "data_without_manifest":
        (path / "data").mkdir(parents=True)
    result = runner.invoke(app, ["verify", str(path)])
    assert result.exit_code == 4, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    _no_traceback(result)


# -- ls ---------------------------------------------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    state = {"w": torch.arange(64, dtype=torch.float32), "i": 1}
    resurgo.save(state, root / "a" / "step-1", step=1)
    resurgo.save(state, root / "a" / "step-2", step=2)  # truncated below: corrupt
    resurgo.save(state, root / "a" / "step-3", step=3)  # invalid manifest: corrupt
    resurgo.save(state, root / "a" / "step-6", step=6)  # valid JSON, unsupported version: corrupt
    resurgo.save(state, root / "b" / "deep" / "step-9", step=9)
    f = _data_files(root / "a" / "step-2")[0]
    os.truncate(f, f.stat().st_size - 4)
    (root / "a" / "step-3" / "manifest.json").write_text('{"step": 3, "format": ')
    m6 = root / "a" / "step-6" / "manifest.json"
    m6.write_bytes(sealed_manifest({**json.loads(m6.read_text()), "version": 99}))
    (root / "a" / "step-4" / "data").mkdir(parents=True)  # never committed
    (root / "a" / "step-4" / "data" / "rank00000-000.safetensors").write_bytes(b"\0" * 100)
    (root / "a" / ".step-5.resurgo-tmp-0123456789ab" / "data").mkdir(parents=True)  # crashed save
    (root / "logs").mkdir()  # not a checkpoint: not listed
    (root / "logs" / "train.log").write_text("hello")
    return root


EXPECTED_LS = [
    ("a/.step-5.resurgo-tmp-0123456789ab", "temporary", None),
    ("a/step-1", "committed", 1),
    ("a/step-2", "corrupt", 2),
    ("a/step-3", "corrupt", None),  # the step is unknown: the manifest is not JSON
    ("a/step-4", "incomplete", None),
    ("a/step-6", "corrupt", 6),  # the step is read from the manifest that does not validate
    ("b/deep/step-9", "committed", 9),
]


def test_ls_json(tree: Path):
    result = runner.invoke(app, ["ls", str(tree), "--json"])
    assert result.exit_code == 3, result.output  # the tree holds damaged checkpoints
    doc = json.loads(result.stdout)
    rows = doc["checkpoints"]
    assert [(r["path"], r["status"], r["step"]) for r in rows] == EXPECTED_LS
    by_path = {r["path"]: r for r in rows}
    one = tree / "a" / "step-1"
    assert by_path["a/step-1"]["bytes"] == sum(f.stat().st_size for f in one.rglob("*") if f.is_file())
    assert by_path["a/step-1"]["created_at"] == resurgo.read_manifest(one).created_at
    assert by_path["a/step-1"]["detail"] == ""
    assert "bytes on disk, the manifest says" in by_path["a/step-2"]["detail"]
    assert "not valid JSON" in by_path["a/step-3"]["detail"]
    assert "no manifest.json" in by_path["a/step-4"]["detail"]
    assert "format version '99' is not supported" in by_path["a/step-6"]["detail"]
    assert by_path["a/step-4"]["bytes"] == 100


def test_ls_text(tree: Path):
    result = runner.invoke(app, ["ls", str(tree)])
    assert result.exit_code == 3, result.output  # the tree holds damaged checkpoints
    lines = [ln for ln in result.stdout.splitlines() if ln.strip()]
    rows = [ln for ln in lines if re.match(r"^\s*[ab]/", ln)]
    assert [r.split()[0] for r in rows] == [p for p, _, _ in EXPECTED_LS]  # sorted by path
    for row, (_, status, step) in zip(rows, EXPECTED_LS):
        assert re.search(rf"\s{'-' if step is None else step}\s.*\s{status}(\s|$)", row), row
    assert "logs" not in result.stdout and "data" not in [r.split()[0] for r in rows]


def test_ls_verify_finds_flipped_byte(tree: Path):
    flip_stored_bit(tree / "b" / "deep" / "step-9", "w")
    plain = json.loads(runner.invoke(app, ["ls", str(tree), "--json"]).stdout)["checkpoints"]
    assert {r["path"]: r["status"] for r in plain}["b/deep/step-9"] == "committed"  # ls reads no data
    result = runner.invoke(app, ["ls", str(tree), "--json", "--verify"])
    assert result.exit_code == 3, result.output  # damage found
    rows = {r["path"]: r for r in json.loads(result.stdout)["checkpoints"]}
    assert rows["b/deep/step-9"]["status"] == "corrupt"
    assert "tensor 'w'" in rows["b/deep/step-9"]["detail"]
    assert rows["a/step-1"]["status"] == "committed" and rows["a/step-1"]["verified"] is True


def test_ls_on_a_checkpoint_and_missing_dir(saved: Path, tmp_path: Path):
    doc = json.loads(runner.invoke(app, ["ls", str(saved), "--json"]).stdout)
    assert [(r["path"], r["status"], r["step"]) for r in doc["checkpoints"]] == [(".", "committed", 7)]
    result = runner.invoke(app, ["ls", str(tmp_path / "nope")])
    assert result.exit_code == 4 and "no such directory" in result.stderr
    _no_traceback(result)


# -- entry points -----------------------------------------------------------------------------
def test_python_dash_m(saved: Path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["resurgo", "verify", str(saved)])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("resurgo", run_name="__main__")
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("OK ")


def test_installed_script_end_to_end(tree: Path):
    script = Path(sys.executable).parent / "resurgo"
    if not script.exists():
        pytest.skip("the resurgo script is not installed in this environment (pip install -e .)")
    proc = subprocess.run([str(script), "ls", str(tree), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr  # the tree holds damaged checkpoints
    rows = json.loads(proc.stdout)["checkpoints"]
    assert [(r["path"], r["status"], r["step"]) for r in rows] == EXPECTED_LS


def test_inspect_shows_per_rank_values_under_their_rank(tmp_path: Path):
    path = tmp_path / "pr"
    resurgo.save({"seen": resurgo.PerRank(5), "rng": resurgo.PerRank(torch.arange(3))}, path)
    result = runner.invoke(app, ["inspect", str(path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["values"]["seen@rank0"] == {"type": "int", "value": "5"}
    assert doc["tensors"]["rng@rank0"]["shape"] == [3]


# -- exit codes: one table for every command --------------------------------------------------
def _checkpoint_for(case: str, tmp_path: Path) -> Path:
    """A path in the state ``case`` names (the checkpoint a command is pointed at)."""
    path = tmp_path / "root" / "step_000000001"  # also a manager root's checkpoint, for ls and gc
    if case == "missing":
        return path
    if case == "not_a_checkpoint":
        path.mkdir(parents=True)
        (path / "notes.txt").write_text("not a checkpoint")
        return path
    if case == "incomplete":
        (path / "data").mkdir(parents=True)
        (path / "data" / "rank00000-000.safetensors").write_bytes(b"\0" * 64)
        return path
    resurgo.save({"w": torch.arange(300, dtype=torch.float32)}, path, step=1)
    if case == "edited_manifest":  # one digit of the step changed: the manifest no longer matches its seal
        raw = (path / "manifest.json").read_bytes()
        (path / "manifest.json").write_bytes(raw.replace(b'"step":1', b'"step":2', 1))
    elif case == "flipped_byte":
        flip_stored_bit(path, "w")
    return path


def _argv(command: str, case: str, path: Path, tmp_path: Path) -> list[str]:
    root = path.parent
    if command == "diff":  # the other side holds the tensor in another layout: diff reads and verifies data
        other = tmp_path / "other"
        resurgo.save({"w": resurgo.FlatShard(torch.arange(300, dtype=torch.float32), (300,), 0)}, other, step=1)
        return ["diff", str(other), str(path)]
    if command == "convert":
        out = tmp_path / "out.safetensors"
        if case == "refused_exists":
            out.write_bytes(b"someone's file")
        return ["convert", str(path), str(out), "--to", "safetensors"]
    if command == "ls":
        return ["ls", str(root)]
    if command == "ls --verify":
        return ["ls", str(root), "--verify"]
    if command == "gc":
        return ["gc", str(root), "--keep-last", "1"]
    if command == "bench":
        return ["bench", str(root), "--size", "4KiB", "--tensors", "1", "--repeats", "1", "--no-reference"]
    if command == "study":
        return ["study", "--quick", "--data", str(root), "--out", str(tmp_path / "study")]
    return [command, str(path)]


# (command, condition) -> exit code. Conditions a command does not meet (inspect reads no data,
# ls and gc list what they find) are left out where they have no meaning, kept where the answer
# is part of the contract (an incomplete save is listed by ls, kept by a young gc: 0).
EXIT_TABLE = {
    ("inspect", "missing"): 4, ("inspect", "not_a_checkpoint"): 4, ("inspect", "incomplete"): 4,
    ("inspect", "edited_manifest"): 3, ("inspect", "bad_option"): 2,
    ("verify", "missing"): 4, ("verify", "not_a_checkpoint"): 4, ("verify", "incomplete"): 4,
    ("verify", "edited_manifest"): 3, ("verify", "flipped_byte"): 3, ("verify", "bad_option"): 2,
    ("diff", "missing"): 4, ("diff", "not_a_checkpoint"): 4, ("diff", "incomplete"): 4,
    ("diff", "edited_manifest"): 3, ("diff", "flipped_byte"): 3, ("diff", "bad_option"): 2,
    ("ls", "missing"): 4, ("ls", "not_a_checkpoint"): 0, ("ls", "incomplete"): 0,
    ("ls", "edited_manifest"): 3, ("ls", "flipped_byte"): 0, ("ls --verify", "flipped_byte"): 3,
    ("ls", "bad_option"): 2,
    ("gc", "missing"): 4, ("gc", "not_a_checkpoint"): 0, ("gc", "incomplete"): 0,
    ("gc", "edited_manifest"): 3, ("gc", "bad_option"): 2,
    ("convert", "missing"): 4, ("convert", "not_a_checkpoint"): 4, ("convert", "incomplete"): 4,
    ("convert", "edited_manifest"): 3, ("convert", "flipped_byte"): 3, ("convert", "refused_exists"): 2,
    ("convert", "bad_option"): 2,
    ("bench", "missing"): 4, ("bench", "bad_option"): 2,
    ("study", "missing"): 4, ("study", "bad_option"): 2,
}


@pytest.mark.parametrize(("command", "case"), sorted(EXIT_TABLE))
def test_exit_codes(tmp_path: Path, command: str, case: str):
    path = _checkpoint_for("flipped_byte" if case == "refused_exists" else case, tmp_path)
    argv = _argv(command, case, path, tmp_path)
    if case == "bad_option":
        argv = argv + ["--no-such-option"]
    result = runner.invoke(app, argv)
    assert result.exit_code == EXIT_TABLE[command, case], result.output
    _no_traceback(result)
    if result.exit_code in (2, 4) and case != "bad_option":
        assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    if case == "edited_manifest" and command in ("inspect", "diff", "convert"):
        assert "manifest_checksum" in result.stderr  # the message says what is wrong
    if case in ("missing", "edited_manifest", "flipped_byte") and command == "convert":
        assert not (tmp_path / "out.safetensors").exists()  # nothing written
    if case == "refused_exists":
        assert (tmp_path / "out.safetensors").read_bytes() == b"someone's file"


def test_ls_reports_an_edited_manifest_as_damaged(saved: Path):
    raw = (saved / "manifest.json").read_bytes()
    (saved / "manifest.json").write_bytes(raw.replace(b'"step":7', b'"step":8', 1))
    for extra in ([], ["--verify"]):
        result = runner.invoke(app, ["ls", str(saved.parent), "--json", *extra])
        assert result.exit_code == 3, result.output
        (row,) = json.loads(result.stdout)["checkpoints"]
        assert row["status"] == "corrupt" and "manifest_checksum" in row["detail"]


# -- small things of the command line ---------------------------------------------------------
def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"resurgo {resurgo.__version__}\n"


@pytest.mark.parametrize("command", [[], ["inspect"], ["verify"], ["diff"], ["ls"], ["gc"], ["convert"], ["bench"],
                                     ["study"]])
def test_help_has_no_type_tags(command: list[str]):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert not re.search(r"<(bool|str|int|float|path|int range|float range)>", result.stdout), result.stdout
    assert "Usage: resurgo" in result.stdout


def test_the_command_line_imports_no_torch_until_a_command_needs_it():
    code = ("import sys, resurgo.cli\n"
            "from typer.testing import CliRunner\n"
            "r = CliRunner().invoke(resurgo.cli.app, ['--help'])\n"
            "assert r.exit_code == 0, r.output\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'safetensors', 'pydantic', 'fsspec') if m in sys.modules)\n"
            "print(heavy)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(resurgo.__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_bench_refuses_a_missing_directory_unless_create(tmp_path: Path):
    target = tmp_path / "typo" / "deeper"
    result = runner.invoke(app, ["bench", str(target), "--size", "4KiB", "--tensors", "1", "--repeats", "1"])
    assert result.exit_code == 4
    assert f"{target}: no such directory" in result.stderr and "--create" in result.stderr
    assert not (tmp_path / "typo").exists()  # nothing created
    result = runner.invoke(app, ["bench", str(target), "--create", "--size", "4KiB", "--tensors", "1",
                                 "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert target.is_dir() and list(target.iterdir()) == []  # made; the scratch is gone


def test_study_checks_its_output_directory_before_drawing_anything(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = runner.invoke(app, ["study", "--quick", "--out", str(blocker / "results")])
    assert result.exit_code == 4
    assert result.stdout == ""  # no progress bar drawn first
    assert result.stderr == (f"error: [Errno {errno.ENOTDIR}] {blocker / 'results'}: cannot write there: "
                             f"{os.strerror(errno.ENOTDIR)}; choose another --out\n")
