"""Accelerate with ResurgoAccelerator: save_state/load_state through one resurgo checkpoint, an
exact resume (at an epoch's end and mid-epoch, one process and two gloo processes, with and without
a grad scaler), a resume on
another number of processes, total_limit deleting only after a commit, and a folder Accelerate
wrote before resurgo was added."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("torchdata")

import resurgo  # noqa: E402
import resurgo.integrations._retention as retention  # noqa: E402
from accelerate_run import STEPS, train  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from resurgo.errors import PickleNotAllowedError  # noqa: E402
from resurgo.pipeline.verify import verify_checkpoint  # noqa: E402


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
                                       for x, y in zip(a, b))


def same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(same([a[k]], [b[k]]) for k in a)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return train(tmp_path_factory.mktemp("whole"))


@pytest.mark.parametrize("stop, every", [(8, 4), (6, 3)])  # an epoch's end (8 batches each), mid-epoch
def test_resume_is_bit_identical_and_total_limit_deletes_after_the_commit(tmp_path, whole, monkeypatch, stop, every):
    checkpoints = tmp_path / "checkpoints"
    seen = []
    real_remove = retention.remove

    def observed_remove(root, name):  # the folder as it is when a deletion starts
        seen.append((name, sorted(p.name for p in checkpoints.iterdir() if (p / "manifest.json").is_file())))
        return real_remove(root, name)

    monkeypatch.setattr(retention, "remove", observed_remove)
    first = train(tmp_path, save_every=every, stop=stop, total_limit=2)
    resumed = train(tmp_path, save_every=every, resume=True, total_limit=2)  # load_state(): the latest

    assert same(whole["losses"], first["losses"] + resumed["losses"])
    assert same_params(whole["params"], resumed["params"])
    for k, state in whole["optimizer"]["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[field], resumed["optimizer"]["state"][k][field]), (k, field)
    # The resumed run named its saves on from the loaded one (Accelerate alone restarts at 0 and
    # refuses the existing name), and each deletion came after the newer checkpoint's commit.
    saves = STEPS // every
    names = [f"checkpoint_{i}" for i in range(saves)]
    assert sorted(os.listdir(checkpoints)) == names[-2:]
    assert seen == [(names[i], names[i:i + 3]) for i in range(saves - 2)]
    for name in names[-2:]:
        assert verify_checkpoint(checkpoints / name).ok
        manifest = resurgo.read_manifest(checkpoints / name)
        assert manifest.pickled is False and manifest.step == 0  # accelerator.step: gradient accumulation's count
    assert resurgo.load_dict(checkpoints / names[-1])["custom"] == [{"step": STEPS}]


@pytest.mark.parametrize("stop", [8, 6])  # an epoch's end, mid-epoch
def test_a_grad_scalers_state_resumes_exactly(tmp_path, stop):
    whole = train(tmp_path / "whole", scaler=True)
    scales = [state["scale"] for state in whole["scaler_trace"]]
    assert scales == [2.0**8 * 2 ** (s // 2) for s in range(1, STEPS + 1)], scales  # each step went through it
    first = train(tmp_path, save_every=stop, stop=stop, scaler=True)
    saved = resurgo.load_dict(tmp_path / "checkpoints" / "checkpoint_0")["scaler"]
    assert (saved["scale"], saved["_growth_tracker"]) == (2.0**8 * 2 ** (stop // 2), 0)
    resumed = train(tmp_path, resume=True, scaler=True)
    assert len(resumed["scaler_trace"]) == STEPS - stop
    assert first["scaler_trace"] + resumed["scaler_trace"] == whole["scaler_trace"]
    assert same(whole["losses"], first["losses"] + resumed["losses"])
    assert same_params(whole["params"], resumed["params"])


class Opaque:
    """A class weights_only loading refuses (module-level so that torch.save can pickle it)."""


def test_a_folder_accelerate_wrote_resumes_and_the_next_save_is_resurgo(tmp_path):
    first = train(tmp_path, resurgo=False, save_every=3, stop=6)  # Accelerate's own files
    checkpoint_1 = tmp_path / "checkpoints" / "checkpoint_1"
    assert (checkpoint_1 / "optimizer.bin").is_file() and (checkpoint_1 / "random_states_0.pkl").is_file()

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint_1, bad / "checkpoints" / "checkpoint_0")
    torch.save({"step": 6, "note": Opaque()}, bad / "checkpoints" / "checkpoint_0" / "custom_checkpoint_0.pkl")
    with pytest.raises(PickleNotAllowedError, match=r"checkpoint_0/custom_checkpoint_0\.pkl: .*holds "
                                                    r"test_accelerate\.Opaque.*allow_pickle=True"):
        train(bad, resume=True)

    resumed = train(tmp_path, save_every=3, resume=True, total_limit=2)
    assert len(resumed["losses"]) == STEPS - 6  # the custom object's step came back
    # Accelerate's own folders 0 and 1 were deleted (its retention) once resurgo's 2 and 3 were committed.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2", "checkpoint_3"]
    loaded = resurgo.load_dict(tmp_path / "checkpoints" / "checkpoint_3")
    assert same_params({k: v for k, v in loaded["models"][0].items()}, resumed["params"])
    assert first["params"].keys() == resumed["params"].keys()


def test_sigkill_in_a_save_then_resume_is_bit_identical_and_total_limit_kept_the_committed(tmp_path, whole):
    """Killed while save_state of step 9 (checkpoint_2) is writing, before its commit: total_limit
    has deleted nothing, checkpoint_1 (step 6, mid-epoch) is whole, and the resumed run is the
    uninterrupted one from there, bit for bit."""
    import accelerate_run
    from kill_harness import kill_on_line

    lines = kill_on_line([accelerate_run.__file__, str(tmp_path), "--hang-in-save", "9"], "SAVING")
    assert lines[-2:] == ["STEP 9", "SAVING"]
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert [n for n in names if not n.startswith(".")] == ["checkpoint_0", "checkpoint_1"]
    assert [n.split(".resurgo-tmp-")[0] for n in names if n.startswith(".")] == [".checkpoint_2"]
    assert verify_checkpoint(tmp_path / "checkpoints" / "checkpoint_1").ok

    resumed = train(tmp_path, save_every=3, resume=True, total_limit=2)  # load_state(): checkpoint_1
    assert len(resumed["losses"]) == STEPS - 6
    assert same(whole["losses"][6:], resumed["losses"])
    assert same_params(whole["params"], resumed["params"])
    assert [n for n in sorted(os.listdir(tmp_path / "checkpoints")) if not n.startswith(".")] == [
        "checkpoint_2", "checkpoint_3"]
    assert resurgo.load_dict(tmp_path / "checkpoints" / "checkpoint_3")["custom"] == [{"step": STEPS}]


def test_two_processes_resume_exactly_and_resume_on_one(tmp_path):
    ranks = run_ranks(2, "accelerate_run:two_processes", str(tmp_path))
    for rank, result in enumerate(ranks):
        whole_losses, whole_params = result["whole"]
        resumed_losses, resumed_params = result["resumed"]
        assert same(whole_losses, resumed_losses), rank
        assert same_params(whole_params, resumed_params), rank
    assert ranks[0]["checkpoints"] == ["checkpoint_2", "checkpoint_3"]
    assert not same(ranks[0]["whole"][0], ranks[1]["whole"][0])  # each rank trained on its own shard

    # One process resumes the 2-process checkpoint: the replicated model and optimizer load as they are.
    one = train(tmp_path / "ckpt", resume=True)
    assert one["losses"] == []  # step 12 of 12 was loaded
    assert same_params(ranks[0]["resumed"][1], one["params"])


def test_loading_what_is_not_there_is_a_not_found_error_naming_it(tmp_path):
    from accelerate.utils import ProjectConfiguration

    from resurgo.errors import CheckpointNotFoundError
    from resurgo.integrations.accelerate import ResurgoAccelerator

    accelerator = ResurgoAccelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint_7: no such checkpoint folder"):
        accelerator.load_state(str(tmp_path / "checkpoint_7"))
    with pytest.raises(CheckpointNotFoundError, match=r"checkpoints: no checkpoint_<n> to load"):
        accelerator.load_state()
    from resurgo.errors import UnsupportedValueError

    with pytest.raises(UnsupportedValueError, match=r"no input_dir, and automatic_checkpoint_naming is off"):
        ResurgoAccelerator(cpu=True).load_state()
