"""A tiny Lightning fit with ResurgoCheckpointIO and ResurgoCallback (its module is imported by
tests/test_lightning.py; the SIGKILL test runs this file as a script).

    python tests/lightning_run.py ROOT STEPS [--hang-at STEP | --hang-in-save STEP]

fits to STEPS steps, resuming from ROOT's last.ckpt if there is one (``ckpt_path="last"``);
ModelCheckpoint saves every 2 steps (every one kept, and last.ckpt). It prints ``STEP n`` after
each step. ``--hang-at``: it stops after that step and waits to be killed. ``--hang-in-save``: the
save of last.ckpt at that step writes its data files, prints ``SAVING last.ckpt``, and waits to be
killed before committing (the previous last.ckpt is still in place).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import torch

from resurgo.integrations.lightning import ResurgoCallback, ResurgoCheckpointIO

BATCHES_PER_EPOCH = 4


class TinyBody:
    """Dropout and a shuffled loader: both draw from the global RNG every step. ``loader``:
    "plain" (torch's DataLoader, whose position ResurgoCallback makes resumable), "augment" (the
    same, its dataset adding noise from the global RNG as it loads each sample, in the main
    process), "stateful" (torchdata's StatefulDataLoader, whose position is its own), "elastic" (torch's
    DataLoader with resurgo's ElasticSampler), "stateful_elastic" (a StatefulDataLoader with
    an ElasticSampler), "workers" (torch's DataLoader with one persistent worker process) or
    "pairs" (torch's DataLoader, batches of 2).
    ``rank_seed``: each DDP process reseeds with its own seed, so that the processes draw different dropout masks."""

    def __init__(self, loader: str = "plain", rank_seed: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []
        # (current_epoch, global_step, batch_idx, the batch's inputs as floats) of each step
        self.trace: list[tuple[int, int, int, tuple[float, ...]]] = []
        # the grad scaler's state each step trains with (under a precision plugin that has one)
        self.scaler_trace: list[dict] = []
        self.loader = loader
        self.rank_seed = rank_seed

    def setup(self, stage):
        if self.rank_seed:  # before Lightning restores a checkpoint, which then sets the RNG back
            torch.manual_seed(1000 + self.global_rank)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.trace.append((self.current_epoch, self.global_step, batch_idx, tuple(x.flatten().tolist())))
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.scaler_trace.append(scaler.state_dict())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return train_loader(self.loader)


def train_loader(kind: str = "plain") -> torch.utils.data.DataLoader:
    """The shuffled loader of 16 samples, BATCHES_PER_EPOCH batches (the same data every time;
    "pairs": twice as many)."""
    g = torch.Generator().manual_seed(123)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    if kind == "augment":
        data = Augmented(data)
    if kind == "elastic":
        from resurgo import ElasticSampler

        return torch.utils.data.DataLoader(data, batch_size=4, sampler=ElasticSampler(data, seed=0))
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, batch_size=4, shuffle=True)
    if kind == "stateful_elastic":
        from torchdata.stateful_dataloader import StatefulDataLoader

        from resurgo import ElasticSampler

        return StatefulDataLoader(data, batch_size=4, sampler=ElasticSampler(data, seed=0))
    if kind == "pairs":
        return torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    if kind == "workers":
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


class Augmented(torch.utils.data.Dataset):
    """Each sample with noise from the global RNG, drawn when it is loaded."""

    def __init__(self, data: torch.utils.data.Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        x, y = self.data[i]
        return x + 0.1 * torch.randn(x.shape), y


class Tiny(TinyBody, L.LightningModule):
    pass


class Steps(L.Callback):
    def __init__(self, hang_at: int | None, echo: bool) -> None:
        self.hang_at, self.echo = hang_at, echo

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.echo:
            print(f"STEP {trainer.global_step}", flush=True)
        if trainer.global_step == self.hang_at:
            time.sleep(600)


def hang_in_the_save_of_last(step: int) -> type[ResurgoCheckpointIO]:
    """A ResurgoCheckpointIO whose save of last.ckpt at ``step`` stops before its commit."""
    from kill_harness import hang_before_commit

    armed: list[bool] = []
    hang_before_commit(lambda: bool(armed), "SAVING last.ckpt")

    class Hanging(ResurgoCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            if Path(path).name == "last.ckpt" and checkpoint.get("global_step") == step:
                armed.append(True)
            return super().save_checkpoint(checkpoint, path, storage_options)

    return Hanging


def fit(root: Path, steps: int, *, hang_at: int | None = None, hang_in_save: int | None = None,
        echo: bool = False) -> Tiny:
    """A fresh seeded job: it resumes from ``root``'s last.ckpt when there is one."""
    L.seed_everything(0)
    model = Tiny("plain")
    io = hang_in_the_save_of_last(hang_in_save)() if hang_in_save else ResurgoCheckpointIO()
    checkpoint = L.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = L.Trainer(max_steps=steps, deterministic=True, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        plugins=[io], callbacks=[checkpoint, ResurgoCallback(), Steps(hang_at, echo)])
    trainer.fit(model, ckpt_path="last")
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--hang-at", type=int)
    parser.add_argument("--hang-in-save", type=int)
    args = parser.parse_args()
    fit(args.root, args.steps, hang_at=args.hang_at, hang_in_save=args.hang_in_save, echo=True)
    sys.exit(0)
