"""Accelerate: ``accelerator.save_state`` / ``load_state`` through resurgo, in one line.

``ResurgoAccelerator`` is ``accelerate.Accelerator`` whose ``save_state`` writes one resurgo
checkpoint holding everything Accelerate saves (the prepared models, optimizers, schedulers and
data loader positions, the grad scaler, ``accelerator.step``, every process's RNG states, and the
objects registered with ``register_for_checkpointing``; of a PEFT model, only its adapters and
its base model's digest: :class:`resurgo.integrations.peft.AdapterOnly`): checksummed, committed atomically,
tensors never pickled. ``load_state`` reads it back, on the same or another number of processes,
and still reads a folder Accelerate wrote before resurgo was added (each of its pickles checked
first: tensors, plain containers and NumPy arrays only). With
``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=n)``, old checkpoints are
deleted only after the new one is committed, and ``load_state()`` resumes the iteration count
so that the next ``save_state()`` writes the next name.

Why a subclass and not ``register_save_state_pre_hook``: the hooks run after Accelerate has
already deleted the old checkpoints and created the folder, and Accelerate writes its own pickled
files whatever the hooks do; only replacing ``save_state`` and ``load_state`` gives one atomic
checkpoint and a safe retention.

Needs the ``accelerate`` package (``pip install 'resurgo[accelerate]'``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from resurgo.api import load, save
from resurgo.dist import comm as dist_comm
from resurgo.errors import CheckpointNotFoundError, UnsupportedValueError
from resurgo.integrations._retention import is_resurgo_checkpoint, prune
from resurgo.integrations._rng import ReplayableRng, replay_before_forward
from resurgo.integrations._torch_file import check_torch_file
from resurgo.integrations.peft import model_state

__all__ = ["ResurgoAccelerator"]

_CHECKPOINT = re.compile(r"^checkpoint_(\d+)$")  # automatic_checkpoint_naming's folder names
_ACCELERATE_MARKER = "random_states_0.pkl"  # in every folder Accelerate's own save_state writes
_PICKLE_SUFFIXES = (".bin", ".pkl", ".pt")


class ResurgoAccelerator(Accelerator):
    """``accelerate.Accelerator`` with ``save_state`` and ``load_state`` through resurgo; see the
    module docstring. ``allow_pickle``: custom objects whose state is not plain data are refused
    (UnsupportedValueError) unless it is True, and a folder Accelerate wrote before resurgo is
    read even if its pickles hold other objects; the same flag is needed to load them back."""

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resurgo_allow_pickle = allow_pickle
        self._resurgo_rng = ReplayableRng()
        self._resurgo_adapters: dict = {}  # model_state's AdapterOnly of each PEFT model

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Path:
        self._resurgo_check_supported()
        auto = self.project_configuration.automatic_checkpoint_naming
        if auto:
            output_dir = os.path.join(self.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")
        if output_dir is None:
            raise UnsupportedValueError("save_state(): no output_dir, and automatic_checkpoint_naming is off")
        state = self._resurgo_state()
        state["iteration"] = self.save_iteration
        # Saved inside an epoch (not at its last batch): the resumed loop builds a new iterator
        # (drawing from the RNG) where this run kept its own, so the RNG states are set again
        # right before the first forward after the load.
        state["mid_epoch"] = self.gradient_state.in_dataloader and not self.gradient_state.end_of_dataloader
        # Every process calls (a collective save): replicated tensors are written once, each
        # process's RNG states apart. An existing folder is refused (CheckpointExistsError).
        save(state, output_dir, allow_pickle=self.resurgo_allow_pickle, step=self.step)
        if auto and self.project_configuration.total_limit is not None:
            # The main process prunes; a refusal there (ForeignFilesError) is raised on every
            # process, which would otherwise wait at the barrier below for it forever.
            prune = lambda: self._resurgo_prune(Path(output_dir)) if self.is_main_process else None  # noqa: E731
            dist_comm.current("control").agree(prune)
        self.wait_for_everyone()
        self.project_configuration.iteration += 1
        return Path(output_dir)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        self._resurgo_check_supported()
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            found = _numbered(Path(self.project_dir, "checkpoints"))
            if not found:
                raise CheckpointNotFoundError(f"{Path(self.project_dir, 'checkpoints')}: no checkpoint_<n> to load")
            input_dir = str(found[-1])
        if input_dir is None:
            raise UnsupportedValueError("load_state(): no input_dir, and automatic_checkpoint_naming is off")
        if not os.path.isdir(input_dir):
            raise CheckpointNotFoundError(f"{input_dir}: no such checkpoint folder")
        if not is_resurgo_checkpoint(input_dir):
            return self._resurgo_load_foreign(input_dir, load_kwargs, **kwargs)
        state = self._resurgo_state()
        state.update(iteration=0, mid_epoch=False)
        load(state, input_dir, allow_pickle=self.resurgo_allow_pickle)
        self.step = state["step"]
        if state["mid_epoch"]:
            replay_before_forward(self._resurgo_rng, self._models)
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = state["iteration"] + 1  # the next save's name is free

    def _resurgo_state(self) -> dict[str, Any]:
        """What Accelerate saves, as one tree: the same on save and as the target of a load."""
        # Keys independent of DDP wrapping; of a PEFT model, its adapters and its base model's digest.
        models = [model_state(self.unwrap_model(m), self._resurgo_adapters) for m in self._models]
        state: dict[str, Any] = {
            "step": self.step, "models": models, "optimizers": list(self._optimizers),
            "schedulers": list(self._schedulers), "dataloaders": [_LoaderPosition(dl) for dl in self._dataloaders],
            "custom": list(self._custom_objects),
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler
        state["rng"] = self._resurgo_rng  # last: restoring anything after it could draw random numbers
        return state

    def _resurgo_prune(self, newest: Path) -> None:
        checkpoints = _numbered(newest.parent)
        prune(checkpoints, max(self.project_configuration.total_limit, 1), {newest}, framework_marker=_ACCELERATE_MARKER)

    def _resurgo_load_foreign(self, input_dir: str, load_kwargs: dict | None, **kwargs: Any) -> None:
        """A folder Accelerate wrote before resurgo: every pickle in it is checked first (read, not
        run), then Accelerate loads it; the next ``save_state`` writes a resurgo checkpoint."""
        if not self.resurgo_allow_pickle:
            for name in sorted(os.listdir(input_dir)):
                if name.endswith(_PICKLE_SUFFIXES):
                    check_torch_file(os.path.join(input_dir, name), what="a file Accelerate wrote",
                                     fix="pass ResurgoAccelerator(..., allow_pickle=True)")
        super().load_state(input_dir, load_kwargs, **kwargs)
        if self.project_configuration.automatic_checkpoint_naming:
            match = _CHECKPOINT.match(Path(input_dir).name)
            if match:
                self.project_configuration.iteration = int(match.group(1)) + 1

    def _resurgo_check_supported(self) -> None:
        sharded = self.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                            DistributedType.MEGATRON_LM, DistributedType.XLA)
        hooks = self._save_model_state_pre_hook or self._load_model_state_pre_hook
        if sharded or hooks:
            what = f"distributed type {self.distributed_type}" if sharded else "save/load state pre-hooks"
            raise UnsupportedValueError(
                f"ResurgoAccelerator does not support {what} yet: use accelerate.Accelerator for that run")


class _LoaderPosition:
    """The position of a prepared data loader: its epoch (which a seedable sampler's order
    depends on, ``use_seedable_sampler=True``; Accelerate does not save it), a stateful loader's
    state (``use_stateful_dataloader=True``: the batches of the epoch already taken), and an
    iterable dataset's seedable sampler (its seed and epoch, as Accelerate saves it)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def _sampler(self) -> Any:
        from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler

        if isinstance(getattr(self.loader, "dataset", None), IterableDatasetShard):
            sampler = self.loader.get_sampler()
            if isinstance(sampler, SeedableRandomSampler):
                return sampler
        return None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if hasattr(self.loader, "iteration"):
            # Saved at an epoch's last batch, the loader counts the epoch as done only once the
            # loop asks for one more batch: the next epoch is the one to resume, from its start.
            done = bool(getattr(self.loader, "end_of_dataloader", False))
            state["epoch"], state["epoch_done"] = self.loader.iteration + int(done), done
        if getattr(self.loader, "use_stateful_dataloader", False):
            state["loader"] = self.loader.state_dict()
        sampler = self._sampler()
        if sampler is not None:
            state["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "epoch" in state:
            self.loader.set_epoch(state["epoch"])
        if "loader" in state:
            # After a finished epoch, the next loop starts the next epoch afresh: its new iterator
            # draws from the RNG as the uninterrupted run's did (a finished state would first
            # run an empty pass).
            self.loader.load_state_dict({} if state.get("epoch_done") else state["loader"])
        sampler = self._sampler()
        if sampler is not None and "sampler" in state:
            sampler.epoch, sampler.initial_seed = state["sampler"]["epoch"], state["sampler"]["initial_seed"]


def _numbered(root: Path) -> list[Path]:
    """The ``checkpoint_<n>`` folders under ``root``, by ``n``."""
    if not root.is_dir():
        return []
    found = {int(m.group(1)): p for p in root.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()}
    return [found[n] for n in sorted(found)]
