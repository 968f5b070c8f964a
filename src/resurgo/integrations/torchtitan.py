"""torchtitan: its checkpoints written and read by resurgo, in one line of the job's config.

``ResurgoCheckpointManager`` is a torchtitan checkpoint manager (``BaseCheckpointManager``, the
contract torchtitan's Trainer calls: ``load``, ``save``, ``maybe_wait_for_staging``, ``close``).
Put its ``Config`` where the job's config has torchtitan's ``CheckpointManager.Config``: the Trainer
builds whichever manager the config names. Every ``step-N`` folder is then one resurgo checkpoint
of the model parts, optimizers, LR schedulers, data loader and train state (the ``states`` the
Trainer hands over), plus every rank's RNG states: checksummed, committed atomically, tensors
never pickled, DTensor (FSDP2, TP) state loadable on another number of ranks. The data loader's
state is saved as plain values, without the pickle torchtitan's loader wraps it in.

torchtitan's policies keep their meaning: ``interval``, ``enable_first_step_checkpoint``,
``last_save_model_only`` and ``export_dtype``, ``keep_latest_k`` (old checkpoints deleted only
after the new one is committed, and only what resurgo wrote or torchtitan's DCP manager wrote
there before), ``load_step``, ``initial_load_path`` / ``initial_load_model_only``,
``exclude_from_loading``, ``load_only`` and ``async_mode`` (through :func:`resurgo.async_save`).

Needs the ``torchtitan`` package (``pip install 'resurgo[torchtitan]'``).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.checkpointer.base import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, ModelWrapper
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from resurgo.api import AsyncSaveHandle, async_save, load, read_manifest, save
from resurgo.errors import (CheckpointNotFoundError, KeyMismatchError, PickleNotAllowedError, UnsupportedValueError,
                            WorldSizeMismatchError)
from resurgo.integrations._retention import is_resurgo_checkpoint, prune
from resurgo.integrations._rng import ReplayableRng, replay_before_forward
from resurgo.reports import SaveReport
from resurgo.state.per_rank import PerRank

__all__ = ["ResurgoCheckpointManager"]

RNG = "rng"
PARTS_KEY = "torchtitan_parts"  # the manifest metadata key listing the states a checkpoint holds
_STEP = re.compile(r"^step-(\d+)$")  # torchtitan's checkpoint folder names
_DCP_MARKER = ".metadata"  # in every folder torchtitan's own (DCP) manager writes


class ResurgoCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, backed by resurgo; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """With "async" or "async_with_pinned_mem", each save returns once its snapshot is taken and
        is written and committed in the background (resurgo.async_save); "disabled": synchronous."""

        allow_pickle: bool = False
        """Store (and load) state that is not plain data pickled; refused by default."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise UnsupportedValueError(f"checkpoint.async_mode={self.async_mode!r}: expected "
                                            "'disabled', 'async' or 'async_with_pinned_mem'")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.save_future: Future | None = None
        if "://" in f"{base_folder}/{config.folder}":
            raise UnsupportedValueError(f"checkpoint folder {base_folder}/{config.folder}: ResurgoCheckpointManager "
                                        "writes to a local or mounted folder; use torchtitan's CheckpointManager for URLs")
        self.folder = Path(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: _LoaderPosition(dataloader) if dataloader is not None else None,
                            LR_SCHEDULER: lr_schedulers})
        self.rng = ReplayableRng()
        self.model_parts = model_parts
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        for flag in ("initial_load_in_hf", "last_save_in_hf"):
            if getattr(config, flag):
                raise UnsupportedValueError(f"checkpoint.{flag}=True: Hugging Face safetensors checkpoints are not "
                                            "written or read by ResurgoCheckpointManager; use torchtitan's "
                                            "CheckpointManager for that run, or `resurgo convert --to hf`")
        self._pending: tuple[AsyncSaveHandle, Path] | None = None  # an asynchronous save and its path
        logger.info(f"resurgo checkpointing active: checkpoints are loaded from and saved to {self.folder}")

    def __del__(self) -> None:
        self.close()

    # -- save ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()  # one save in flight at a time, as torchtitan does
        begin = time.monotonic()
        path = self.folder / f"step-{curr_step}"
        if last_step and self.config.last_save_model_only:
            state: dict[str, Any] = {MODEL: self._export_model()}
        else:
            state = self._full_state()
        metadata = {PARTS_KEY: sorted(state)}
        if self.config.async_mode != "disabled" and not last_step:
            # async_save returns once every tensor is copied out: the next optimizer step may
            # change them. The retention runs once the checkpoint is committed, in this thread
            # (the next save, or close), so that its errors are raised to the training loop.
            handle = async_save(state, path, overwrite=True, allow_pickle=self.config.allow_pickle,
                                step=curr_step, metadata=metadata)
            self._pending = (handle, path)
            self.save_future = Future()  # torchtitan's "a save is in flight"; resolved by _wait_for_saving
        else:
            save(state, path, overwrite=True, allow_pickle=self.config.allow_pickle, step=curr_step, metadata=metadata)
            self._prune(path)
        logger.info(f"resurgo: {'staged' if self._pending else 'saved'} {path} in {time.monotonic() - begin:.2f} s")
        return True

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _full_state(self) -> dict[str, Any]:
        """What a checkpoint holds, the same on save and as the target of a load: every state
        torchtitan handed over, the RNG states last (restoring anything after them could draw)."""
        state = {key: value for key, value in self.states.items() if value is not None}
        state[RNG] = self.rng
        return state

    def _export_model(self) -> dict[str, Any]:
        """The model's state dict for a final model-only checkpoint, floats in ``export_dtype``."""
        dtype = self.export_dtype
        return {key: value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.dtype != dtype else value for key, value in self.states[MODEL].state_dict().items()}

    def _prune(self, newest: Path) -> None:
        """keep_latest_k, on rank 0, once ``newest`` is committed."""
        if self.config.keep_latest_k <= 0 or (dist.is_initialized() and dist.get_rank() != 0):
            return
        prune(_numbered(self.folder), self.config.keep_latest_k, {newest}, framework_marker=_DCP_MARKER)

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an asynchronous save has its snapshot when ``save`` returns."""

    def _wait_for_saving(self) -> None:
        pending, self._pending, future, self.save_future = self._pending, None, self.save_future, None
        if pending is None or future is None:
            return
        handle, path = pending
        try:
            report: SaveReport = handle.wait()
        except BaseException as err:
            future.set_exception(err)
            raise
        future.set_result(report)
        self._prune(path)

    def _close(self) -> None:
        # getattr: __del__ can reach here on an object whose __init__ raised half-way.
        if getattr(self, "_pending", None) is not None:
            self._wait_for_saving()

    # -- load ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        found = {int(m.group(1)): p for p in _numbered(self.folder) if (m := _STEP.match(p.name))}
        if step != -1 and step not in found:
            raise CheckpointNotFoundError(f"{self.folder / f'step-{step}'}: no checkpoint of checkpoint.load_step="
                                          f"{step} (steps found: {sorted(found) or 'none'})")
        if found:
            step = step if step != -1 else max(found)
            # The folder's own checkpoints win over initial_load_path (torchtitan's restart rule);
            # step 0 is a seed checkpoint, which holds the model only.
            path, model_only = found[step], step == 0
        elif self.config.initial_load_path:
            path, model_only = Path(self.config.initial_load_path), self.config.initial_load_model_only
            if not path.is_dir():
                raise CheckpointNotFoundError(f"{path}: checkpoint.initial_load_path is not a checkpoint folder")
        else:
            logger.info("resurgo: no checkpoint to load, this is a fresh start")
            return False
        begin = time.monotonic()
        if not is_resurgo_checkpoint(path) and Path(path, _DCP_MARKER).is_file():
            self._load_dcp(path, model_only)
        else:
            self._load_resurgo(path, model_only)
        logger.info(f"resurgo: loaded {path} in {time.monotonic() - begin:.2f} s")
        return True

    def _target(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return {MODEL: self.states[MODEL]}
        for key in self.config.exclude_from_loading:
            if key not in self.states and key != RNG:
                raise KeyMismatchError(f"checkpoint.exclude_from_loading names {key!r}, which is not a state of this "
                                       f"job (states: {sorted(self.states)}, {RNG!r})", unexpected=[key])
        return {k: v for k, v in self._full_state().items() if k not in self.config.exclude_from_loading}

    def _load_resurgo(self, path: Path, model_only: bool) -> None:
        target = self._target(model_only)
        parts = read_manifest(path).metadata.get(PARTS_KEY)
        if parts is not None and not set(target) <= set(parts):
            raise KeyMismatchError(f"{path}: the checkpoint holds {', '.join(parts)}, not {', '.join(sorted(set(target) - set(parts)))}; "
                                   "a model-only checkpoint (last_save_model_only, a seed checkpoint) is loaded as "
                                   "checkpoint.initial_load_path with initial_load_model_only=True, or leave the other "
                                   "states out with checkpoint.exclude_from_loading", missing=sorted(set(target) - set(parts)))
        # strict=False lets a subset (model only, exclude_from_loading) be loaded; every key of that
        # subset must still be in the checkpoint.
        report = load(target, path, strict=False, allow_pickle=self.config.allow_pickle)
        if report.missing_keys:
            shown = ", ".join(report.missing_keys[:5]) + (", ..." if len(report.missing_keys) > 5 else "")
            raise KeyMismatchError(f"{path}: the checkpoint lacks {len(report.missing_keys)} key(s) this job loads "
                                   f"({shown})", missing=report.missing_keys)
        if RNG in target:
            # torchtitan builds its data iterator after the load, and that draws from the RNG
            # where the uninterrupted run drew nothing: the states are set again before the first forward.
            replay_before_forward(self.rng, self.model_parts)

    def _load_dcp(self, path: Path, model_only: bool) -> None:
        """A step folder torchtitan's DCP manager wrote before resurgo was added: read as torchtitan
        reads it (DCP, flattened model keys), if pickle is allowed; the next save is a resurgo
        checkpoint."""
        import torch.distributed.checkpoint as dcp

        if not self.config.allow_pickle:
            raise PickleNotAllowedError(
                f"{path}: a checkpoint torchtitan's own manager wrote (DCP), whose {_DCP_MARKER} and data loader "
                "state are pickles, run when read. If you trust it, set allow_pickle=True in "
                "ResurgoCheckpointManager.Config for the run that loads it; the next save is a resurgo checkpoint")
        target = self._target(model_only)
        target.pop(RNG, None)  # DCP checkpoints hold no RNG states
        model = target.pop(MODEL)
        loader = target.get(DATALOADER)
        if loader is not None:
            target[DATALOADER] = loader.loader  # torchtitan's own (pickled) form
        flat = {**target, **model.state_dict()}
        dcp.load(flat, checkpoint_id=str(path))
        model.load_state_dict(flat)


class _LoaderPosition:
    """The data loader's position as plain values, per rank. torchtitan's loader wraps its
    ``StatefulDataLoader`` state in a pickle keyed by DP rank; this saves that state itself, and
    restores it without unpickling anything. Another loader is saved through its own
    ``state_dict``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> PerRank:
        if isinstance(self.loader, StatefulDataLoader):
            value = {"dp_world_size": getattr(self.loader, "dp_world_size", 1),
                     "loader": StatefulDataLoader.state_dict(self.loader)}
        else:
            value = {"state": self.loader.state_dict()}
        return PerRank(value, on_resize=lambda saved, rank, world: _raise_resized(len(saved), world))

    def load_state_dict(self, state_dict: Any) -> None:
        value = state_dict.value if isinstance(state_dict, PerRank) else state_dict
        if "loader" in value:
            if value["dp_world_size"] != getattr(self.loader, "dp_world_size", 1):
                _raise_resized(value["dp_world_size"], self.loader.dp_world_size)
            StatefulDataLoader.load_state_dict(self.loader, value["loader"])
        else:
            self.loader.load_state_dict(value["state"])


def _raise_resized(saved_ranks: int, ranks: int) -> Any:
    raise WorldSizeMismatchError(
        f"the data loader's position was saved by {saved_ranks} data-parallel ranks and cannot be split over "
        f"{ranks}: each rank reads its own shard of the dataset. "
        f"To resume the model, optimizer, LR scheduler, train state and RNG states and restart the data from "
        f"the start of each rank's shard, set checkpoint.exclude_from_loading=['{DATALOADER}']")


def _numbered(folder: Path) -> list[Path]:
    """The ``step-N`` checkpoint folders under ``folder`` (resurgo's, and DCP's torchtitan wrote), by N."""
    if not folder.is_dir():
        return []
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()
             and (is_resurgo_checkpoint(p) or Path(p, _DCP_MARKER).is_file())}
    return [found[n] for n in sorted(found)]
