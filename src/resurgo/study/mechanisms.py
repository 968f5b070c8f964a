"""The checkpointing mechanisms the study and the benchmarks compare, each written the way its
users write it.

This module owns one small class per mechanism: ``save(job, path)`` is the call the training
loop is blocked in; it returns None when the checkpoint is complete on return, else a callable
that blocks until that save is complete (and returns resurgo's SaveReport). ``wait()`` waits until
the last save is complete, ``load(job, path)`` restores into a job's live objects and returns the
step it restored (None when the mechanism does not store it; the user then knows it from the
checkpoint's name). Each class also states what its checkpoint holds and whether loading one can
execute code from the file: the facts of the formats table, checked by the tests against the
files written. The job is a :class:`~resurgo.study.training.Training`, the study's or a
benchmark's.

``make_durable``: torch.save and safetensors leave their files unsynced and DCP its directories;
a benchmark that measures the time to durable passes what syncs a written checkpoint, and the
mechanism runs it before its save counts as complete. resurgo commits durably itself.

Multi-rank use (the scale experiment): every rank calls ``save``. torch.save and safetensors
users write from rank 0 only (the weights are replicated under data parallelism); DCP and
resurgo save collectively.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
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

__all__ = ["Mechanism", "MECHANISMS", "DcpAsyncStager", "make_mechanism", "Stores",
           "quiet_single_process"]


Completion = Callable[[], Any]


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

    def __init__(self, make_durable: Optional[Callable[[Path], None]] = None) -> None:
        self.make_durable = make_durable
        self._pending: Optional[Completion] = None

    def save(self, job: Training, path: Path) -> Optional[Completion]:
        raise NotImplementedError

    def wait(self) -> None:
        """Block until the last save is complete (a no-op for synchronous mechanisms)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def load(self, job: Training, path: Path) -> Optional[int]:
        raise NotImplementedError

    def facts(self) -> dict[str, Any]:
        """What the mechanism reports about its last save (a benchmark records it)."""
        return {}

    def close(self) -> None:
        """Release what the mechanism holds (waits for an in-flight save)."""
        self.wait()

    def _written(self, path: Path) -> None:
        """The library's files are written: make them durable if asked (rank 0 alone may write)."""
        if self.make_durable is not None and path.exists():
            self.make_durable(path)


class TorchSave(Mechanism):
    name = "torch_save"
    label = "torch.save"
    file_format = "one pickle file (zip of pickled objects and raw tensor storages)"
    executes_code = "yes"
    executes_code_note = ("pickle: torch.load(weights_only=False), the default before torch 2.6, "
                          "runs any code in the file; torch>=2.6 defaults to weights_only=True, "
                          "which unpickles only allow-listed types")
    FILE = "checkpoint.pt"

    def save(self, job: Training, path: Path) -> Optional[Completion]:
        if job.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            torch.save({"model": job.unwrapped_model.state_dict(), "optimizer": job.optimizer.state_dict(),
                        "step": job.step}, path / self.FILE)
            self._written(path)
        return None

    def load(self, job: Training, path: Path) -> Optional[int]:
        ckpt = torch.load(path / self.FILE, map_location="cpu")
        job.unwrapped_model.load_state_dict(ckpt["model"])
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

    def save(self, job: Training, path: Path) -> Optional[Completion]:
        import torch.distributed.checkpoint as dcp

        with quiet_single_process():
            dcp.save(self._state(job), checkpoint_id=str(path), no_dist=not _distributed())
        self._written(path)
        return None

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

    def __init__(self, make_durable: Optional[Callable[[Path], None]] = None) -> None:
        super().__init__(make_durable)
        self._upload: Optional[Future] = None
        self._group: Any = None

    def _kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"no_dist": not _distributed()}
        if _distributed():
            # The docs' advice: the background save's collectives get their own gloo group, so
            # they never interleave with the training's all-reduces on the default group.
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            kwargs["process_group"] = self._group
        return kwargs

    def _wait_upload(self) -> None:
        """One save in flight, as torchtitan does: the previous upload ends before the next save
        (its durability, when asked, is the previous save's completion's to wait for)."""
        if self._upload is not None:
            upload, self._upload = self._upload, None
            upload.result()

    def _started(self, upload: Future, path: Path) -> Completion:
        self._upload = upload
        lock = threading.Lock()
        synced: list[Path] = []

        def complete() -> None:
            upload.result()
            with lock:  # a benchmark's waiter thread and wait() may both ask: sync once
                if not synced:
                    self._written(path)
                    synced.append(path)

        self._pending = complete
        return complete

    def save(self, job: Training, path: Path) -> Completion:
        import torch.distributed.checkpoint as dcp

        self._wait_upload()
        with quiet_single_process():
            result = dcp.async_save(self._state(job), checkpoint_id=str(path), **self._kwargs())
        return self._started(result if isinstance(result, Future) else result.upload_completion, path)

    def wait(self) -> None:
        super().wait()
        self._wait_upload()


class DcpAsyncStager(DcpAsync):
    """DCP async_save with a caller-owned DefaultStager reused across saves (its staging storages
    are cached), staging asynchronously: the next ``optimizer.step()`` waits for the snapshot."""

    name = "dcp_async_stager"
    label = "DCP async_save + DefaultStager"

    def __init__(self, make_durable: Optional[Callable[[Path], None]] = None) -> None:
        super().__init__(make_durable)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # DefaultStager() (all options True) raises on a CPU-only machine ("Non-blocking copy
        # requires that the current accelerator is available"): pinning and non-blocking copies
        # only where CUDA is; shared memory only matters for the process executor.
        cuda = torch.cuda.is_available()
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                 use_async_staging=True, use_non_blocking_copy=cuda)
        self._make_stager = lambda: DefaultStager(options)
        self._stager = self._make_stager()
        self.stagers_made = 1
        self._hook: Any = None

    def _stager_closed(self) -> bool:
        # torch 2.11's async_save closes the caller's stager when a save ends (2.13 closes only
        # the one it made itself); a closed stager has an empty copy table and its next staging
        # raised "KeyError: <class 'type'>" on an H200. Then each save needs a new stager.
        inner = getattr(self._stager, "_state_dict_stager", None)
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

    def _unhook(self) -> None:
        # removed here, between steps: removing a hook while optimizer.step() iterates over its
        # hooks raises "OrderedDict mutated during iteration"
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def save(self, job: Training, path: Path) -> Completion:
        import torch.distributed.checkpoint as dcp

        self._wait_upload()  # required: the staged (cached) storages are reused by the next save
        self._unhook()
        if self._stager_closed():
            self._stager = self._make_stager()
            self.stagers_made += 1
        with quiet_single_process():
            response: Any = dcp.async_save(self._state(job), checkpoint_id=str(path), async_stager=self._stager,
                                      **self._kwargs())
        staged = response.staging_completion
        # The snapshot may still be copying: the next optimizer.step() must wait for it (the
        # forward and backward before it change neither parameters nor optimizer state).
        self._hook = job.optimizer.register_step_pre_hook(lambda *_: staged.result())
        return self._started(response.upload_completion, path)

    def facts(self) -> dict[str, Any]:
        return {"stagers_made": self.stagers_made}

    def close(self) -> None:
        super().close()
        self._unhook()
        self._stager.close()


class SafetensorsWeights(Mechanism):
    name = "safetensors"
    label = "safetensors (weights)"
    stores = Stores(weights=True, optimizer=False, rng=False, data_position=False)
    file_format = "one safetensors file (JSON header + raw tensors)"
    executes_code = "no"
    executes_code_note = "a JSON header and raw bytes"
    FILE = "model.safetensors"

    def save(self, job: Training, path: Path) -> Optional[Completion]:
        from safetensors.torch import save_file

        if job.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            save_file(job.unwrapped_model.state_dict(), str(path / self.FILE))
            self._written(path)
        return None

    def load(self, job: Training, path: Path) -> Optional[int]:
        from safetensors.torch import load_file

        job.unwrapped_model.load_state_dict(load_file(str(path / self.FILE)))
        return None


class ResurgoSync(Mechanism):
    name = "resurgo"
    label = "resurgo.save"
    stores = Stores(weights=True, optimizer=True, rng=True, data_position=True)
    file_format = "manifest.json + safetensors data files"
    executes_code = "no"
    executes_code_note = "JSON and raw bytes; pickled values are refused unless allow_pickle=True"
    fsync = True

    def save(self, job: Training, path: Path) -> Optional[Completion]:
        self.report = resurgo.save(job.state, path, step=job.step)
        return None

    def load(self, job: Training, path: Path) -> Optional[int]:
        resurgo.load(job.state, path)
        return job.step

    def facts(self) -> dict[str, Any]:
        return {"report": getattr(self, "report", None)}


class ResurgoAsync(ResurgoSync):
    name = "resurgo_async"
    label = "resurgo.async_save"
    guard = False

    handle: Optional[resurgo.AsyncSaveHandle] = None

    def save(self, job: Training, path: Path) -> Completion:
        # resurgo keeps one save in flight itself: a new call waits for the previous one.
        kwargs: dict[str, Any] = {"guard": job.optimizer} if self.guard else {}
        self.handle = resurgo.async_save(job.state, path, step=job.step, **kwargs)
        self._pending = self.handle.wait
        return self.handle.wait

    def facts(self) -> dict[str, Any]:
        return {"handle_stall_seconds": getattr(self.handle, "stall_seconds", None)}


class ResurgoAsyncGuard(ResurgoAsync):
    name = "resurgo_async_guard"
    label = "resurgo.async_save(guard=opt)"
    guard = True


MECHANISMS: dict[str, type[Mechanism]] = {
    m.name: m for m in (TorchSave, DcpSync, DcpAsync, SafetensorsWeights, ResurgoSync, ResurgoAsync,
                        ResurgoAsyncGuard)
}


def make_mechanism(name: str, make_durable: Optional[Callable[[Path], None]] = None) -> Mechanism:
    """A new mechanism of the study's (``MECHANISMS``) or DCP with a reused stager."""
    known = {**MECHANISMS, DcpAsyncStager.name: DcpAsyncStager}
    try:
        return known[name](make_durable)
    except KeyError:
        raise StudyError(f"unknown mechanism {name!r}; expected one of {', '.join(known)}") from None
