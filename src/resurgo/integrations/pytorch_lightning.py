"""PyTorch Lightning under its older package name, ``pytorch_lightning``: the same plugin,
callback and strategies as :mod:`resurgo.integrations.lightning`, derived from that package's base classes
(a Trainer of ``pytorch_lightning`` accepts only its own package's plugins and callbacks).

Needs the ``pytorch_lightning`` package (``pip install 'resurgo[pytorch-lightning]'``).
"""

from __future__ import annotations

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy

from resurgo.integrations.lightning_base import CheckpointIOMethods, RngCallbackMethods, ShardedStrategyMethods

__all__ = ["ResurgoCheckpointIO", "ResurgoCallback", "ResurgoModelParallelStrategy", "ResurgoFSDPStrategy"]


class ResurgoCheckpointIO(CheckpointIOMethods, CheckpointIO):
    """A ``pytorch_lightning`` CheckpointIO plugin that saves and loads resurgo checkpoints
    (the options of :class:`resurgo.integrations.lightning.ResurgoCheckpointIO`)."""


class ResurgoCallback(RngCallbackMethods, Callback):
    """Saves and restores the RNG states of every process and a plain DataLoader's data position
    (see :class:`resurgo.integrations.lightning.ResurgoCallback`)."""


class ResurgoModelParallelStrategy(ShardedStrategyMethods, ModelParallelStrategy):
    """``pytorch_lightning``'s ModelParallelStrategy saving resurgo checkpoints from every process
    (see :class:`resurgo.integrations.lightning.ResurgoModelParallelStrategy`)."""


class ResurgoFSDPStrategy(ShardedStrategyMethods, FSDPStrategy):
    """``pytorch_lightning``'s FSDPStrategy saving resurgo checkpoints from every process
    (see :class:`resurgo.integrations.lightning.ResurgoFSDPStrategy`)."""
