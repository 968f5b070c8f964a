"""PyTorch Lightning: every checkpoint a resurgo checkpoint, and an exact resume, in one line each.

``Trainer(plugins=[ResurgoCheckpointIO()])`` makes each file Lightning asks for (ModelCheckpoint's
top-k and last, ``trainer.save_checkpoint``) a resurgo checkpoint directory: checksummed,
committed atomically, tensors never pickled; Lightning's retention removes only checkpoints
resurgo can prove it wrote. ``Trainer(callbacks=[ResurgoCallback()])`` adds what Lightning does
not save, the RNG states, and sets them back at the moment that makes the resumed ``fit`` draw
the same numbers as an uninterrupted one.

Needs the ``lightning`` package (``pip install 'resurgo[lightning]'``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

from resurgo.api import load_dict, save
from resurgo.errors import NotACheckpointError
from resurgo.integrations._torch_file import load_torch_file
from resurgo.manager.catalog import remove
from resurgo.state.rng import capture_rng_state, restore_rng_state
from resurgo.storage.open import open_root

__all__ = ["ResurgoCheckpointIO", "ResurgoCallback"]


def _plain(value: Any) -> Any:
    """Lightning's dict subclasses (OrderedDict state dicts, AttributeDict hyper-parameters) as
    plain dicts, which resurgo stores as JSON; any other value is left for resurgo to judge."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


class ResurgoCheckpointIO(CheckpointIO):
    """A Lightning CheckpointIO plugin that saves and loads resurgo checkpoints.

    ``allow_pickle``: values that are not plain data (an object in ``save_hyperparameters``, a
    custom callback state) are refused with UnsupportedValueError unless it is True; the same flag
    is needed to load them back. A path that holds a ``.ckpt`` file written by Lightning's own
    CheckpointIO is read with ``torch.load(weights_only=True)`` (``allow_pickle=True``: a full
    unpickle), so a run started without resurgo resumes with it; its next save is a resurgo one.
    """

    def __init__(self, *, allow_pickle: bool = False, verify: bool = True) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.verify = verify

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        step = checkpoint.get("global_step")
        # Lightning saves "last.ckpt" again and again: overwrite replaces a resurgo checkpoint
        # atomically and refuses (ForeignFilesError) anything resurgo did not write.
        save(_plain(checkpoint), path, overwrite=True, allow_pickle=self.allow_pickle,
             step=step if isinstance(step, int) else None)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        if Path(path).is_file():
            return self._load_foreign(Path(path), map_location)
        return load_dict(path, verify=self.verify, allow_pickle=self.allow_pickle)

    def _load_foreign(self, path: Path, map_location: Any) -> dict[str, Any]:
        return load_torch_file(path, allow_pickle=self.allow_pickle, map_location=map_location or "cpu",
                               what="a Lightning checkpoint", fix="pass ResurgoCheckpointIO(allow_pickle=True)")

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        target = Path(path)
        if not target.exists():
            return
        if not target.is_dir():
            raise NotACheckpointError(
                f"{target}: not a resurgo checkpoint (a file), so ResurgoCheckpointIO does not delete it; "
                "remove it yourself if it is not needed")
        # Deletes only what resurgo wrote (else ForeignFilesError, nothing deleted), crash-safely.
        remove(open_root(target.parent), target.name)


class ResurgoCallback(Callback):
    """Saves the RNG states (Python, NumPy, torch CPU and CUDA) in every checkpoint and restores
    them where the resumed run's next draw matches the uninterrupted run's.

    Resumed at an epoch boundary, the uninterrupted run's next draws build the next epoch's data
    iterator, which Lightning builds right after loading: the states are restored on loading.
    Resumed mid-epoch, the uninterrupted run kept its iterator, while the resumed run builds a new
    one (drawing from the RNG): the states are set again right before the first resumed step.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"rng": capture_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict["rng"]
        restore_rng_state(self._pending)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._pending is None:
            return
        if batch_idx > 0:  # resumed mid-epoch: undo the draws of the rebuilt iterator
            restore_rng_state(self._pending)
        self._pending = None
