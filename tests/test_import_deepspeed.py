"""resurgo.import_checkpoint(source="deepspeed") and `resurgo import --from deepspeed`.

The tests marked ``deepspeed`` use real DeepSpeed ZeRO-1, -2 and -3 checkpoints (fp32 and bf16)
written by one run of tests/deepspeed_workers.py on 2 gloo ranks on CPU (``make test`` installs
deepspeed outside the main environment and runs them) and compare the import bit for bit with
DeepSpeed's own views: ``zero_to_fp32`` for the parameters, the live engine's
``safe_get_full_optimizer_state`` for the Adam moments, DeepSpeed's own continuation of a job for
the losses of the imported job continued under FSDP2. The crafted-pickle and spec tests need no
deepspeed.
"""

from __future__ import annotations

import json
import os
import re
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
from resurgo.interop import spec as spec_lang
from resurgo.interop.spec import Flat, ImportSpec, Piece, TensorSpec
from resurgo.interop.torch_file import read_objects
from resurgo.interop.unpickle import DEEPSPEED
from resurgo.errors import CorruptCheckpointError, ImportSpecError, NotACheckpointError, PickleNotAllowedError, UnsupportedValueError

runner = CliRunner()
HERE = Path(__file__).parent


def bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def zero_runs(tmp_path_factory) -> dict[int | str, Path]:
    """Every real DeepSpeed checkpoint of the tests, written by one run of deepspeed_workers.py:
    {stage: ZeRO-1/2/3 with zero_to_fp32.pt and live.pt beside it; "1g2", "3g2": two parameter
    groups; "bf16-2", "bf16-3": bf16 runs; "continued": the ZeRO-2 run with a scheduler that
    DeepSpeed continued (continued.json)}. ``zero_runs[run] / "universal"`` is ds_to_universal's
    output, for runs 2, 3 and "3g2"."""
    root = tmp_path_factory.mktemp("deepspeed")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    done = subprocess.run([sys.executable, str(HERE / "deepspeed_workers.py"), str(root), str(free_port())], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"the DeepSpeed runs failed (is deepspeed on the path? make test):\n{done.stderr[-3000:]}"
    return {1: root / "zero1-1", 2: root / "zero2-1", 3: root / "zero3-1", "1g2": root / "zero1-2",
            "3g2": root / "zero3-2", "bf16-2": root / "bf16-zero2", "bf16-3": root / "bf16-zero3",
            "continued": root / "continued"}


def reference_matches(got: dict, reference: dict) -> None:
    """Every parameter zero_to_fp32 rebuilds is imported under model.<name>, bit for bit (and the
    frozen layer, which zero_to_fp32 leaves out at ZeRO 1)."""
    assert {"emb.weight", "head.weight", "fc1.weight", "fc2.bias"} <= reference.keys()
    assert set(reference) <= set(got["model"]) and set(got["model"]) - set(reference) <= {"frozen.weight", "frozen.bias"}
    for name, want in reference.items():
        assert got["model"][name].dtype == want.dtype, name
        assert got["model"][name].shape == want.shape and bits(got["model"][name]) == bits(want), name


@pytest.mark.deepspeed
@pytest.mark.timeout(1500)  # the first test to ask for zero_runs waits for every DeepSpeed run
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_checkpoint_imports_bit_for_bit(zero_runs, tmp_path, stage):
    src = zero_runs[stage]
    report = resurgo.import_checkpoint(src, tmp_path / "imported", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "imported")
    reference_matches(got, torch.load(src / "zero_to_fp32.pt", weights_only=True))
    # the fp32 weights and the Adam moments equal what the live engine gathered, under the
    # optimizer's parameter numbers (emb.weight 0, fc1.weight 1, ... in the client optimizer's order)
    live = torch.load(src / "live.pt", weights_only=True)
    assert len(live["model"]) == 5 and sorted(live["optimizer"]) == [0, 1, 2, 3, 4]
    for name, want in live["model"].items():
        assert bits(got["model"][name]) == bits(want), name
    for i, moments in live["optimizer"].items():
        for moment, want in moments.items():
            assert bits(got["optimizer"]["state"][i][moment].reshape(want.shape)) == bits(want), (i, moment)
        assert got["optimizer"]["state"][i]["step"].dtype == torch.float32
        assert float(got["optimizer"]["state"][i]["step"]) == 3.0
    assert got["optimizer"]["param_groups"] == [
        {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False, "maximize": False,
         "foreach": None, "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
         "params": [0, 1, 2, 3, 4]}]
    assert got["global_steps"] == 3 and got["step"] == 3 and got["zero_stage"] == stage and "scheduler" not in got
    # frozen layer: the initial weights (it never trains); ZeRO 1/2 keep it whole in the model states
    torch.manual_seed(0)
    sys.path.insert(0, str(HERE))
    from deepspeed_workers import Tiny

    assert bits(got["model"]["frozen.weight"]) == bits(Tiny().frozen.weight)
    assert bits(got["model"]["head.weight"]) == bits(got["model"]["emb.weight"])
    assert report.num_tensors == 8 + 5 * 3
    # universal load: rows 1.. of a matrix as a row-parallel rank, a flat range as an FSDP rank
    rows = torch.zeros(10, 7)
    resurgo.load({"model": {"emb.weight": resurgo.Shard(rows, (11, 7), (1, 0))}}, tmp_path / "imported", strict=False)
    flat = torch.zeros(20)
    resurgo.load({"optimizer": {"state": {1: {"exp_avg": resurgo.FlatShard(flat, (5, 7), 13)}}}}, tmp_path / "imported",
                 strict=False)
    assert bits(rows) == bits(live["model"]["emb.weight"][1:])
    assert bits(flat) == bits(live["optimizer"][1]["exp_avg"].reshape(-1)[13:33])
    assert runner.invoke(app, ["verify", str(tmp_path / "imported")]).exit_code == 0
    # through the tag folder too, and the CLI
    assert runner.invoke(app, ["import", str(src / "global_step3"), str(tmp_path / "cli"), "--from",
                               "deepspeed"]).exit_code == 0
    assert bits(resurgo.load_dict(tmp_path / "cli")["model"]["fc1.weight"]) == bits(live["model"]["fc1.weight"])


@pytest.mark.deepspeed
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("run", ["1g2", "3g2"])
def test_two_parameter_groups_import_bit_for_bit(zero_runs, tmp_path, run):
    src = zero_runs[run]
    resurgo.import_checkpoint(src, tmp_path / "imported", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "imported")
    reference_matches(got, torch.load(src / "zero_to_fp32.pt", weights_only=True))
    # numbered as the optimizer numbers them: group 0 (weights) first, then group 1 (biases)
    groups = got["optimizer"]["param_groups"]
    assert [g["params"] for g in groups] == [[0, 1, 2], [3, 4]]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert float(got["optimizer"]["state"][4]["step"]) == 3.0 and got["optimizer"]["state"][4]["exp_avg"].shape == (3,)


@pytest.mark.deepspeed
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_optimizer_files_import_bit_for_bit(zero_runs, tmp_path, stage):
    src = zero_runs[f"bf16-{stage}"]
    names = sorted(p.name for p in (src / "global_step3").iterdir() if p.name.endswith("optim_states.pt"))
    assert names == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    resurgo.import_checkpoint(src, tmp_path / "imported", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "imported")
    reference = torch.load(src / "zero_to_fp32.pt", weights_only=True)
    reference_matches(got, reference)  # the fp32 master weights; frozen ones in their own dtype
    assert got["model"]["fc1.weight"].dtype == torch.float32 and reference["frozen.weight"].dtype == torch.bfloat16
    assert got["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32
    assert float(got["optimizer"]["state"][0]["exp_avg_sq"].abs().sum()) > 0
    if stage == 2:  # parameter_alignment on: the partitions hold gaps between parameters, never read
        osd = read_objects(src / "global_step3" / names[0], DEEPSPEED, "a DeepSpeed file")[0]["optimizer_state_dict"]
        assert osd["param_alignment_paddings"] == [[3, 5, 3, 1, 0]]


@pytest.mark.deepspeed
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("run", [2, 3, "3g2"])
def test_ds_to_universal_output_imports_bit_for_bit(zero_runs, tmp_path, run):
    """DeepSpeed's ds_to_universal output of the ZeRO-2 and ZeRO-3 runs: found through
    latest_universal, or as the tag folder; equal to zero_to_fp32 and to the original's import.
    ZeRO-3's holds flat tensors, no step.pt (the steps: rank 0's, in zero/optimizer_state.pt) and
    every rank's model states (the frozen parameters' parts)."""
    universal = zero_runs[run] / "universal"
    assert (universal / "latest_universal").read_text() == "global_step3"
    assert (universal / "global_step3" / "zero" / "fc1.weight" / "exp_avg_sq.pt").is_file()
    assert (universal / "global_step3" / "zero" / "fc1.weight" / "step.pt").is_file() == (run == 2)
    resurgo.import_checkpoint(universal, tmp_path / "universal", source="deepspeed")
    resurgo.import_checkpoint(zero_runs[run], tmp_path / "zero", source="deepspeed")
    got, original = resurgo.load_dict(tmp_path / "universal"), resurgo.load_dict(tmp_path / "zero")
    reference_matches(got, torch.load(zero_runs[run] / "zero_to_fp32.pt", weights_only=True))
    assert got["model"].keys() == original["model"].keys()
    for name, theirs in original["model"].items():  # the frozen layer and the tied head too
        assert got["model"][name].dtype == theirs.dtype and bits(got["model"][name]) == bits(theirs), name
    for i in range(5):
        assert got["optimizer"]["state"][i].keys() == {"exp_avg", "exp_avg_sq", "step"}
        for what in ("exp_avg", "exp_avg_sq", "step"):
            mine, theirs = got["optimizer"]["state"][i][what], original["optimizer"]["state"][i][what]
            assert mine.shape == theirs.shape and bits(mine) == bits(theirs), (i, what)
    assert got["optimizer"]["param_groups"] == original["optimizer"]["param_groups"]
    stage = 2 if run == 2 else 3
    assert {k: got[k] for k in ("global_steps", "step", "zero_stage")} == {"global_steps": 3, "step": 3, "zero_stage": stage}
    result = runner.invoke(app, ["import", str(universal / "global_step3"), str(tmp_path / "cli"), "--from", "deepspeed"])
    assert result.exit_code == 0, result.output
    shutil.copytree(universal, tmp_path / "copy")
    (tmp_path / "copy" / "global_step3" / "zero" / "fc2.bias" / "exp_avg.pt").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"zero/fc2\.bias/exp_avg\.pt: missing"):
        resurgo.import_checkpoint(tmp_path / "copy", tmp_path / "broken", source="deepspeed")
    if stage == 3:  # a rank's model states, with its part of the frozen layer
        shutil.copy(universal / "global_step3" / "zero" / "fc2.bias" / "exp_avg.pt",
                    tmp_path / "copy" / "global_step3" / "zero" / "fc2.bias" / "exp_avg.pt")
        (tmp_path / "copy" / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
        with pytest.raises(CorruptCheckpointError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt: missing"):
            resurgo.import_checkpoint(tmp_path / "copy", tmp_path / "broken", source="deepspeed")
    assert not (tmp_path / "broken").exists()


@pytest.mark.deepspeed
@pytest.mark.timeout(1500)
def test_zero2_job_continues_as_fsdp2_job_on_3_ranks(zero_runs, tmp_path):
    """A DeepSpeed ZeRO-2 job on 2 ranks saved after 3 steps and DeepSpeed continued it 4 more
    (continued.json). Imported, it continues as an FSDP2 job on 3 ranks (deepspeed_continue.py):
    resurgo.load fills the sharded model, the AdamW moments and steps, the param groups (the
    learning rate the scheduler had set) and the StepLR scheduler; the same global batches give the
    same losses. Tolerance: relative 1e-6, about 8 float32 ulps. The jobs round differently only
    in sums whose order differs (gradients reduced over 2 ranks vs. reduce-scattered over 3, the
    gradient norm for clipping, the loss averaged over the ranks); a missing or wrong state (the
    moments, the step's bias correction, the scheduled learning rate) moves the losses by more than
    1e-3 relative."""
    src = zero_runs["continued"]
    resurgo.import_checkpoint(src, tmp_path / "imported", source="deepspeed")
    got = resurgo.load_dict(tmp_path / "imported")
    assert got["scheduler"] == {"step_size": 2, "gamma": 0.5, "base_lrs": [0.01], "last_epoch": 3, "_step_count": 4,
                                "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": [0.005]}
    assert got["optimizer"]["param_groups"][0]["lr"] == 0.005 and got["step"] == 3
    out = tmp_path / "fsdp.json"
    done = subprocess.run([sys.executable, str(HERE / "deepspeed_continue.py"), str(tmp_path / "imported"), str(out),
                           str(free_port())], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    fsdp, deepspeed = json.loads(out.read_text()), json.loads((src / "continued.json").read_text())
    # everything the FSDP2 job holds was in the import; what is left over are DeepSpeed's counters
    assert fsdp["missing"] == [] and sorted(fsdp["unexpected"]) == sorted(
        ["global_steps", "global_samples", "skipped_steps", "ds_version", "zero_stage", "step"])
    assert fsdp["lr"] == deepspeed["lr"] == [0.00125]
    assert len(fsdp["losses"]) == len(deepspeed["losses"]) == 4
    assert fsdp["losses"] == pytest.approx(deepspeed["losses"], rel=1e-6, abs=0)


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


def test_not_a_deepspeed_checkpoint_and_bf16_optimizer_without_zero(tmp_path):
    """DeepSpeed's bf16 optimizer without ZeRO (stage 0) writes bf16_zero_pp_rank_* files without a
    ZeRO stage, which zero_to_fp32 refuses too; files of an fp32 and a bf16 run together are mixed."""
    folder = tmp_path / "bf16" / "global_step1"
    folder.mkdir(parents=True)
    (tmp_path / "bf16" / "latest").write_text("global_step1")
    torch.save({"optimizer_state_dict": {"partition_count": 1}}, folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsupportedValueError, match=r"bf16_zero_pp_rank_0_mp_rank_00_optim_states\.pt: ZeRO stage None "
                                                    r"\(DeepSpeed's bf16 optimizer without ZeRO.*only ZeRO stages 1, 2 and 3"):
        resurgo.import_checkpoint(tmp_path / "bf16", tmp_path / "out", source="deepspeed")
    shutil.copy(folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CorruptCheckpointError, match="both zero_pp_rank_.* and bf16_zero_pp_rank_.*two different runs"):
        resurgo.import_checkpoint(tmp_path / "bf16", tmp_path / "out", source="deepspeed")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACheckpointError, match="not a DeepSpeed checkpoint"):
        resurgo.import_checkpoint(tmp_path / "empty", tmp_path / "out", source="deepspeed")
    assert runner.invoke(app, ["import", str(tmp_path / "empty"), str(tmp_path / "out"), "--from",
                               "deepspeed"]).exit_code == 4


def test_spec_path_nests_tensors_and_is_checked(tmp_path):
    """A tensor's path places it in the nested state (int keys included), so that resurgo.load
    fills an optimizer's state_dict; a path that does not join to the key, or that runs into a
    value, is refused by name."""
    data = torch.arange(6, dtype=torch.float32)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w.bin").write_bytes(bits(data))

    def spec(path, values=None):
        return ImportSpec(tensors=[TensorSpec(key=".".join(map(str, path)), path=path, dtype="float32", shape=[6],
                                              pieces=[Piece(file="w.bin", shape=[6], flat=Flat(start=0, stop=6))])],
                          values=values or {})

    resurgo.import_checkpoint(tmp_path / "src", tmp_path / "ok", source="spec",
                              spec=spec(["optimizer", "state", 0, "exp_avg"], {"optimizer": {"param_groups": []}}))
    got = resurgo.load_dict(tmp_path / "ok")
    assert list(got["optimizer"]["state"]) == [0] and bits(got["optimizer"]["state"][0]["exp_avg"]) == bits(data)
    target = torch.zeros(6)
    resurgo.load({"optimizer": {"state": {0: {"exp_avg": target}}}}, tmp_path / "ok", strict=False)
    assert bits(target) == bits(data)
    bad = spec(["a", "b"]).model_copy(update={"tensors": [spec(["a", "b"]).tensors[0].model_copy(update={"key": "a.c"})]})
    with pytest.raises(ImportSpecError, match=r"tensor 'a\.c': path \['a', 'b'\] must be non-empty names that joined"):
        resurgo.import_checkpoint(tmp_path / "src", tmp_path / "bad", source="spec", spec=bad)
    with pytest.raises(ImportSpecError, match=r"tensor 'a\.b': its path \['a', 'b'\] passes through value 'a'"):
        resurgo.import_checkpoint(tmp_path / "src", tmp_path / "bad", source="spec", spec=spec(["a", "b"], {"a": 1}))
    assert not (tmp_path / "bad").exists()
    assert spec_lang.loads(spec_lang.dumps(spec(["optimizer", "state", 0, "exp_avg"]))).tensors[0].path == [
        "optimizer", "state", 0, "exp_avg"]


@pytest.mark.parametrize("name, missing", [("zero_pp_rank_0_mp_rank_01_optim_states.pt", "mp_rank_01_model_states.pt"),
                                           ("mp_rank_01_model_states.pt", "mp_rank_00_model_states.pt"),
                                           ("layer_01-model_00-model_states.pt", "mp_rank_00_model_states.pt")])
def test_tensor_and_pipeline_parallel_files_go_to_the_model_parallel_import(tmp_path, name, missing):
    """A file of a second tensor-parallel rank or of a pipeline stage's layer makes the checkpoint one of
    model parallelism (tests/test_import_deepspeed_mp.py), whose missing files are named."""
    folder = tmp_path / "ds" / "global_step1"
    folder.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    torch.save({}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({}, folder / name)
    if missing != "mp_rank_00_model_states.pt":
        torch.save({"module": {}}, folder / "mp_rank_00_model_states.pt")
    with pytest.raises(CorruptCheckpointError, match=rf"global_step1/{re.escape(missing)}: missing"):
        resurgo.import_checkpoint(tmp_path / "ds", tmp_path / "out", source="deepspeed")
    result = runner.invoke(app, ["import", str(tmp_path / "ds"), str(tmp_path / "out"), "--from", "deepspeed"])
    assert result.exit_code == 3 and not (tmp_path / "out").exists()


def _flat(node: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.deepspeed
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("run", [1, 2, 3, "bf16-3"])
def test_zero_checkpoint_imports_in_place(zero_runs, tmp_path, run):
    """Every tensor of a ZeRO checkpoint (flattened fp32 partitions included: flat ranges of the
    optimizer files' members) is referenced where it lies; the checkpoint equals the copying
    import's, bit for bit, and verifies (the CLI imports in place too)."""
    src = zero_runs[run]
    copied = resurgo.import_checkpoint(src, tmp_path / "copied", source="deepspeed")
    result = runner.invoke(app, ["import", str(src), str(tmp_path / "in_place"), "--from", "deepspeed", "--in-place"])
    assert result.exit_code == 0, result.output
    assert "in place:" in result.output and "copied " not in result.output  # no tensor copied after all
    manifest = json.loads((tmp_path / "in_place" / "manifest.json").read_bytes())
    files = {c["file"] for t in manifest["tensors"].values() for c in t["chunks"]}
    assert manifest["version"] == 5 and files and all(f.startswith("external:") for f in files)  # no byte copied
    assert copied.tensor_bytes > 0 and sum(p.stat().st_size for p in (tmp_path / "in_place" / "data").iterdir()) < 200
    a, b = _flat(resurgo.load_dict(tmp_path / "in_place")), _flat(resurgo.load_dict(tmp_path / "copied"))
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert (bits(v) == bits(b[k])) if isinstance(v, torch.Tensor) else v == b[k], k
    assert runner.invoke(app, ["verify", str(tmp_path / "in_place")]).exit_code == 0
