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
from resurgo.integrations.lightning import ResurgoCallback, ResurgoCheckpointIO  # noqa: E402

BATCHES_PER_EPOCH = 4


class Tiny(L.LightningModule):
    """Dropout and a shuffled loader: both draw from the global RNG every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(123)
        data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


def trainer(root: Path, max_steps: int, callbacks: list, **kw) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, deterministic=True, accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     plugins=[ResurgoCheckpointIO()], callbacks=callbacks, **kw)


def fit(root: Path, max_steps: int, *, callback: bool, ckpt_path=None, save_every=None) -> Tiny:
    """A fresh seeded run; with ``save_every``, ModelCheckpoint saves every that many steps, in
    the middle of training as a preempted job's last checkpoint was."""
    L.seed_everything(0)
    model = Tiny()
    callbacks = [ResurgoCallback()] if callback else []
    if save_every is not None:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=save_every, save_top_k=-1))
    t = trainer(root, max_steps, callbacks, enable_checkpointing=save_every is not None)
    t.fit(model, ckpt_path=ckpt_path)
    return model


def bitwise_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("stop", [2 * BATCHES_PER_EPOCH])  # an epoch boundary: the loader is rebuilt
def test_resumed_fit_is_bit_identical_and_not_without_the_callback(tmp_path, stop):
    total = 3 * BATCHES_PER_EPOCH
    whole = fit(tmp_path / "whole", total, callback=True)
    first = fit(tmp_path / "first", stop, callback=True, save_every=stop)
    ckpt = tmp_path / "first" / f"epoch={stop // BATCHES_PER_EPOCH - 1}-step={stop}.ckpt"
    assert (ckpt / "manifest.json").is_file()
    resumed = fit(tmp_path / "resumed", total, callback=True, ckpt_path=ckpt)

    assert len(first.losses) == stop and len(resumed.losses) == total - stop
    assert all(bitwise_equal(a, b) for a, b in zip(whole.losses, first.losses + resumed.losses))
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert bitwise_equal(a, b), name
    opt_whole = whole.trainer.optimizers[0].state_dict()["state"]
    opt_resumed = resumed.trainer.optimizers[0].state_dict()["state"]
    assert opt_whole.keys() == opt_resumed.keys()
    for k in opt_whole:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert bitwise_equal(opt_whole[k][field], opt_resumed[k][field]), (k, field)

    # Control: the same checkpoint without the callback's RNG states resumes onto other draws.
    blind = fit(tmp_path / "blind", total, callback=False, ckpt_path=ckpt)
    assert len(blind.losses) == total - stop
    assert not all(bitwise_equal(a, b) for a, b in zip(whole.losses[stop:], blind.losses))


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


def test_resumes_from_a_ckpt_file_of_lightnings_own_checkpoint_io_and_saves_resurgo(tmp_path):
    L.seed_everything(0)
    model = Tiny()
    plain = L.Trainer(max_steps=BATCHES_PER_EPOCH, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    plain.fit(model)
    plain.save_checkpoint(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt").is_file()  # torch.save's zip file

    again = Tiny()
    t = trainer(tmp_path, 2 * BATCHES_PER_EPOCH, [ResurgoCallback()], enable_checkpointing=False)
    t.fit(again, ckpt_path=tmp_path / "old.ckpt")
    assert t.global_step == 2 * BATCHES_PER_EPOCH
    t.save_checkpoint(tmp_path / "new.ckpt")
    assert resurgo.load_dict(tmp_path / "new.ckpt")["global_step"] == 2 * BATCHES_PER_EPOCH


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
