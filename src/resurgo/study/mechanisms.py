"""The checkpointing mechanisms the study compares, each written the way its users write it.

This module owns one small class per mechanism: ``save(job, path)`` is the call the training
loop is blocked in, ``wait()`` waits until an asynchronous save is complete, ``load(job, path)``
restores into a job's live objects and returns the step it restored (None when the mechanism does
not store it; the user then knows it from the checkpoint's name). Each class also states what
its checkpoint holds and whether loading one can execute code from the file: the facts of the
formats table, checked by the tests against the files written.

Multi-rank use (the scale experiment): every rank calls ``save``. torch.save and safetensors
users write from rank 0 only (the weights are replicated under data parallelism); DCP and
resurgo save collectively.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import resurgo
from resurgo.errors import StudyError
from resurgo.study.training import Training

__all__ = ["Mechanism", "MECHANISMS", "make_mechanism", "Stores", "quiet_single_process"]


@dataclass(frozen=True)
class Stores:
    """Which parts of the training state a checkpoint holds."""

    weights: bool
    optimizer: bool
    rng: bool
    data_position: bool


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


class Mechanism:
    """One way of checkpointing a :class:`Training`."""

    name = ""
    label = ""
    stores = Stores(weights=True, optimizer=True, rng=False, data_position=False)
    file_format = ""
    # can loading a checkpoint run code stored in it, and why
    executes_code = ""
    executes_code_note = ""
    fsync = False  # does the mechanism make the data durable (fsync) before reporting success

    def save(self, job: Training, path: Path) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        """Block until the last save is complete (a no-op for synchronous mechanisms)."""

    def load(self, job: Training, path: Path) -> Optional[int]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the mechanism holds (waits for an in-flight save)."""
        self.wait()


class TorchSave(Mechanism):
    name = "torch_save"
    label = "torch.save"
    file_format = "one pickle file (zip of pickled objects and raw tensor storages)"
    executes_code = "yes"
    executes_code_note = ("pickle: torch.load(weights_only=False), the default before torch 2.6, "
                          "runs any code in the file; torch>=2.6 defaults to weights_only=True, "
                          "which unpickles only allow-listed types")
    FILE = "checkpoint.pt"

    def save(self, job: Training, path: Path) -> None:
        if job.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            torch.save({"model": job.plain_model.state_dict(), "optimizer": job.optimizer.state_dict(),
                        "step": job.step}, path / self.FILE)

    def load(self, job: Training, path: Path) -> Optional[int]:
        ckpt = torch.load(path / self.FILE, map_location="cpu")
        job.plain_model.load_state_dict(ckpt["model"])
        job.optimizer.load_state_dict(ckpt["optimizer"])
        return int(ckpt["step"])


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process: it is right.
    (``async_save`` warns from its background thread: wrap the whole run to silence that too.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class DcpSync(Mechanism):
    name = "dcp"
    label = "DCP save"
    file_format = "one .distcp file per rank + .metadata (a pickle)"
    executes_code = "yes"
    executes_code_note = "the .metadata file is unpickled by dcp.load"
    fsync = True

    def _state(self, job: Training) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(job.model, job.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "step": job.step}

    def save(self, job: Training, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with quiet_single_process():
            dcp.save(self._state(job), checkpoint_id=str(path), no_dist=not _distributed())

    def load(self, job: Training, path: Path) -> Optional[int]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state(job)
        with quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
        set_state_dict(job.model, job.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        return int(state["step"])


class DcpAsync(DcpSync):
    name = "dcp_async"
    label = "DCP async_save"

    def __init__(self) -> None:
        self._pending: Optional[Future] = None
        self._group: Any = None

    def save(self, job: Training, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save in flight, as torchtitan does
        kwargs: dict[str, Any] = {"no_dist": not _distributed()}
        if _distributed():
            # The docs' advice: the background save's collectives get their own gloo group, so
            # they never interleave with the training's all-reduces on the default group.
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            kwargs["process_group"] = self._group
        with quiet_single_process():
            result = dcp.async_save(self._state(job), checkpoint_id=str(path), **kwargs)
        self._pending = result if isinstance(result, Future) else result.upload_completion

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()


class SafetensorsWeights(Mechanism):
    name = "safetensors"
    label = "safetensors (weights)"
    stores = Stores(weights=True, optimizer=False, rng=False, data_position=False)
    file_format = "one safetensors file (JSON header + raw tensors)"
    executes_code = "no"
    executes_code_note = "a JSON header and raw bytes"
    FILE = "model.safetensors"

    def save(self, job: Training, path: Path) -> None:
        from safetensors.torch import save_file

        if job.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            save_file(job.plain_model.state_dict(), str(path / self.FILE))

    def load(self, job: Training, path: Path) -> Optional[int]:
        from safetensors.torch import load_file

        job.plain_model.load_state_dict(load_file(str(path / self.FILE)))
        return None


class ResurgoSync(Mechanism):
    name = "resurgo"
    label = "resurgo.save"
    stores = Stores(weights=True, optimizer=True, rng=True, data_position=True)
    file_format = "manifest.json + safetensors data files"
    executes_code = "no"
    executes_code_note = "JSON and raw bytes; pickled values are refused unless allow_pickle=True"
    fsync = True

    def save(self, job: Training, path: Path) -> None:
        resurgo.save(job.state, path, step=job.step)

    def load(self, job: Training, path: Path) -> Optional[int]:
        resurgo.load(job.state, path)
        return job.step


class ResurgoAsync(ResurgoSync):
    name = "resurgo_async"
    label = "resurgo.async_save"
    guard = False

    def __init__(self) -> None:
        self._handle: Optional[resurgo.AsyncSaveHandle] = None

    def save(self, job: Training, path: Path) -> None:
        # resurgo keeps one save in flight itself: a new call waits for the previous one.
        kwargs: dict[str, Any] = {"guard": job.optimizer} if self.guard else {}
        self._handle = resurgo.async_save(job.state, path, step=job.step, **kwargs)

    def wait(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.wait()


class ResurgoAsyncGuard(ResurgoAsync):
    name = "resurgo_async_guard"
    label = "resurgo.async_save(guard=opt)"
    guard = True


MECHANISMS: dict[str, type[Mechanism]] = {
    m.name: m for m in (TorchSave, DcpSync, DcpAsync, SafetensorsWeights, ResurgoSync, ResurgoAsync,
                        ResurgoAsyncGuard)
}


def make_mechanism(name: str) -> Mechanism:
    try:
        return MECHANISMS[name]()
    except KeyError:
        raise StudyError(f"unknown mechanism {name!r}; expected one of {', '.join(MECHANISMS)}") from None
