"""resurgo.integrations.torchtitan: ResurgoCheckpointManager under torchtitan 0.3.0, on CPU.

Marked ``torchtitan`` (deselected by default): torchtitan and its dependencies live outside the
environment, in .torchtitan-site (``make test-torchtitan``). The contract tests build the
manager as torchtitan's Trainer does (``config.checkpoint.build(...)``) with torchtitan's own
optimizer and LR scheduler containers; the training tests run real torchtitan jobs
(tests/torchtitan_run.py) in their own processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import (CheckpointNotFoundError, ForeignFilesError, KeyMismatchError, PickleNotAllowedError,
                            UnsupportedValueError, WorldSizeMismatchError)

pytestmark = pytest.mark.torchtitan

HERE = Path(__file__).resolve().parent


class _TrainState:
    """torchtitan's Trainer is itself the ``train_state`` Stateful: step and tokens seen."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _parts(seed: int = 0):
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    return model, optimizers, schedulers


def _manager(folder: Path, seed: int = 0, dataloader=None, **config):
    """The manager as torchtitan's Trainer builds it, on a small model."""
    from resurgo.integrations.torchtitan import ResurgoCheckpointManager

    model, optimizers, schedulers = _parts(seed)
    train_state = _TrainState()
    manager = ResurgoCheckpointManager.Config(enable=True, **config).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=None, base_folder=str(folder))
    return manager, model, optimizers, train_state


def _train_step(model, optimizers) -> None:
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizers.step()
    optimizers.zero_grad()


def _steps(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoint").iterdir())


def test_keep_latest_k_deletes_only_after_the_commit_and_only_what_resurgo_wrote(tmp_path):
    manager, model, optimizers, state = _manager(tmp_path, interval=1, keep_latest_k=2)
    for step in (1, 2, 3):
        _train_step(model, optimizers)
        state.step = step
        assert manager.save(step) is True
    assert _steps(tmp_path) == ["step-2", "step-3"]

    # A save that fails (a state that is not plain data) deletes nothing.
    class Opaque:
        def state_dict(self):
            return {"thing": object()}

        def load_state_dict(self, sd):
            pass

    manager.states["extra"] = Opaque()
    with pytest.raises(UnsupportedValueError, match="extra"):
        manager.save(4)
    assert _steps(tmp_path) == ["step-2", "step-3"]
    del manager.states["extra"]

    # A checkpoint folder holding a file of someone else's is not deleted.
    (tmp_path / "checkpoint" / "step-2" / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFilesError, match="notes.txt"):
        manager.save(5)
    assert _steps(tmp_path) == ["step-2", "step-3", "step-5"]
    assert (tmp_path / "checkpoint" / "step-2" / "notes.txt").read_text() == "mine"
    assert resurgo.load_dict(tmp_path / "checkpoint" / "step-5")["train_state"]["step"] == 3


def test_resume_restores_model_optimizer_scheduler_train_state_and_rng(tmp_path):
    manager, model, optimizers, state = _manager(tmp_path, interval=2)
    for step in (1, 2):
        _train_step(model, optimizers)
        manager.states["lr_scheduler"].step()
        state.step, state.ntokens_seen = step, 64 * step
        manager.save(step)
    torch.manual_seed(1234)
    manager.save(4)  # the RNG states as of now are in step-4
    after_save = torch.rand(3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizers.state_dict().items()}

    resumed, model2, optimizers2, state2 = _manager(tmp_path, seed=1, interval=2)
    assert resumed.load() is True
    assert state2.step == 2 and state2.ntokens_seen == 128
    assert resumed.states["lr_scheduler"].schedulers[0].last_epoch == 2
    for key, value in expected.items():
        assert torch.equal(model2.state_dict()[key], value), key
    for key, value in expected_optim.items():
        got = optimizers2.state_dict()[key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key
    # torchtitan builds its data iterator (a draw) after the load: the RNG states are set again
    # right before the first forward, so the next draw is the one after the save.
    torch.rand(1)
    model2(torch.zeros(1, 8))
    assert torch.equal(torch.rand(3), after_save)


class _Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (torch.tensor([i]) for i in range(100))


def _loader(dp_world_size: int):
    """torchtitan's data loader (a StatefulDataLoader that hands its state over pickled)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    return ParallelAwareDataloader(_Numbers(), dp_rank=0, dp_world_size=dp_world_size, batch_size=2)


def test_data_loader_position_is_saved_as_plain_values_and_resumed(tmp_path):
    loader = _loader(1)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    manager, *_ = _manager(tmp_path, dataloader=loader, interval=1)
    manager.save(3)
    saved = resurgo.load_dict(tmp_path / "checkpoint" / "step-3")["dataloader"]
    assert saved.value["dp_world_size"] == 1 and isinstance(saved.value["loader"], dict)  # no pickled bytes
    assert not resurgo.read_manifest(tmp_path / "checkpoint" / "step-3").pickled

    resumed_loader = _loader(1)
    resumed, *_ = _manager(tmp_path, seed=1, dataloader=resumed_loader, interval=1)
    resumed.load()
    assert torch.equal(next(iter(resumed_loader)), next(batches))  # the 4th batch, [6, 7]

    # The same number of ranks split another way (2 data-parallel ranks saved, 1 loads).
    manager2, *_ = _manager(tmp_path / "dp2", dataloader=_loader(2), interval=1)
    manager2.save(1)
    other, *_ = _manager(tmp_path / "dp2", seed=1, dataloader=_loader(1), interval=1)
    with pytest.raises(WorldSizeMismatchError, match=r"saved by 2 data-parallel ranks and cannot be split over 1.*"
                                                     r"exclude_from_loading=\['dataloader'\]"):
        other.load()


def test_load_of_a_missing_step_names_the_steps_there(tmp_path):
    manager, model, optimizers, _ = _manager(tmp_path, interval=1)
    manager.save(3)
    with pytest.raises(CheckpointNotFoundError, match=r"step-7.*load_step=7.*steps found: \[3\]"):
        manager.load(step=7)
    empty, *_ = _manager(tmp_path / "other", interval=1)
    assert empty.load() is False  # a fresh start, as torchtitan's manager answers


def test_last_save_model_only_exports_the_model_in_export_dtype(tmp_path):
    manager, model, optimizers, _ = _manager(tmp_path, interval=5, last_save_model_only=True,
                                             export_dtype="bfloat16")
    assert manager.save(3) is False  # not an interval step
    assert manager.save(3, last_step=True) is True
    saved = resurgo.load_dict(tmp_path / "checkpoint" / "step-3")
    assert sorted(saved) == ["model"]
    assert {k: v.dtype for k, v in saved["model"].items()} == {k: torch.bfloat16 for k in model.state_dict()}
    assert torch.equal(saved["model"]["0.weight"], model.state_dict()["0.weight"].to(torch.bfloat16))
    # Resuming a full training state from a model-only checkpoint is refused, naming the way out.
    resumed, *_ = _manager(tmp_path, interval=5)
    with pytest.raises(KeyMismatchError, match=r"step-3: the checkpoint holds model, not lr_scheduler, optimizer, rng, train_state; .*initial_load_model_only=True"):
        resumed.load()


def test_initial_load_path_loads_the_model_only(tmp_path):
    source, model, optimizers, _ = _manager(tmp_path / "pretrain", interval=1)
    _train_step(model, optimizers)
    source.save(1)
    fresh, model2, optimizers2, state2 = _manager(
        tmp_path / "finetune", seed=1, interval=1,
        initial_load_path=str(tmp_path / "pretrain" / "checkpoint" / "step-1"), initial_load_model_only=True)
    assert fresh.load() is True
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in model.state_dict().items())
    assert optimizers2.optimizers[0].state == {} and state2.step == 0


def test_exclude_from_loading(tmp_path):
    manager, model, optimizers, state = _manager(tmp_path, interval=1)
    state.step = 5
    manager.save(5)
    resumed, _, _, state2 = _manager(tmp_path, seed=1, interval=1, exclude_from_loading=["train_state"])
    resumed.load()
    assert state2.step == 0
    wrong, *_ = _manager(tmp_path, seed=1, interval=1, exclude_from_loading=["trainstate"])
    with pytest.raises(KeyMismatchError, match="exclude_from_loading names 'trainstate'"):
        wrong.load()


def test_refused_configurations(tmp_path):
    with pytest.raises(UnsupportedValueError, match="last_save_in_hf=True"):
        _manager(tmp_path, last_save_in_hf=True)
    from resurgo.integrations.torchtitan import ResurgoCheckpointManager

    with pytest.raises(UnsupportedValueError, match="async_mode='threads'"):
        ResurgoCheckpointManager.Config(enable=True, async_mode="threads")


def test_async_save_commits_the_snapshot_taken_at_save(tmp_path):
    manager, model, optimizers, state = _manager(tmp_path, interval=1, async_mode="async", keep_latest_k=2)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    assert manager.save(1) is True
    assert manager.save_future is not None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the save is written
    manager.maybe_wait_for_saving()
    assert manager.save_future is None
    saved = resurgo.load_dict(tmp_path / "checkpoint" / "step-1")["model"]
    assert all(torch.equal(saved[k], v) for k, v in snapshot.items())
    # keep_latest_k runs once the save is committed, where the training loop waits for it: its
    # errors are raised there, not lost in the background.
    manager.save(2)
    (tmp_path / "checkpoint" / "step-1" / "notes.txt").write_text("mine")
    manager.save(3)  # waits for step 2, whose retention finds step-1 within keep_latest_k=2
    with pytest.raises(ForeignFilesError, match="notes.txt"):
        manager.close()  # waits for step 3: step-1 is to go, and holds a file resurgo did not write
    assert _steps(tmp_path) == ["step-1", "step-2", "step-3"]


def test_a_folder_of_torchtitan_dcp_checkpoints_resumes_and_is_retired(tmp_path):
    """Switching mid-project: torchtitan's own manager wrote step-2 (DCP); the resurgo manager
    resumes from it, writes resurgo checkpoints next, and keep_latest_k retires the DCP one."""
    from torchtitan.components.checkpoint import CheckpointManager

    model, optimizers, schedulers = _parts()
    _train_step(model, optimizers)
    state = _TrainState()
    state.step = 2
    dcp_manager = CheckpointManager.Config(enable=True, interval=2, keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=str(tmp_path))
    dcp_manager.save(2)
    assert (tmp_path / "checkpoint" / "step-2" / ".metadata").is_file()

    # Its metadata and data loader state are pickles: read only when allowed.
    refusing, *_ = _manager(tmp_path, seed=1, interval=1)
    with pytest.raises(PickleNotAllowedError, match=r"step-2: a checkpoint torchtitan's own manager wrote \(DCP\).*"
                                                    r"allow_pickle=True"):
        refusing.load()

    manager, model2, optimizers2, state2 = _manager(tmp_path, seed=1, interval=1, keep_latest_k=2, allow_pickle=True)
    assert manager.load() is True
    assert state2.step == 2
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in model.state_dict().items())
    manager.save(3)
    manager.save(4)
    assert _steps(tmp_path) == ["step-3", "step-4"]


# -- real torchtitan training jobs --------------------------------------------------------------


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtitan_assets")
    sys.path.insert(0, str(HERE))
    try:
        import torchtitan_run
    finally:
        sys.path.remove(str(HERE))
    torchtitan_run.make_assets(str(root))
    return root


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, args: dict, tmp_path: Path, check: bool = True) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HOME=str(tmp_path / "hf"),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "torchtitan_run.py"), json.dumps(args)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    done = [subprocess.CompletedProcess(p.args, p.wait(timeout=240), p.stdout.read(), None) for p in procs]
    for p in procs:
        p.stdout.close()
    if check:
        for result in done:
            assert result.returncode == 0, result.stdout[-3000:]
    return done


def _final(dump: Path) -> dict:
    return torch.load(dump / "final.pt", weights_only=True)


def _assert_equal_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_torchtitan_job_killed_and_resumed_equals_the_uninterrupted_one(assets, tmp_path):
    """The llama3 debug model trained 6 steps by torchtitan's Trainer: uninterrupted (asynchronous
    saves) and killed with SIGKILL right after the step-4 checkpoint, then resumed. The resumed
    run's losses at steps 5 and 6, its weights, optimizer state and RNG state are bit-identical."""
    job = {"assets": str(assets), "steps": 6, "interval": 2, "keep": 2}
    _run(1, {**job, "dump": str(tmp_path / "a"), "async_mode": "async"}, tmp_path)
    killed = _run(1, {**job, "dump": str(tmp_path / "b"), "kill_after": 4}, tmp_path, check=False)
    assert killed[0].returncode == -9, killed[0].stdout[-3000:]
    assert _steps(tmp_path / "b") == ["step-2", "step-4"]
    _run(1, {**job, "dump": str(tmp_path / "b")}, tmp_path)

    a = json.loads((tmp_path / "a" / "record.json").read_text())
    b = json.loads((tmp_path / "b" / "record.json").read_text())
    assert sorted(b["losses"]) == ["5", "6"] and b["step"] == a["step"] == 6
    assert {s: a["losses"][s] for s in ("5", "6")} == b["losses"]
    assert a["rng"] == b["rng"]
    final_a, final_b = _final(tmp_path / "a"), _final(tmp_path / "b")
    _assert_equal_tensors(final_a["model"], final_b["model"])
    _assert_equal_tensors({k: v for k, v in final_a["optimizer"].items() if isinstance(v, torch.Tensor)},
                          {k: v for k, v in final_b["optimizer"].items() if isinstance(v, torch.Tensor)})
    # keep_latest_k=2, and an asynchronous save holds the same bytes as a synchronous one.
    assert _steps(tmp_path / "a") == _steps(tmp_path / "b") == ["step-4", "step-6"]
    for step in ("step-4", "step-6"):
        report = resurgo.diff_checkpoints(tmp_path / "a" / "checkpoint" / step, tmp_path / "b" / "checkpoint" / step)
        assert report.identical, report


def test_fsdp_job_on_two_ranks_resumes_on_one(assets, tmp_path):
    """torchtitan's FSDP2 job on 2 gloo ranks; its checkpoint loads on 1 rank through resurgo's
    universal load (model and optimizer DTensors resharded), bit for bit. The data loader's
    position cannot be split (each rank reads its own shard): refused, naming the option that
    resumes everything else."""
    job = {"assets": str(assets), "steps": 2, "interval": 2}
    _run(2, {**job, "dump": str(tmp_path / "two")}, tmp_path)
    saved = resurgo.read_manifest(tmp_path / "two" / "checkpoint" / "step-2")
    assert saved.world["size"] == 2
    assert len(saved.tensors["model.tok_embeddings.weight"].chunks) == 2  # FSDP2 shards, one per rank

    final_two = _final(tmp_path / "two")
    (tmp_path / "two" / "final.pt").unlink()
    _run(1, {**job, "dump": str(tmp_path / "two"), "load_then_exclude_dataloader": True}, tmp_path)
    record = json.loads((tmp_path / "two" / "record.json").read_text())
    assert re.fullmatch(r"\S+step-2: key 'dataloader': the data loader's position was saved by 2 data-parallel "
                        r"ranks and cannot be split over 1.*exclude_from_loading=\['dataloader'\]", record["refused"])
    assert record["step"] == 2 and record["losses"] == {}  # resumed at step 2 of 2: nothing left to train
    final_one = _final(tmp_path / "two")
    _assert_equal_tensors(final_two["model"], final_one["model"])
    _assert_equal_tensors({k: v for k, v in final_two["optimizer"].items() if isinstance(v, torch.Tensor)},
                          {k: v for k, v in final_one["optimizer"].items() if isinstance(v, torch.Tensor)})
