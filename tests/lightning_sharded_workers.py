"""Lightning fits with ResurgoModelParallelStrategy (FSDP2) or ResurgoFSDPStrategy (FSDP1) on gloo
processes (run by tests/test_lightning_sharded.py through dist_harness.run_ranks).

The processes are started by the harness, so Lightning is told so (``LOCAL_RANK``) and joins the
process group they already have. FSDP1 refuses a CPU-only machine unless it is given the CPU as
its device, which Lightning's FSDPStrategy does not pass: the model wraps itself in
``configure_model`` with ``device_id=cpu`` (Lightning then keeps that wrapping).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as L
import torch

from resurgo.integrations.lightning import (
    ResurgoCallback,
    ResurgoFSDPStrategy,
    ResurgoModelParallelStrategy,
)

SAMPLES, BATCH = 24, 2


class Sharded(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Dropout(0.25), torch.nn.Linear(6, 3))
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.kind.endswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        elif not isinstance(self.net, torch.distributed.fsdp.FullyShardedDataParallel):
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"), use_orig_params=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, 3, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=BATCH)


def full_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state (collective), by flat key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.strategy.model, trainer.optimizers,
                                        options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.clone() for k, v in model_sd.items()}
    for name, st in optim_sd["state"].items():
        out.update({f"optim.{name}.{field}": v.clone() for field, v in st.items()})
    return out


class AtStart(L.Callback):
    """Records the full state as the first resumed step sees it (after the checkpoint is loaded)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.state = full_state(trainer)


def fit(rank: int, world: int, root: str, kind: str, steps: int, ckpt_path: str | None = None,
        allow_pickle: bool = False) -> dict:
    """``kind``: "fsdp2" (ResurgoModelParallelStrategy), "fsdp1" (ResurgoFSDPStrategy), or
    "lightning-fsdp2" (Lightning's own ModelParallelStrategy, which writes DCP folders, without
    ResurgoCallback: a job from before resurgo was added). ``allow_pickle``: resurgo's strategy's."""
    os.environ["LOCAL_RANK"] = str(rank)  # the processes exist already: Lightning launches none
    # All processes data parallel (by default ModelParallelStrategy gives them to tensor parallelism).
    if kind == "fsdp1":
        strategy = ResurgoFSDPStrategy(allow_pickle=allow_pickle)
    elif kind == "lightning-fsdp2":
        strategy = L.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = ResurgoModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                                allow_pickle=allow_pickle)
    checkpoint = L.callbacks.ModelCheckpoint(dirpath=Path(root, "ckpts"), every_n_train_steps=2, save_top_k=2,
                                             monitor="train_loss", save_last=True)
    at_start = AtStart()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=world, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                        callbacks=[checkpoint, at_start] + ([] if kind == "lightning-fsdp2" else [ResurgoCallback()]))
    model = Sharded("fsdp2" if kind == "lightning-fsdp2" else kind)
    trainer.fit(model, ckpt_path=ckpt_path)
    return {"start": at_start.state, "end": full_state(trainer), "losses": model.losses,
            "global_step": trainer.global_step, "best": sorted(Path(p).name for p in checkpoint.best_k_models)}
