"""PyTorch Lightning (the ``lightning`` package): every checkpoint a resurgo checkpoint, and an
exact resume, in one line each.

``Trainer(plugins=[ResurgoCheckpointIO()])`` makes each file Lightning asks for (ModelCheckpoint's
top-k and last, ``trainer.save_checkpoint``) a resurgo checkpoint directory: checksummed,
committed atomically, tensors never pickled; Lightning's retention removes only checkpoints
resurgo can prove it wrote. ``ResurgoCheckpointIO(asynchronous=True)`` saves in the background
from a snapshot. ``Trainer(callbacks=[ResurgoCallback()])`` adds what Lightning does not save,
the RNG states of every process and a plain DataLoader's data position, and sets them back at the
moment that makes the resumed ``fit`` draw the same numbers and the same batches as an
uninterrupted one. The strategies that shard the model
(``ModelParallelStrategy``, ``FSDPStrategy``) bypass CheckpointIO: ``ResurgoModelParallelStrategy``
and ``ResurgoFSDPStrategy`` save their checkpoints with resurgo from every process.

Needs the ``lightning`` package (``pip install 'resurgo[lightning]'``); for the
``pytorch_lightning`` package use :mod:`resurgo.integrations.pytorch_lightning`.
"""

from __future__ import annotations

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from resurgo.integrations.lightning_base import CheckpointIOMethods, RngCallbackMethods, ShardedStrategyMethods

__all__ = ["ResurgoCheckpointIO", "ResurgoCallback", "ResurgoModelParallelStrategy", "ResurgoFSDPStrategy"]


class ResurgoCheckpointIO(CheckpointIOMethods, CheckpointIO):
    """A Lightning CheckpointIO plugin that saves and loads resurgo checkpoints.

    ``allow_pickle``: values that are not plain data (an object in ``save_hyperparameters``, a
    custom callback state) are refused with UnsupportedValueError unless it is True; the same flag
    is needed to load them back. A path that holds a ``.ckpt`` file written by Lightning's own
    CheckpointIO is read with ``torch.load(weights_only=True)`` (``allow_pickle=True``: a full
    unpickle), so a run started without resurgo resumes with it; its next save is a resurgo one.
    ``asynchronous``: save in the background from a snapshot (see CheckpointIOMethods).
    """


class ResurgoCallback(RngCallbackMethods, Callback):
    """Saves the RNG states (Python, NumPy, torch CPU and CUDA) of every process in each
    checkpoint and restores them where the resumed run's next draw matches the uninterrupted run's,
    and makes each plain DataLoader the fit trains on resumable, so that its data position is
    saved and restored with the loops' state (see RngCallbackMethods)."""


class ResurgoModelParallelStrategy(ShardedStrategyMethods, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 and tensor parallel, set up in ``configure_model``) whose
    checkpoints are resurgo checkpoints, saved by every process and loadable on any number of
    processes. Takes ModelParallelStrategy's arguments, and ``allow_pickle`` and ``verify``."""


class ResurgoFSDPStrategy(ShardedStrategyMethods, FSDPStrategy):
    """``FSDPStrategy`` whose checkpoints are sharded resurgo checkpoints, saved by every process
    and loadable on any number of processes (whatever its ``state_dict_type``). Takes
    FSDPStrategy's arguments, and ``allow_pickle`` and ``verify``."""
