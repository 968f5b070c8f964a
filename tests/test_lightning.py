"""PyTorch Lightning with ResurgoCheckpointIO and ResurgoCallback: exact resume, ModelCheckpoint's
files are verified resurgo checkpoints, and its retention deletes only what resurgo wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

L = pytest.importorskip("lightning.pytorch")

import resurgo  # noqa: E402
import resurgo.cli  # noqa: E402
from resurgo.errors import ForeignFilesError, NotACheckpointError  # noqa: E402
from lightning_run import BATCHES_PER_EPOCH, Tiny, TinyBody, train_loader  # noqa: E402
from resurgo.integrations.lightning import ResurgoCallback, ResurgoCheckpointIO  # noqa: E402


def trainer(root: Path, max_steps: int, callbacks: list, plugins: tuple = (), **kw) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, deterministic=True, accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     plugins=[ResurgoCheckpointIO(), *plugins], callbacks=callbacks, **kw)


class TinyData(L.LightningDataModule):
    def __init__(self, loader: str) -> None:
        super().__init__()
        self.loader = loader

    def train_dataloader(self):
        return train_loader(self.loader)


def fit(root: Path, max_steps: int, *, callback: bool, ckpt_path=None, save_every=None, loader="plain",
        source="module", plugins: tuple = (), **kw) -> Tiny:
    """A fresh seeded run; with ``save_every``, ModelCheckpoint saves every that many steps, in
    the middle of training as a preempted job's last checkpoint was. ``source``: where Lightning
    gets the (same) train loader: the module's train_dataloader, a datamodule's, or fit's argument."""
    L.seed_everything(0)
    model = Tiny(loader)
    callbacks = [ResurgoCallback()] if callback else []
    if save_every is not None:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1))
    t = trainer(root, max_steps, callbacks, plugins, enable_checkpointing=save_every is not None, **kw)
    data = {"module": {}, "datamodule": {"datamodule": TinyData(loader)},
            "fit": {"train_dataloaders": train_loader(loader)}}[source]
    t.fit(model, ckpt_path=ckpt_path, **data)
    return model


def bitwise_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def ckpt_of(root: Path, step: int, batches_per_epoch: int = BATCHES_PER_EPOCH) -> Path:
    """ModelCheckpoint's file of ``step`` (a step at an epoch's end belongs to that epoch)."""
    return root / f"epoch={(step - 1) // batches_per_epoch}-step={step}.ckpt"


def assert_follows(whole: Tiny, resumed: Tiny, step: int) -> None:
    """``resumed``, a fit resumed from step ``step``, trained as ``whole`` did from there on: the same
    epochs, steps, batch indices and batches, the same losses, weights and optimizer state, bit for bit."""
    assert len(resumed.losses) == len(whole.losses) - step, step
    assert resumed.trace == whole.trace[step:], step
    assert resumed.scaler_trace == whole.scaler_trace[step:], step
    assert (resumed.trainer.current_epoch, resumed.trainer.global_step) == \
        (whole.trainer.current_epoch, whole.trainer.global_step)
    assert all(bitwise_equal(a, b) for a, b in zip(whole.losses[step:], resumed.losses)), step
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert bitwise_equal(a, b), (step, name)
    opt_whole = whole.trainer.optimizers[0].state_dict()["state"]
    opt_resumed = resumed.trainer.optimizers[0].state_dict()["state"]
    assert opt_whole.keys() == opt_resumed.keys()
    for k in opt_whole:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert bitwise_equal(opt_whole[k][field], opt_resumed[k][field]), (step, k, field)


@pytest.mark.parametrize("loader, resume_at", [
    # torch's DataLoader: the callback makes its position resumable, at an epoch's end and mid-epoch
    # (saved through a datamodule's loader, resumed with the module's and with one given to fit).
    ("plain", {BATCHES_PER_EPOCH: "module", BATCHES_PER_EPOCH + 2: "fit"}),
    ("augment", {BATCHES_PER_EPOCH: "module", BATCHES_PER_EPOCH + 2: "module"}),  # noise drawn while loading
    # torchdata's StatefulDataLoader: its own position
    ("stateful", {BATCHES_PER_EPOCH: "module", BATCHES_PER_EPOCH + 2: "module"}),
    # resurgo's ElasticSampler, in torch's DataLoader and in a StatefulDataLoader
    ("elastic", {BATCHES_PER_EPOCH: "module", BATCHES_PER_EPOCH + 2: "module"}),
    ("stateful_elastic", {BATCHES_PER_EPOCH: "module", BATCHES_PER_EPOCH + 2: "module"}),
])
def test_resumed_fit_is_bit_identical_and_not_without_the_callback(tmp_path, loader, resume_at):
    total, stop = 3 * BATCHES_PER_EPOCH, BATCHES_PER_EPOCH + 2
    whole = fit(tmp_path / "whole", total, callback=True, loader=loader)
    first = fit(tmp_path / "first", stop, callback=True, save_every=2, loader=loader,
                source="datamodule" if loader == "plain" else "module")
    assert len(first.losses) == stop and all(bitwise_equal(a, b) for a, b in zip(whole.losses, first.losses))
    for step, source in resume_at.items():
        ckpt = ckpt_of(tmp_path / "first", step)
        assert (ckpt / "manifest.json").is_file()
        resumed = fit(tmp_path / f"resumed{step}", total, callback=True, ckpt_path=ckpt, loader=loader, source=source)
        assert_follows(whole, resumed, step)

    # Control: without the callback, the mid-epoch resume trains on other draws and other batches.
    # (A StatefulDataLoader's checkpoint holds its position anyway; a plain DataLoader's only with
    # the callback, so that run is saved without it too.)
    if not loader.startswith("stateful"):
        fit(tmp_path / "blind_first", stop, callback=False, save_every=stop, loader=loader)
    ckpt = ckpt_of(tmp_path / ("blind_first" if not loader.startswith("stateful") else "first"), stop)
    blind = fit(tmp_path / "blind", total, callback=False, ckpt_path=ckpt, loader=loader)
    assert len(blind.losses) == total - stop
    assert not all(bitwise_equal(a, b) for a, b in zip(whole.losses[stop:], blind.losses))


@pytest.mark.parametrize("loader", ["plain", "stateful", "elastic", "stateful_elastic", "workers"])
def test_a_limited_epoch_resumes_exactly_from_its_last_batch_and_mid_epoch(tmp_path, loader):
    """limit_train_batches below the loader's length (3 of its 4 batches): a checkpoint at a limited
    epoch's last batch, where the loader itself is mid-epoch, resumes at the next epoch, and one
    saved mid-epoch at the next batch, as the uninterrupted run trained."""
    limit = BATCHES_PER_EPOCH - 1
    total, stop = 3 * limit, 2 * limit
    whole = fit(tmp_path / "whole", total, callback=True, loader=loader, limit_train_batches=limit)
    assert [epoch for epoch, *_ in whole.trace] == [e for e in range(3) for _ in range(limit)]
    if loader == "workers":  # the loader Lightning trained on still has its persistent worker
        trained_on = whole.trainer.train_dataloader
        assert (trained_on.num_workers, trained_on.persistent_workers) == (1, True)
    fit(tmp_path / "first", stop, callback=True, save_every=2, loader=loader, limit_train_batches=limit)
    for step in (stop, 4):  # epoch 1's last batch; its first
        resumed = fit(tmp_path / f"resumed{step}", total, callback=True, ckpt_path=ckpt_of(tmp_path / "first", step, limit),
                      loader=loader, limit_train_batches=limit)
        assert_follows(whole, resumed, step)


def fp16_on_cpu():
    """Lightning's 16-mixed precision on CPU, with a grad scaler (Trainer(precision="16-mixed")
    falls back to bf16-mixed on CPU, which has none): fp16 autocast, and a scale that doubles every
    2 steps, so that each step trains with another scaler state."""
    from lightning.pytorch.plugins import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2))


def test_a_grad_scalers_state_resumes_exactly_at_an_epochs_end_and_mid_epoch(tmp_path):
    total, stop = 2 * BATCHES_PER_EPOCH, BATCHES_PER_EPOCH + 1
    whole = fit(tmp_path / "whole", total, callback=True, plugins=(fp16_on_cpu(),))
    scales = [state["scale"] for state in whole.scaler_trace]
    assert scales == [2.0**8 * 2 ** (s // 2) for s in range(total)], scales  # no overflow: every step grew it
    assert {state["_growth_tracker"] for state in whole.scaler_trace} == {0, 1}
    fit(tmp_path / "first", stop, callback=True, save_every=1, plugins=(fp16_on_cpu(),))
    assert resurgo.load_dict(ckpt_of(tmp_path / "first", stop))["MixedPrecision"] == {
        "scale": 2.0**8 * 2 ** (stop // 2), "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2,
        "_growth_tracker": stop % 2}
    for step in (BATCHES_PER_EPOCH, stop):  # the epoch's last batch; the next epoch's first
        resumed = fit(tmp_path / f"resumed{step}", total, callback=True, ckpt_path=ckpt_of(tmp_path / "first", step),
                      plugins=(fp16_on_cpu(),))
        assert len(resumed.scaler_trace) == total - step
        assert_follows(whole, resumed, step)
        final = resumed.trainer.precision_plugin.scaler.state_dict()
        assert final == whole.trainer.precision_plugin.scaler.state_dict()


def test_an_elastic_sampler_resumed_mid_epoch_on_another_world_size_is_refused_naming_the_counts():
    """Mid-epoch, the batches before the checkpoint were counted on the world size that saved it and
    the rest of the epoch is batched on this one: when they do not add up to the epoch's length,
    Lightning's epoch would end elsewhere than the loader's, so the callback refuses."""
    from types import SimpleNamespace

    from resurgo import ElasticSampler
    from resurgo.errors import DataPositionError
    from resurgo.integrations.lightning_base import refuse_elastic_sampler_mid_epoch
    from resurgo.state.data_position import track_dataloader

    data = train_loader().dataset  # 16 samples, batches of 4

    def loader(world: int):
        return track_dataloader(torch.utils.data.DataLoader(data, batch_size=4, sampler=ElasticSampler(
            data, num_replicas=world, rank=0, seed=0)), finished_epoch="next")

    def resumed_fit(world: int):
        resumed = loader(world)
        resumed.load_state_dict(saved)
        iter(resumed)  # Lightning builds the iterator before the fit starts
        progress = SimpleNamespace(current=SimpleNamespace(ready=1))
        return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
                               num_training_batches=len(resumed), train_dataloader=resumed, ckpt_path="last.ckpt")

    saving = loader(2)  # 8 samples per rank: 2 batches
    next(iter(saving))
    saved = saving.state_dict()  # 8 of the 16 samples consumed
    refuse_elastic_sampler_mid_epoch(resumed_fit(2))  # 1 + 1 batches: the epoch's 2
    with pytest.raises(DataPositionError, match=r"last\.ckpt: .*ElasticSampler .*epoch 0, saved on another number of "
                                                r"processes .*: its rest of the epoch is 2 batches on 1 process, while "
                                                r"Lightning resumes at batch 1 of 4"):
        refuse_elastic_sampler_mid_epoch(resumed_fit(1))  # 1 + 2 batches, of 4


def test_model_checkpoint_files_are_resurgo_checkpoints_and_top_k_removes_them(tmp_path):
    dirpath = tmp_path / "ckpts"
    mc = L.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=2, monitor="train_loss",
                                     save_last=True)
    L.seed_everything(0)
    model = Tiny()
    t = trainer(tmp_path, 3 * BATCHES_PER_EPOCH, [mc, ResurgoCallback()])
    t.fit(model)

    names = sorted(p.name for p in dirpath.iterdir())
    # 6 saves of top-k: retention removed 4 of them, leaving the 2 best, and last.ckpt.
    assert len(names) == 3 and "last.ckpt" in names, names
    assert set(names) == {Path(p).name for p in mc.best_k_models} | {"last.ckpt"}
    runner = CliRunner()
    for name in names:
        result = runner.invoke(resurgo.cli.app, ["verify", str(dirpath / name)])
        assert result.exit_code == 0, result.output
        manifest = json.loads((dirpath / name / "manifest.json").read_text())
        assert manifest["pickled"] is False
        loaded = resurgo.load_dict(dirpath / name)  # allow_pickle=False: nothing in it is pickled
        assert loaded["global_step"] == manifest["step"]
        assert isinstance(loaded["state_dict"]["net.0.weight"], torch.Tensor)
    assert resurgo.load_dict(dirpath / "last.ckpt")["global_step"] == 3 * BATCHES_PER_EPOCH

    # ckpt_path="last" resumes from ModelCheckpoint's last.ckpt, a resurgo checkpoint.
    L.seed_everything(0)
    again = Tiny()
    mc2 = L.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=2,
                                      monitor="train_loss", save_last=True)
    trainer(tmp_path, 4 * BATCHES_PER_EPOCH, [mc2, ResurgoCallback()]).fit(again, ckpt_path="last")
    assert len(again.losses) == BATCHES_PER_EPOCH
    assert resurgo.load_dict(dirpath / "last.ckpt")["global_step"] == 4 * BATCHES_PER_EPOCH


def test_remove_checkpoint_deletes_only_what_resurgo_wrote(tmp_path):
    io = ResurgoCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 3}, tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()

    foreign = tmp_path / "b.ckpt"
    foreign.write_bytes(b"not resurgo")
    with pytest.raises(NotACheckpointError, match="b.ckpt"):
        io.remove_checkpoint(foreign)
    assert foreign.read_bytes() == b"not resurgo"

    io.save_checkpoint({"global_step": 4}, tmp_path / "c.ckpt")
    (tmp_path / "c.ckpt" / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFilesError):
        io.remove_checkpoint(tmp_path / "c.ckpt")
    assert (tmp_path / "c.ckpt" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "c.ckpt" / "manifest.json").is_file()


class StartState(L.Callback):
    """The weights and optimizer state a fit starts training from (after any checkpoint is loaded)."""

    def on_train_start(self, trainer, pl_module):
        self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optimizer = tensors_in(trainer.optimizers[0].state_dict()["state"])


def tensors_in(optimizer_state: dict) -> dict:
    return {(k, f): v.clone() for k, s in optimizer_state.items() for f, v in s.items()}


def test_resumes_from_a_ckpt_file_of_lightnings_own_checkpoint_io_and_saves_resurgo(tmp_path):
    L.seed_everything(0)
    model = Tiny()
    plain = L.Trainer(max_steps=BATCHES_PER_EPOCH, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    plain.fit(model)
    plain.save_checkpoint(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt").is_file()  # torch.save's zip file
    saved_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_optimizer = tensors_in(plain.optimizers[0].state_dict()["state"])

    L.seed_everything(1)  # another initialisation: only the load can give back the saved weights
    again, start = Tiny(), StartState()
    t = trainer(tmp_path, 2 * BATCHES_PER_EPOCH, [ResurgoCallback(), start], enable_checkpointing=False)
    t.fit(again, ckpt_path=tmp_path / "old.ckpt")
    assert len(again.losses) == BATCHES_PER_EPOCH and t.global_step == 2 * BATCHES_PER_EPOCH
    assert start.weights.keys() == saved_weights.keys()
    assert all(bitwise_equal(start.weights[k], saved_weights[k]) for k in saved_weights)
    assert start.optimizer.keys() == saved_optimizer.keys() and saved_optimizer
    assert all(bitwise_equal(start.optimizer[k], saved_optimizer[k]) for k in saved_optimizer)
    t.save_checkpoint(tmp_path / "new.ckpt")
    assert resurgo.load_dict(tmp_path / "new.ckpt")["global_step"] == 2 * BATCHES_PER_EPOCH
    assert resurgo.read_manifest(tmp_path / "new.ckpt").pickled is False


class Opaque:
    """A class weights_only loading refuses (module-level so that torch.save can pickle it)."""


def test_a_ckpt_file_that_needs_unpickling_is_refused_naming_it_and_the_flag(tmp_path):
    from resurgo.errors import PickleNotAllowedError

    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": Opaque()}, tmp_path / "old.ckpt")
    with pytest.raises(PickleNotAllowedError, match=r"old\.ckpt: .*holds test_lightning\.Opaque.*allow_pickle=True"):
        ResurgoCheckpointIO().load_checkpoint(tmp_path / "old.ckpt")
    loaded = ResurgoCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "old.ckpt")
    assert isinstance(loaded["hyper_parameters"], Opaque)


def test_a_value_that_is_not_plain_is_refused_naming_its_key_unless_pickle_is_allowed(tmp_path):
    from resurgo.errors import UnsupportedValueError

    checkpoint = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"encoder": Opaque()}}
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters\.encoder.*allow_pickle=True"):
        ResurgoCheckpointIO().save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    io = ResurgoCheckpointIO(allow_pickle=True)
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert isinstance(io.load_checkpoint(tmp_path / "a.ckpt")["hyper_parameters"]["encoder"], Opaque)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Lightning checkpoint, by its flat key."""
    out: dict[str, torch.Tensor] = {}

    def walk(node, key):
        if isinstance(node, torch.Tensor):
            out[key] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}")

    walk(resurgo.load_dict(path), "")
    return out


def test_asynchronous_saves_hold_the_step_they_were_asked_for(tmp_path):
    """Saved in the background while training goes on, each checkpoint holds exactly the
    weights and optimizer state of its step: the same bytes as a synchronous save's."""
    def run(root: Path, io: ResurgoCheckpointIO) -> list[Path]:
        L.seed_everything(0)
        mc = L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1)
        t = L.Trainer(max_steps=2 * BATCHES_PER_EPOCH, deterministic=True, accelerator="cpu", devices=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=[io], callbacks=[mc, ResurgoCallback()])
        t.fit(Tiny())
        return sorted(root.iterdir())

    background = ResurgoCheckpointIO(asynchronous=True)
    saved_async = run(tmp_path / "async", background)
    saved_sync = run(tmp_path / "sync", ResurgoCheckpointIO())
    assert [p.name for p in saved_async] == [p.name for p in saved_sync] and len(saved_sync) == 2 * BATCHES_PER_EPOCH
    assert background._in_flight == {}  # teardown waited for every save
    for a, b in zip(saved_async, saved_sync):
        ta, tb = tensors_of(a), tensors_of(b)
        assert ta.keys() == tb.keys() and any("exp_avg" in k for k in ta)
        assert all(bitwise_equal(ta[k], tb[k]) for k in ta), a.name


def test_an_asynchronous_save_holds_its_tensors_as_they_were_when_it_returned(tmp_path):
    """Snapshot semantics, directly: the caller changes the tensors in place as soon as
    save_checkpoint returns, before the background write can have committed."""
    weight = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: its write outlasts the in-place change
    expected = weight.clone()
    io = ResurgoCheckpointIO(asynchronous=True)
    io.save_checkpoint({"state_dict": {"w": weight}, "global_step": 1}, tmp_path / "a.ckpt")
    assert io._in_flight  # in the background
    weight.add_(1.0)
    io.teardown()
    assert bitwise_equal(resurgo.load_dict(tmp_path / "a.ckpt")["state_dict"]["w"], expected)


def test_an_asynchronous_save_error_is_raised_by_the_next_call_that_waits(tmp_path):
    from resurgo.errors import ForeignFilesError

    io = ResurgoCheckpointIO(asynchronous=True)
    target = tmp_path / "a.ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFilesError, match="notes.txt"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, target)
        io.teardown()
    assert (target / "notes.txt").read_text() == "mine"
    io.teardown()  # raised once, then forgotten


def test_pytorch_lightning_package_resumes_bit_identically(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from resurgo.integrations.pytorch_lightning import ResurgoCallback as PLCallback
    from resurgo.integrations.pytorch_lightning import ResurgoCheckpointIO as PLCheckpointIO

    def run(root: Path, steps: int, ckpt_path=None, save_every=None) -> PLTiny:
        pl.seed_everything(0)
        model = PLTiny()
        callbacks = [PLCallback()]
        if save_every:
            callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1))
        pl.Trainer(max_steps=steps, deterministic=True, accelerator="cpu", devices=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(save_every),
                   plugins=[PLCheckpointIO()], callbacks=callbacks).fit(model, ckpt_path=ckpt_path)
        return model

    stop = BATCHES_PER_EPOCH + 2  # mid-epoch, with a plain DataLoader
    whole = run(tmp_path / "whole", 2 * BATCHES_PER_EPOCH)
    run(tmp_path / "first", stop, save_every=stop)
    ckpt = ckpt_of(tmp_path / "first", stop)
    assert (ckpt / "manifest.json").is_file()
    resumed = run(tmp_path / "resumed", 2 * BATCHES_PER_EPOCH, ckpt_path=ckpt)
    assert len(resumed.losses) == 2 * BATCHES_PER_EPOCH - stop
    assert all(bitwise_equal(a, b) for a, b in zip(whole.losses[stop:], resumed.losses))
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert bitwise_equal(a, b), name


try:
    import pytorch_lightning as _pl

    class PLTiny(TinyBody, _pl.LightningModule):
        pass
except ImportError:  # pragma: no cover - the lightning extra brings pytorch_lightning
    pass


@pytest.mark.slow  # about 40 s: four two-process fits
def test_ddp_processes_each_get_their_own_rng_states_back_under_a_batch_limit(tmp_path):
    """Two DDP processes (ddp_spawn, gloo) draw different dropout masks: each process's RNG
    states go into the checkpoint and come back to that process. Under limit_train_batches (3 of
    each process's 4 batches), a checkpoint at an epoch's last batch, where the DistributedSampler
    is part way through its pass, resumes at the next epoch, and one saved mid-epoch resumes at
    its next batch: each process trains on what it trained on in the uninterrupted run, and the
    resumed run ends with its weights, bit for bit."""
    limit = 3

    def run(root: Path, steps: int, ckpt_path=None, save_every=None) -> Tiny:
        L.seed_everything(0)
        model = Tiny("pairs", rank_seed=True)  # 16 samples in pairs: 4 batches per process
        callbacks = [ResurgoCallback(), RankProgress(root)]
        if save_every:
            callbacks.append(L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1))
        L.Trainer(max_steps=steps, deterministic=True, accelerator="cpu", devices=2, strategy="ddp_spawn",
                  logger=False, enable_progress_bar=False, enable_model_summary=False, limit_train_batches=limit,
                  enable_checkpointing=bool(save_every), default_root_dir=root,
                  plugins=[ResurgoCheckpointIO()], callbacks=callbacks).fit(model, ckpt_path=ckpt_path)
        return model

    total, stop = 3 * limit, limit + 1
    whole = run(tmp_path / "whole", total)
    run(tmp_path / "first", stop, save_every=1)
    for step in (limit, stop):  # epoch 0's last batch; epoch 1's first
        ckpt = ckpt_of(tmp_path / "first", step, limit)
        per_rank = resurgo.load_dict(ckpt)["callbacks"]["ResurgoCallback"]["rng_per_rank"]
        assert len(per_rank) == 2 and not torch.equal(per_rank[0]["torch"], per_rank[1]["torch"])
        resumed = run(tmp_path / f"resumed{step}", total, ckpt_path=ckpt)
        for rank in (0, 1):
            whole_rank, resumed_rank = (RankProgress.read(tmp_path / name, rank) for name in ("whole", f"resumed{step}"))
            assert [epoch for epoch, *_ in whole_rank["trace"]] == [e for e in range(3) for _ in range(limit)]
            assert len(resumed_rank["trace"]) == total - step
            # The same epochs, steps and batches as the uninterrupted run from there on, per process.
            assert resumed_rank["trace"] == whole_rank["trace"][step:], (step, rank)
            assert (resumed_rank["current_epoch"], resumed_rank["global_step"]) == \
                (whole_rank["current_epoch"], whole_rank["global_step"]), (step, rank)
        for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
            assert bitwise_equal(a, b), (step, name)


class RankProgress(L.Callback):
    """Each DDP process's step trace, current_epoch and global_step at the end of its fit, written
    to ``root/progress-rank{r}.json`` (ddp_spawn hands only rank 0's weights back to the caller)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_fit_end(self, trainer, pl_module):
        self.root.mkdir(parents=True, exist_ok=True)
        progress = {"trace": pl_module.trace, "current_epoch": trainer.current_epoch,
                    "global_step": trainer.global_step}
        (self.root / f"progress-rank{trainer.global_rank}.json").write_text(json.dumps(progress))

    @staticmethod
    def read(root: Path, rank: int) -> dict:
        progress = json.loads((root / f"progress-rank{rank}.json").read_text())
        progress["trace"] = [tuple(step) for step in progress["trace"]]
        return progress


@pytest.mark.parametrize("kill", [
    "in_save",  # while last.ckpt of step 8 is being written over the one of step 6
    pytest.param("between_saves", marks=pytest.mark.slow),  # after step 7, last.ckpt holding step 6
])
def test_sigkill_mid_training_then_resume_from_last_is_bit_identical(tmp_path, kill):
    import os

    import lightning_run
    from kill_harness import kill_on_line

    total = 3 * BATCHES_PER_EPOCH
    whole = lightning_run.fit(tmp_path / "whole", total)
    root = tmp_path / "killed"
    hang, wait_for = (["--hang-in-save", "8"], "SAVING last.ckpt") if kill == "in_save" else (["--hang-at", "7"], "STEP 7")
    kill_on_line([lightning_run.__file__, str(root), str(total), *hang], wait_for)
    names = sorted(os.listdir(root))
    committed = [f"epoch=1-step={s}.ckpt" for s in (6, 8)] if kill == "in_save" else ["epoch=1-step=6.ckpt"]
    assert [n for n in names if not n.startswith(".")] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                                           *committed, "last.ckpt"]
    if kill == "in_save":  # the save that was killed left only its temporary directory
        assert [n.split(".resurgo-tmp-")[0] for n in names if n.startswith(".")] == [".last.ckpt"]
    assert resurgo.read_manifest(root / "last.ckpt").step == 6

    resumed = lightning_run.fit(root, total)  # ckpt_path="last": the committed last.ckpt, of step 6
    assert len(resumed.losses) == total - 6
    # The same epochs, steps and batch indices as the uninterrupted run from step 6 on.
    assert resumed.trace == whole.trace[6:]
    assert (resumed.trainer.current_epoch, resumed.trainer.global_step) == \
        (whole.trainer.current_epoch, whole.trainer.global_step)
    assert all(bitwise_equal(a, b) for a, b in zip(whole.losses[6:], resumed.losses))
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert bitwise_equal(a, b), name
    assert resurgo.read_manifest(root / "last.ckpt").step == total


def test_a_fit_loop_without_the_known_data_source_is_refused_naming_the_stateful_loader():
    """The plain DataLoader's position needs the fit loop's data source of the Lightning versions
    resurgo knows: if a Lightning version changes it, the callback refuses instead of resuming inexactly."""
    from types import SimpleNamespace

    from resurgo.errors import DataPositionError
    from resurgo.integrations.lightning_base import track_train_dataloaders

    with pytest.raises(DataPositionError, match=r"_data_source is object.*StatefulDataLoader"):
        track_train_dataloaders(SimpleNamespace(fit_loop=SimpleNamespace(_data_source=object())))
    with pytest.raises(DataPositionError, match=r"_data_source is NoneType"):
        track_train_dataloaders(SimpleNamespace())
