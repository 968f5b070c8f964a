"""Hugging Face Trainer with ResurgoTrainer: an exact resume from resurgo checkpoints, verified
checkpoints, save_total_limit deleting only after a commit, the exported model loadable with
from_pretrained, a switch from the plain Trainer's folders mid-project, and a SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import resurgo  # noqa: E402
import resurgo.integrations._retention as retention  # noqa: E402
import resurgo.integrations.transformers as hf_integration  # noqa: E402
from hf_trainer_run import STEPS, Tokens, make_trainer  # noqa: E402
from resurgo.errors import PickleNotAllowedError  # noqa: E402
from resurgo.pipeline.verify import verify_checkpoint  # noqa: E402


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run (no saves), every later run is compared to."""
    trainer = make_trainer(tmp_path_factory.mktemp("whole"), save_steps=STEPS + 1)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def whole_scaled(tmp_path_factory):
    """The uninterrupted run through a grad scaler."""
    trainer = make_trainer(tmp_path_factory.mktemp("whole_scaled"), save_steps=STEPS + 1, scaler=True)
    trainer.train()
    scales = [scaler["scale"] for *_, scaler in trainer.trace]
    assert scales == [2.0**8 * 2 ** (s // 2) for s in range(1, STEPS + 1)], scales  # each step went through it
    return trainer


def assert_same_run(whole, losses: list, trace: list, resumed) -> None:
    """``losses`` and ``trace`` are those of every step, across the interrupted and resumed runs."""
    # Each step's (epoch, global_step, sample indices, last learning rates): the same batches in
    # the same order, counted the same, however the run was cut (checked first: a divergence shows its step).
    assert [(epoch, step) for epoch, step, *_ in whole.trace] == [(s / 4, s) for s in range(1, STEPS + 1)]
    for e in range(STEPS // 4):  # each epoch trains on every sample once
        assert sorted(i for _, _, batch, *_ in whole.trace[4 * e:4 * e + 4] for i in batch) == list(range(16))
    # Every step draws from the RNG (dropout), so each step ends in another RNG state.
    assert len({rng for *_, rng, _ in whole.trace}) == STEPS
    assert trace == whole.trace
    assert (resumed.state.epoch, resumed.state.global_step) == (whole.state.epoch, whole.state.global_step)
    assert resumed.lr_scheduler.get_last_lr() == whole.lr_scheduler.get_last_lr()
    assert len(losses) == STEPS
    assert all(bitwise_equal(a, b) for a, b in zip(whole.losses, losses))
    for (name, a), (_, b) in zip(whole.model.state_dict().items(), resumed.model.state_dict().items()):
        assert bitwise_equal(a, b), name
    opt_whole, opt_resumed = whole.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert opt_whole.keys() == opt_resumed.keys()
    for k in opt_whole:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert bitwise_equal(opt_whole[k][field], opt_resumed[k][field]), (k, field)
    assert whole.lr_scheduler.state_dict() == resumed.lr_scheduler.state_dict()


@pytest.mark.parametrize("stop", [4, 6])  # an epoch's end (4 steps each), and mid-epoch
def test_resume_from_true_is_bit_identical_with_the_grad_scaler_and_every_checkpoint_verifies(tmp_path, whole_scaled,
                                                                                             stop):
    whole = whole_scaled
    first = make_trainer(tmp_path, save_steps=stop // 2, stop=stop, scaler=True)
    first.train()
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{stop // 2}", f"checkpoint-{stop}"]
    for name in os.listdir(tmp_path):
        assert sorted(os.listdir(tmp_path / name)) == ["data", "manifest.json"]
        assert verify_checkpoint(tmp_path / name).ok
        manifest = resurgo.read_manifest(tmp_path / name)
        assert manifest.pickled is False and manifest.step == int(name.split("-")[1])
        assert manifest.metadata[hf_integration.PARTS_KEY] == ["model", "optimizer", "rng", "scaler", "scheduler",
                                                               "trainer_state"]
    saved = resurgo.load_dict(tmp_path / f"checkpoint-{stop}")["scaler"]
    assert (saved["scale"], saved["_growth_tracker"]) == (2.0**8 * 2 ** (stop // 2), 0)

    resumed = make_trainer(tmp_path, save_steps=stop // 2, scaler=True)
    resumed.train(resume_from_checkpoint=True)  # the latest: checkpoint-<stop>
    assert_same_run(whole, first.losses + resumed.losses, first.trace + resumed.trace, resumed)
    assert resumed.accelerator.scaler.state_dict() == whole.accelerator.scaler.state_dict()
    assert resurgo.read_manifest(tmp_path / f"checkpoint-{STEPS}").step == STEPS


def test_save_total_limit_deletes_only_committed_predecessors_and_the_model_exports(tmp_path, whole, monkeypatch):
    seen = []
    real_remove = retention.remove

    def observed_remove(root, name):  # the folder as it is when a deletion starts
        committed = sorted(p.name for p in tmp_path.iterdir() if (p / "manifest.json").is_file())
        seen.append((name, committed))
        return real_remove(root, name)

    monkeypatch.setattr(retention, "remove", observed_remove)
    trainer = make_trainer(tmp_path, save_steps=4, save_total_limit=2)
    trainer.train()
    # Saves at 4, 8, 12: checkpoint-4 goes only once checkpoint-12 is committed.
    assert seen == [("checkpoint-4", ["checkpoint-12", "checkpoint-4", "checkpoint-8"])]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-12", "checkpoint-8"]
    assert_same_run(whole, trainer.losses, trainer.trace, trainer)

    from transformers import GPT2LMHeadModel

    trainer.save_model(tmp_path / "export")
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "export")
    for name, tensor in trainer.model.state_dict().items():
        assert bitwise_equal(tensor, exported.state_dict()[name]), name


def test_load_best_model_at_end_loads_the_best_resurgo_checkpoint_which_retention_keeps(tmp_path):
    # The "best" is the highest eval loss, so that it is an early checkpoint, not the last one.
    trainer = make_trainer(tmp_path, save_steps=3, save_total_limit=2, eval_dataset=Tokens(), eval_strategy="steps",
                           eval_steps=3, load_best_model_at_end=True, metric_for_best_model="loss",
                           greater_is_better=True)
    trainer.train()
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name != f"checkpoint-{STEPS}"
    assert sorted(os.listdir(tmp_path)) == sorted({best.name, f"checkpoint-{STEPS}"})
    saved = resurgo.load_dict(best)["model"]
    for name, tensor in trainer.model.state_dict().items():
        assert bitwise_equal(tensor, saved[name]), name


def test_a_folder_of_the_plain_trainer_resumes_exactly_and_the_next_saves_are_resurgo(tmp_path, whole_scaled):
    whole = whole_scaled
    plain = make_trainer(tmp_path, resurgo=False, stop=6, scaler=True)
    plain.train()
    for name in ("optimizer.pt", "scaler.pt"):  # the Trainer's own files
        assert (tmp_path / "checkpoint-6" / name).is_file()

    # A file that weights_only loading refuses: named, with the way out; nothing is changed.
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "checkpoint-6", bad / "checkpoint-6")
    scheduler = torch.load(bad / "checkpoint-6" / "scheduler.pt", weights_only=True)
    torch.save({**scheduler, "note": Opaque()}, bad / "checkpoint-6" / "scheduler.pt")
    with pytest.raises(PickleNotAllowedError, match=r"checkpoint-6/scheduler\.pt: .*holds test_transformers\.Opaque"
                                                    r".*allow_pickle=True"):
        make_trainer(bad, save_steps=3).train(resume_from_checkpoint=True)
    assert sorted(os.listdir(bad)) == ["checkpoint-6"]

    resumed = make_trainer(tmp_path, save_steps=3, save_total_limit=2, scaler=True)
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(whole, plain.losses + resumed.losses, plain.trace + resumed.trace, resumed)
    assert resumed.accelerator.scaler.state_dict() == whole.accelerator.scaler.state_dict()
    # The Trainer's retention removed its own old folders once resurgo's were committed.
    assert sorted(os.listdir(tmp_path)) == ["bad", "checkpoint-12", "checkpoint-9"]
    assert sorted(os.listdir(tmp_path / "checkpoint-12")) == ["data", "manifest.json"]


class Opaque:
    """A class weights_only loading refuses (module-level so that torch.save can pickle it)."""


def test_sigkill_mid_training_then_resume_is_bit_identical(tmp_path, whole):
    from kill_harness import kill_on_line

    # checkpoint-6 was committed; step 7 is done, not saved
    kill_on_line([str(Path(__file__).with_name("hf_trainer_run.py")), str(tmp_path), "--hang-at", "7"], "STEP 7")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]

    resumed = make_trainer(tmp_path, save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert len(resumed.losses) == STEPS - 6
    assert_same_run(whole, whole.losses[:6] + resumed.losses, whole.trace[:6] + resumed.trace, resumed)
    trainer_state = json.loads(resurgo.load_dict(tmp_path / "checkpoint-12")["trainer_state"])
    assert trainer_state["global_step"] == STEPS


def test_resuming_from_a_folder_that_does_not_exist_is_a_not_found_error_naming_it(tmp_path):
    from resurgo.errors import CheckpointNotFoundError

    with pytest.raises(CheckpointNotFoundError, match=r"checkpoint-7: no such checkpoint folder"):
        make_trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "checkpoint-7"))


@pytest.mark.slow  # two processes importing transformers: kept out of the default suite's time budget
def test_two_processes_resume_exactly(tmp_path):
    from dist_harness import run_ranks

    ranks = run_ranks(2, "hf_trainer_run:two_processes", str(tmp_path))
    for rank, result in enumerate(ranks):
        (whole_losses, whole_params), (resumed_losses, resumed_params) = result["whole"], result["resumed"]
        assert len(whole_losses) == len(resumed_losses) == STEPS, rank
        assert all(bitwise_equal(a, b) for a, b in zip(whole_losses, resumed_losses)), rank
        assert all(bitwise_equal(whole_params[k], resumed_params[k]) for k in whole_params), rank
        assert len(result["whole_trace"]) == STEPS and result["resumed_trace"] == result["whole_trace"], rank
    assert not all(bitwise_equal(a, b) for a, b in zip(ranks[0]["whole"][0], ranks[1]["whole"][0]))  # own shards
    assert ranks[0]["checkpoints"] == ["checkpoint-12", "checkpoint-3", "checkpoint-6", "checkpoint-9"]
    manifest = resurgo.read_manifest(tmp_path / "ckpt" / "checkpoint-12")
    assert manifest.world == {"size": 2} and verify_checkpoint(tmp_path / "ckpt" / "checkpoint-12").ok
