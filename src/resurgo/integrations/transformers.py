"""Hugging Face Trainer: every checkpoint the Trainer writes a resurgo checkpoint, in one line.

``ResurgoTrainer`` is ``transformers.Trainer`` whose checkpoints (``output_dir/checkpoint-N``)
are resurgo checkpoints: model, optimizer, LR scheduler, grad scaler, every rank's RNG states and
the ``TrainerState`` in one checkpoint, checksummed and committed atomically, tensors never
pickled. Of a PEFT model, only its adapters and its base model's digest are saved, as the Trainer
saves only the adapters (:class:`resurgo.integrations.peft.AdapterOnly`).
``trainer.train(resume_from_checkpoint=...)`` resumes from them exactly as the Trainer resumes
from its own folders, and still resumes from a folder the Trainer wrote before resurgo was added
(read with ``torch.load(weights_only=True)``). ``save_total_limit`` deletes old checkpoints only
after the new one is committed, and never the newest: the Trainer's own deletion when training
ends (``save_total_limit=1`` with a best checkpoint) does not run. For a Trainer subclass (trl's
``SFTTrainer``, your own), put ``ResurgoTrainerMixin`` first:
``class MyTrainer(ResurgoTrainerMixin, SFTTrainer)``.

Why a Trainer subclass and not a callback: the Trainer writes and reads its checkpoint files
itself (``_save_checkpoint``, ``_load_*``), and a callback sees neither (``on_save`` runs after
the files are written and old ones rotated). The subclass replaces exactly those methods.

Needs the ``transformers`` package (``pip install 'resurgo[hf]'``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.training_args import ParallelMode

from resurgo.api import load, read_manifest, save
from resurgo.errors import CheckpointNotFoundError, KeyMismatchError, NotACheckpointError, UnsupportedValueError
from resurgo.integrations._retention import is_resurgo_checkpoint, prune
from resurgo.integrations._torch_file import load_torch_file
from resurgo.integrations._rng import ReplayableRng
from resurgo.integrations.peft import is_peft_model, model_state
from resurgo.state.rng import RNGState

__all__ = ["ResurgoTrainerMixin", "ResurgoTrainer"]

TRAINER_STATE_NAME = "trainer_state.json"
# The manifest metadata key listing the parts a checkpoint holds (save_only_model saves fewer).
PARTS_KEY = "transformers_trainer_parts"
# The manifest metadata key saying the model part holds a PEFT model's adapters only (AdapterOnly).
ADAPTERS_KEY = "transformers_trainer_adapters_only"
# The files of a checkpoint folder the plain Trainer writes that a resume reads besides the model.
_OPTIMIZER, _SCHEDULER, _SCALER = "optimizer.pt", "scheduler.pt", "scaler.pt"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class _Resume:
    """A resurgo checkpoint being resumed from: its parts and its TrainerState, read up front
    (the manifest only); tensors are loaded once every object exists."""

    def __init__(self, path: str, allow_pickle: bool) -> None:
        self.path, self.allow_pickle = path, allow_pickle
        metadata = read_manifest(path).metadata
        parts = metadata.get(PARTS_KEY)
        if not isinstance(parts, list):
            raise NotACheckpointError(
                f"{path}: a resurgo checkpoint, but not one a ResurgoTrainer wrote (its manifest metadata "
                f"has no {PARTS_KEY!r}); load it with resurgo.load_dict and hand its parts to the Trainer yourself")
        self.parts, self.adapters_only = parts, metadata.get(ADAPTERS_KEY) is True
        holder = {"trainer_state": ""}
        load(holder, path, strict=False)
        self.trainer_state_json: str = holder["trainer_state"]
        self.rng = ReplayableRng()

    def load_into(self, trainer: Trainer, held: dict) -> None:
        model = _model_target(trainer.model, self.adapters_only, self.path, held)
        objects = {"trainer_state": "", "model": model, "optimizer": trainer.optimizer,
                   "scheduler": trainer.lr_scheduler, "scaler": getattr(trainer.accelerator, "scaler", None),
                   "rng": self.rng}
        missing = [p for p in self.parts if objects.get(p) is None and p != "trainer_state"]
        if missing:
            raise KeyMismatchError(f"{self.path}: holds {', '.join(missing)} state that this Trainer has no object "
                                   "for (a grad scaler: the same fp16 settings as the run that saved it)", missing, [])
        load({p: objects[p] for p in self.parts}, self.path, allow_pickle=self.allow_pickle)
        self.rng.arm()  # the Trainer sets the RNG states again where it resumes the data (_load_rng_state)


# The mixin is used with a Trainer after it in the bases; type checkers see it as one.
if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class ResurgoTrainerMixin(_TrainerBase):
    """Put first in the bases of a ``transformers.Trainer`` subclass; see the module docstring.

    ``allow_pickle``: a value that is not plain data (a custom scheduler's state holding an
    object) is refused with UnsupportedValueError unless it is True, and the same flag is needed
    to load it back; for a folder the Trainer wrote before resurgo, it allows a full unpickle of
    its ``.pt`` files (default: ``weights_only``).
    """

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resurgo_allow_pickle = allow_pickle
        self._resurgo_resume: _Resume | None = None
        self._resurgo_adapters: dict = {}  # model_state's AdapterOnly of a PEFT model

    # -- resuming -----------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        self._resurgo_check_supported()
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # True: the Trainer's error
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and not os.path.isdir(resume_from_checkpoint):
            raise CheckpointNotFoundError(f"{resume_from_checkpoint}: no such checkpoint folder to resume from")
        if not isinstance(resume_from_checkpoint, (str, os.PathLike)) or not is_resurgo_checkpoint(resume_from_checkpoint):
            return super().train(resume_from_checkpoint, *args, **kwargs)
        self._resurgo_resume = _Resume(os.fspath(resume_from_checkpoint), self.resurgo_allow_pickle)
        try:
            # Trainer.train reads trainer_state.json from the folder it is given before any method
            # that could be overridden runs: it gets one holding only that file, from the checkpoint.
            with tempfile.TemporaryDirectory(prefix="resurgo-trainer-state-") as state_dir:
                Path(state_dir, TRAINER_STATE_NAME).write_text(self._resurgo_resume.trainer_state_json)
                return super().train(state_dir, *args, **kwargs)
        finally:
            self._resurgo_resume = None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resurgo_resume is not None:
            return  # loaded in place with the optimizer, once it exists (_load_optimizer_and_scheduler)
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # safetensors, or weights_only

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resurgo_resume is not None:
            self._resurgo_resume.load_into(self, self._resurgo_adapters)
            return
        if checkpoint is None:
            return
        optimizer, scheduler = os.path.join(checkpoint, _OPTIMIZER), os.path.join(checkpoint, _SCHEDULER)
        if os.path.isfile(optimizer) and os.path.isfile(scheduler):
            objects: Any = (self.optimizer, self.lr_scheduler)  # both exist by now
            objects[0].load_state_dict(self._resurgo_read_foreign(optimizer))
            objects[1].load_state_dict(self._resurgo_read_foreign(scheduler))

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resurgo_resume is not None or checkpoint is None:
            return
        scaler = os.path.join(checkpoint, _SCALER)
        if os.path.isfile(scaler):
            self.accelerator.scaler.load_state_dict(self._resurgo_read_foreign(scaler))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._resurgo_resume is not None:
            self._resurgo_resume.rng.replay()
            return
        if checkpoint is None:
            return
        name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
        if not os.path.isfile(os.path.join(checkpoint, name)):
            return super()._load_rng_state(checkpoint)  # the Trainer's own notice
        states = self._resurgo_read_foreign(os.path.join(checkpoint, name))
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        torch.random.set_rng_state(states["cpu"])
        if torch.cuda.is_available() and "cuda" in states:  # all devices' states when saved by a distributed run
            cuda = states["cuda"]
            if isinstance(cuda, list):
                torch.cuda.random.set_rng_state_all(cuda)
            else:
                torch.cuda.random.set_rng_state(cuda)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not is_resurgo_checkpoint(best):
            return super()._load_best_model()
        adapters_only = read_manifest(best).metadata.get(ADAPTERS_KEY) is True
        target = _model_target(self.model, adapters_only, best, self._resurgo_adapters)
        report = load({"model": target}, best, strict=False, allow_pickle=self.resurgo_allow_pickle)
        if report.missing_keys:
            raise KeyMismatchError(f"{best}: the best checkpoint lacks {report.missing_keys[:5]}",
                                   report.missing_keys, [])

    def _resurgo_read_foreign(self, path: str) -> Any:
        return load_torch_file(path, allow_pickle=self.resurgo_allow_pickle, what="a file the Trainer wrote",
                               fix="pass ResurgoTrainer(..., allow_pickle=True)")

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # With save_total_limit=1 and a best checkpoint, the Trainer deletes every other checkpoint
        # when training ends (shutil.rmtree, the newest included, which a resume needs). Only
        # resurgo's retention deletes: after a newer commit, never the newest nor the best. The
        # limit is hidden from that step alone (callbacks' on_train_end, inside it, see None too).
        limit = self.args.save_total_limit
        if limit != 1:
            return super()._finalize_training(*args, **kwargs)
        self.args.save_total_limit = None
        try:
            return super()._finalize_training(*args, **kwargs)
        finally:
            self.args.save_total_limit = limit

    # -- saving -------------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self._resurgo_track_best(run_dir, output_dir)
        if self.args.should_save:
            self._resurgo_export_callback_states()
        # A PEFT model: its adapters and the base model's digest, as the plain Trainer saves only the adapters.
        parts: dict[str, Any] = {"model": model_state(self.model, self._resurgo_adapters)}
        if not self.args.save_only_model:
            parts.update(optimizer=self.optimizer, scheduler=self.lr_scheduler)
            if getattr(self.accelerator, "scaler", None) is not None:
                parts["scaler"] = self.accelerator.scaler
            parts["rng"] = RNGState()  # what ReplayableRng loads
        parts["trainer_state"] = json.dumps(dataclasses.asdict(self.state), sort_keys=True)
        # Every rank calls (a collective save); a step saved again replaces its checkpoint atomically
        # and refuses (ForeignFilesError) a folder resurgo did not write.
        save(parts, output_dir, overwrite=True, allow_pickle=self.resurgo_allow_pickle,
             step=self.state.global_step,
             metadata={PARTS_KEY: sorted(parts), **({ADAPTERS_KEY: True} if is_peft_model(self.model) else {})})
        if self.args.should_save:
            self._resurgo_rotate(run_dir, output_dir)

    def _resurgo_track_best(self, run_dir: str, output_dir: str) -> None:
        """The Trainer's record of the best checkpoint (it protects it from rotation)."""
        if self.args.save_strategy not in ("steps", "epoch", "best") or not self.state.best_global_step:
            return
        if self.args.parallel_mode == ParallelMode.DISTRIBUTED:
            torch.distributed.barrier()
        best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
        if best == output_dir or os.path.exists(best):
            self.state.best_model_checkpoint = best

    def _resurgo_export_callback_states(self) -> None:
        """The states of stateful callbacks and of TrainerControl, into the TrainerState (as the Trainer does)."""
        stored: Any = self.state.stateful_callbacks  # a dict by name (annotated as a list)
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name, cb_state = type(cb).__name__, cb.state()
            if isinstance(stored[name], list):
                stored[name].append(cb_state)
            else:
                stored[name] = cb_state

    def _resurgo_rotate(self, run_dir: str, newest: str) -> None:
        """``save_total_limit``, once ``newest`` is committed: the lowest steps go first; the
        newest and the best checkpoint are kept (as the Trainer's own rotation does)."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        steps = {int(m.group(1)): p for p in Path(run_dir).iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()}
        checkpoints = [steps[k] for k in sorted(steps)]
        protected = {Path(newest)}
        if self.state.best_model_checkpoint is not None:
            protected.add(Path(self.state.best_model_checkpoint))
        prune(checkpoints, max(limit, len(protected)), protected, framework_marker=TRAINER_STATE_NAME)

    def _resurgo_check_supported(self) -> None:
        unsupported = [name for name, on in (("DeepSpeed", self.is_deepspeed_enabled), ("FSDP", self.is_fsdp_enabled),
                                             ("push_to_hub", self.args.push_to_hub)) if on]
        if unsupported:
            raise UnsupportedValueError(
                f"ResurgoTrainer does not support {', '.join(unsupported)} yet: train with transformers.Trainer "
                "for that (push_to_hub: push the final model with trainer.push_to_hub() after training)")


def _model_target(model: Any, adapters_only: bool, path: str, held: dict) -> Any:
    """What a checkpoint's model part loads into: the adapters of a PEFT model when only they were
    saved, else the model (a checkpoint of a whole PEFT model, saved before adapters were saved alone)."""
    if not adapters_only:
        return model
    if not is_peft_model(model):
        raise KeyMismatchError(f"{path}: holds the adapters of a PEFT model, and this Trainer's model is a "
                               f"{type(model).__name__}: wrap it with peft.get_peft_model(model, config) as when it "
                               "was saved", ["model"], [])
    return model_state(model, held)


class ResurgoTrainer(ResurgoTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are resurgo checkpoints; see the module docstring."""
