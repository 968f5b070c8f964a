"""resurgo.import_checkpoint(source="deepspeed") and `resurgo import --from deepspeed`.

The tests marked ``deepspeed`` train real DeepSpeed ZeRO-1, -2 and -3 jobs on 2 gloo ranks on CPU
(tests/deepspeed_workers.py; run them with ``make test-deepspeed``, which installs deepspeed
outside the main environment) and compare the import bit for bit with DeepSpeed's own views:
``zero_to_fp32`` for the parameters, the live engine's ``safe_get_full_optimizer_state`` for the
Adam moments. The crafted-pickle tests need no deepspeed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.errors import CorruptCheckpointError, NotACheckpointError, PickleNotAllowedError, UnsupportedValueError

runner = CliRunner()
HERE = Path(__file__).parent


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> dict[int | str, Path]:
    """{stage: a real ZeRO checkpoint directory with zero_to_fp32.pt and live.pt beside it;
    "1g2", "3g2": ZeRO-1 and -3 with two parameter groups, zero_to_fp32.pt only}."""
    root = tmp_path_factory.mktemp("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    runs = {}
    for stage, groups in ((1, 1), (2, 1), (3, 1), (1, 2), (3, 2)):
        out = root / f"zero{stage}-{groups}"
        done = subprocess.run([sys.executable, str(HERE / "deepspeed_workers.py"), str(stage), str(out),
                               str(free_port()), str(groups)], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"DeepSpeed ZeRO-{stage} run failed (is deepspeed on the path? make " \
                                     f"test-deepspeed):\n{done.stderr[-3000:]}"
        runs[stage if groups == 1 else f"{stage}g{groups}"] = out
    return runs


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_checkpoint_imports_bit_for_bit(zero_runs, tmp_path, stage):
    src = zero_runs[stage]
    report = resurgo.import_checkpoint(src, tmp_path / "imported", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "imported")
    reference = torch.load(src / "zero_to_fp32.pt", weights_only=True)
    live = torch.load(src / "live.pt", weights_only=True)
    # every parameter zero_to_fp32 rebuilds (tied head.weight included; frozen ones at ZeRO-3), bit for bit
    assert {"emb.weight", "head.weight", "fc1.weight", "fc2.bias"} <= reference.keys()
    for name, want in reference.items():
        assert got[f"model.{name}"].shape == want.shape and bits(got[f"model.{name}"]) == bits(want), name
    # the Adam moments and the fp32 weights equal what the live engine gathered
    assert len(live) == 15
    for key, want in live.items():
        assert bits(got[key].reshape(want.shape)) == bits(want), key
    assert float(got["optim.state.fc1.weight.step"]) == 3.0 and got["global_steps"] == 3
    assert got["zero_stage"] == stage
    # frozen layer: the initial weights (it never trains); ZeRO 1/2 keep it whole in the model states
    torch.manual_seed(0)
    sys.path.insert(0, str(HERE))
    from deepspeed_workers import Tiny

    assert bits(got["model.frozen.weight"]) == bits(Tiny().frozen.weight)
    assert bits(got["model.head.weight"]) == bits(got["model.emb.weight"])
    assert report.num_tensors == len([k for k in got if not isinstance(got[k], (int, str))])
    # universal load: rows 1.. of a matrix as a row-parallel rank, a flat range as an FSDP rank
    rows = torch.zeros(10, 7)
    resurgo.load({"model.emb.weight": resurgo.Shard(rows, (11, 7), (1, 0))}, tmp_path / "imported", strict=False)
    flat = torch.zeros(20)
    resurgo.load({"optim.state.fc1.weight.exp_avg": resurgo.FlatShard(flat, (5, 7), 13)}, tmp_path / "imported",
                 strict=False)
    assert bits(rows) == bits(reference["emb.weight"][1:])
    assert bits(flat) == bits(live["optim.state.fc1.weight.exp_avg"].reshape(-1)[13:33])
    assert runner.invoke(app, ["verify", str(tmp_path / "imported")]).exit_code == 0
    # through the tag folder too, and the CLI
    assert runner.invoke(app, ["import", str(src / "global_step3"), str(tmp_path / "cli"), "--from",
                               "deepspeed"]).exit_code == 0
    assert bits(resurgo.load_dict(tmp_path / "cli")["model.fc1.weight"]) == bits(reference["fc1.weight"])


@pytest.mark.deepspeed
@pytest.mark.parametrize("run", ["1g2", "3g2"])
def test_two_parameter_groups_import_bit_for_bit(zero_runs, tmp_path, run):
    src = zero_runs[run]
    resurgo.import_checkpoint(src, tmp_path / "imported", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "imported")
    reference = torch.load(src / "zero_to_fp32.pt", weights_only=True)
    assert {"fc1.bias", "fc2.bias", "emb.weight", "fc2.weight"} <= reference.keys()
    for name, want in reference.items():
        assert bits(got[f"model.{name}"]) == bits(want), name
    assert float(got["optim.state.fc2.bias.step"]) == 3.0 and got["optim.state.fc2.bias.exp_avg"].shape == (3,)


@pytest.mark.deepspeed
def test_missing_rank_and_mixed_runs_are_named(zero_runs, tmp_path):
    src = tmp_path / "z1"
    shutil.copytree(zero_runs[1], src)
    rank1 = src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"of 2 ranks, but the optimizer files of rank\(s\) \[1\] are missing"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="deepspeed")
    shutil.copy(zero_runs[3] / "global_step3" / rank1.name, rank1)  # a ZeRO-3 run's file among ZeRO-1's
    with pytest.raises(CorruptCheckpointError, match="files of two different runs are mixed"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="deepspeed")
    data = (zero_runs[1] / "global_step3" / rank1.name).read_bytes()
    rank1.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt.*truncated"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="deepspeed")
    assert runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--from", "deepspeed"]).exit_code == 3
    assert not (tmp_path / "out").exists()


def crafted_run(root: Path, payload: bytes) -> None:
    (root / "global_step1").mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    name = "zero_pp_rank_0_mp_rank_00_optim_states"
    with zipfile.ZipFile(root / "global_step1" / f"{name}.pt", "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", payload)
        z.writestr(f"{name}/byteorder", "little")


@pytest.mark.parametrize("payload_of, global_name", [
    (lambda f: b"cos\nsystem\n(S'touch " + str(f).encode() + b"'\ntR.", "os.system"),
    (lambda f: b"cdeepspeed.runtime.engine\nDeepSpeedEngine\n(S'" + str(f).encode() + b"'\ntR.",
     "deepspeed.runtime.engine.DeepSpeedEngine"),
    (lambda f: b"cbuiltins\nopen\n(S'" + str(f).encode() + b"'\nS'w'\ntR.", "builtins.open"),
])
def test_crafted_pickle_is_refused_and_has_no_effect(tmp_path, payload_of, global_name):
    marker = tmp_path / "pwned"
    crafted_run(tmp_path / "ds", payload_of(marker))
    with pytest.raises(PickleNotAllowedError, match=rf"optim_states/data\.pkl: the pickle needs the global {global_name}, "
                                                    "which a DeepSpeed checkpoint file never holds"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "out", source="deepspeed")
    result = runner.invoke(app, ["import", str(tmp_path / "ds"), str(tmp_path / "out"), "--from", "deepspeed"])
    assert result.exit_code == 2 and not marker.exists() and not (tmp_path / "out").exists()


def test_not_a_deepspeed_checkpoint_and_bf16_optimizer_files(tmp_path):
    (tmp_path / "bf16" / "global_step1").mkdir(parents=True)
    (tmp_path / "bf16" / "latest").write_text("global_step1")
    (tmp_path / "bf16" / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(UnsupportedValueError, match="bf16_zero_pp_rank_.* optimizer files .* do not import yet"):
        resurgo.import_checkpoint(tmp_path / "bf16", tmp_path / "out", source="deepspeed")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match="not a DeepSpeed checkpoint"):
        resurgo.import_checkpoint(tmp_path / "empty", tmp_path / "out", source="deepspeed")
    assert runner.invoke(app, ["import", str(tmp_path / "empty"), str(tmp_path / "out"), "--from",
                               "deepspeed"]).exit_code == 4
