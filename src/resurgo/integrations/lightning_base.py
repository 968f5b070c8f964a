"""What resurgo's Lightning plugin and callback do, free of any Lightning import.

Lightning ships under two package names, ``lightning`` and ``pytorch_lightning``, each with its
own CheckpointIO and Callback base classes: a plugin must derive from the package the Trainer
comes from. The behaviour lives here once, as mixins; ``resurgo.integrations.lightning`` and
``resurgo.integrations.pytorch_lightning`` bind it to each package's base classes.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resurgo.api import async_save, load, load_dict, read_manifest, save
from resurgo.dist import comm as dist_comm
from resurgo.errors import DataPositionError, NotACheckpointError, UnsupportedValueError
from resurgo.format.manifest import MANIFEST_NAME
from resurgo.format.values import decode_key
from resurgo.integrations._torch_file import check_torch_file, load_torch_file, refuse_dcp_folder
from resurgo.layout.shards import Shard
from resurgo.manager.catalog import remove
from resurgo.pipeline.async_save import AsyncSaveHandle
from resurgo.state.data_position import mark_epoch_finished, track_dataloader
from resurgo.state.elastic_loader import batches_of, find_elastic_sampler
from resurgo.state.per_rank import PerRank
from resurgo.state.rng import capture_rng_state, restore_rng_state
from resurgo.storage.open import open_root
from resurgo.wording import plural


def _as_builtin(value: Any) -> Any:
    """Lightning's dict subclasses (OrderedDict state dicts, AttributeDict hyper-parameters) as
    builtin dicts, which resurgo stores as JSON; any other value is left for resurgo to judge."""
    if isinstance(value, Mapping):
        return {k: _as_builtin(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_builtin(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_as_builtin(v) for v in value)
    return value


class CheckpointIOMethods:
    """The CheckpointIO methods: each path Lightning saves to becomes a resurgo checkpoint.

    ``asynchronous=True``: ``save_checkpoint`` returns once every tensor is copied out (a
    snapshot: training may change the weights at once, and the checkpoint still holds the step it
    was asked for), and the checkpoint is written and committed in the background. A load, a
    removal of that path and Lightning's teardown wait for it; a background failure is raised
    by the next call that waits. Only the Trainer's checkpoints (those with a ``global_step``)
    go to the background: Lightning reads its other files back at once (the weights
    ``ddp_spawn`` hands to the main process).
    """

    def __init__(self, *, allow_pickle: bool = False, verify: bool = True, asynchronous: bool = False) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.asynchronous = asynchronous
        self._in_flight: dict[Path, AsyncSaveHandle] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        step = checkpoint.get("global_step")
        kwargs: dict[str, Any] = dict(overwrite=True, allow_pickle=self.allow_pickle,
                                      step=step if isinstance(step, int) else None, collective=False)
        # Lightning saves "last.ckpt" again and again: overwrite replaces a resurgo checkpoint
        # atomically and refuses (ForeignFilesError) anything resurgo did not write.
        # Lightning calls this on global rank 0 only, with the whole state: a save of one process.
        if not (self.asynchronous and "global_step" in checkpoint):
            save(_as_builtin(checkpoint), path, **kwargs)
            return
        self._collect(done_only=True)
        self._wait_for(Path(path))  # a second save of one path starts after the first committed
        self._in_flight[Path(path)] = async_save(_as_builtin(checkpoint), path, **kwargs)

    def load_checkpoint(self, path: str | os.PathLike, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        self._collect()
        if Path(path).is_file():
            return self._load_foreign(Path(path), map_location)
        # Each process reads the whole checkpoint for itself.
        return load_dict(path, verify=self.verify, allow_pickle=self.allow_pickle, collective=False)

    def _load_foreign(self, path: Path, map_location: Any) -> dict[str, Any]:
        return load_torch_file(path, allow_pickle=self.allow_pickle, map_location=map_location or "cpu",
                               what="a Lightning checkpoint", fix="pass ResurgoCheckpointIO(allow_pickle=True)")

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self._wait_for(Path(path))
        remove_checkpoint(Path(path))

    def teardown(self) -> None:
        """Lightning's end of fit: every background save is committed (or its error raised)."""
        self._collect()

    def _wait_for(self, path: Path) -> None:
        handle = self._in_flight.pop(path, None)
        if handle is not None:
            handle.wait()

    def _collect(self, done_only: bool = False) -> None:
        """Wait for the saves in flight (only those already finished with ``done_only``), dropping
        each handle before its error is raised so that an error is raised once."""
        for path, handle in list(self._in_flight.items()):
            if done_only and not handle.done():
                continue
            del self._in_flight[path]
            handle.wait()


class RngCallbackMethods:
    """The Callback methods: RNG states saved in every checkpoint and restored where the resumed
    run's next draw matches the uninterrupted run's, and a plain DataLoader's data position.

    Data position: each plain ``torch.utils.data.DataLoader`` the fit trains on is made resumable
    in place (:func:`resurgo.state.data_position.track_dataloader`) as Lightning receives it,
    before its first ``iter()``. It then has ``state_dict``/``load_state_dict``, so Lightning
    itself saves its position with the loops' state in every checkpoint, and loads it into the
    rebuilt loader before that loader's first ``iter()`` of a resumed fit, which then replays the
    interrupted epoch's order and skips the batches already trained on (without loading them).
    Loaders with their own ``state_dict`` (torchdata's StatefulDataLoader) keep it. A checkpoint
    saved at an epoch's last batch marks each loader's position finished (the epoch may end before
    the loader runs out, under ``limit_train_batches``), so that the resumed loader starts the next
    epoch, as Lightning's loop does.

    Resumed at an epoch boundary, the uninterrupted run's next draws build the next epoch's data
    iterator, which Lightning builds right after loading: the states are restored on loading.
    Resumed mid-epoch, the uninterrupted run kept its iterator, while the resumed run builds a new
    one (drawing from the RNG): the states are set again right before the first resumed step.
    Under DDP every process has its own states (its own dropout masks): each process's states
    are gathered into the checkpoint, and each process gets its own back.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        comm = dist_comm.current("control")
        if comm.size == 1:
            return {"rng": capture_rng_state()}
        # Lightning builds the checkpoint on every process and writes rank 0's: gather into it.
        return {"rng_per_rank": comm.all_gather(capture_rng_state())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = self._own_states(state_dict)
        if self._pending is not None:
            restore_rng_state(self._pending)

    @staticmethod
    def _own_states(state_dict: dict[str, Any]) -> dict[str, Any] | None:
        comm = dist_comm.current("control")
        world, rank = comm.size, comm.rank
        per_rank = state_dict.get("rng_per_rank")
        if per_rank is None:
            if world > 1:
                warnings.warn("ResurgoCallback: the checkpoint holds the RNG states of one process; "
                              f"under {world} processes they are not restored (each process keeps its seed)",
                              RuntimeWarning, stacklevel=3)
                return None
            return state_dict["rng"]
        if len(per_rank) != world:
            warnings.warn(f"ResurgoCallback: the checkpoint holds the RNG states of {len(per_rank)} processes, "
                          f"this run has {world}: they are not restored (each process keeps its seed)",
                          RuntimeWarning, stacklevel=3)
            return None
        return per_rank[rank]

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            track_train_dataloaders(trainer, after_build=self._restore_pending)

    def _restore_pending(self) -> None:
        """Set the loaded states again once the train loaders are built: building one may draw
        (torchdata's RandomSampler draws its seed), which the uninterrupted run did at its start."""
        if self._pending is not None:
            restore_rng_state(self._pending)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        mark_finished_epoch_positions(trainer, checkpoint)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        refuse_elastic_sampler_mid_epoch(trainer)
        if self._pending is None:
            return
        # The loaded progress (the epoch loop resets it only later): batches of the interrupted epoch.
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        if 0 < ready < trainer.num_training_batches:
            # Resumed mid-epoch: undo the draws of the rebuilt iterator, before the first batch is
            # fetched (loading it may draw, as the uninterrupted run did, from these states).
            restore_rng_state(self._pending)
        self._pending = None


def mark_finished_epoch_positions(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """At an epoch's last batch, mark the train loaders' saved positions in ``checkpoint`` finished.

    With ``limit_train_batches`` below a loader's length, the epoch ends before the loader runs out:
    its own position says "mid-epoch", while the resumed fit starts the next epoch. Lightning saves
    each stateful train loader's ``state_dict()`` in order under the fit loop's
    ``combined_loader`` (checked with lightning and pytorch_lightning 2.6.6); once the loop has
    fetched the epoch's last batch (its batch progress is the epoch's number of batches), each of
    those states is marked finished (:func:`resurgo.state.data_position.mark_epoch_finished`), so
    that the resumed loaders start the next epoch, as the uninterrupted run's do.
    """
    ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if ready == 0 or ready < trainer.num_training_batches:
        return
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    states = fit_state.get("combined_loader") if isinstance(fit_state, dict) else None
    if not states:
        return
    # The loaders Lightning took the states of: its stateful ones (state_dict and load_state_dict).
    loaders = [loader for loader in _flat_loaders(getattr(trainer, "train_dataloader", None))
               if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))]
    if len(loaders) != len(states):
        raise DataPositionError(
            f"ResurgoCallback: the checkpoint of step {trainer.global_step} holds {len(states)} train loader positions, "
            f"the fit trains on {len(loaders)} stateful loaders; this Lightning version saves them otherwise than "
            "the versions resurgo was checked with (2.6.6), so the positions at the epoch's end could not be marked")
    fit_state["combined_loader"] = [mark_epoch_finished(loader, state) for loader, state in zip(loaders, states)]


def refuse_elastic_sampler_mid_epoch(trainer: Any) -> None:
    """Refuse (DataPositionError) a fit resumed mid-epoch whose ElasticSampler's rest of the epoch
    does not end where Lightning's count of that epoch's batches does.

    Lightning resumes at the saved batch index and ends the epoch at the loader's length, read
    after loading (a resumable loader with an ElasticSampler reports the whole epoch's); the
    loader yields the samples the checkpoint had not consumed, in batches of this world size. On
    the world size that saved it, both end together. On another one, the batches before the
    checkpoint (counted on the old size) and the rest (on the new) need not add up to the epoch's
    length: the epoch would end early, or its last batches would get other batch indices.
    """
    ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if not 0 < ready < trainer.num_training_batches:
        return
    for loader in _flat_loaders(getattr(trainer, "train_dataloader", None)):
        sampler = find_elastic_sampler(loader)
        if sampler is None:
            continue
        rest = batches_of(loader, len(sampler))
        if rest is None or ready + rest == len(loader):
            continue
        raise DataPositionError(
            f"ResurgoCallback: {trainer.ckpt_path}: the train DataLoader's sampler is a resurgo.ElasticSampler loaded "
            f"part way through epoch {sampler.epoch}, saved on another number of processes (or batch size): its rest "
            f"of the epoch is {plural(rest, 'batch', 'batches')} on {plural(sampler.num_replicas, 'process', 'processes')}, "
            f"while Lightning resumes at batch {ready} of {len(loader)}, so the resumed fit would not follow the "
            "interrupted one. Resume on the number of processes that saved it, or from a checkpoint saved at an "
            "epoch's end (which resumes on any number)")


def _flat_loaders(value: Any) -> list[Any]:
    """The loaders of ``trainer.train_dataloader`` (one, or a collection of them)."""
    if isinstance(value, Mapping):
        return [loader for v in value.values() for loader in _flat_loaders(v)]
    if isinstance(value, (list, tuple)):
        return [loader for v in value for loader in _flat_loaders(v)]
    return [] if value is None else [value]


def track_train_dataloaders(trainer: Any, after_build: Any = None) -> None:
    """Make every plain DataLoader the fit loop gets from its data source resumable, as it gets it.

    Lightning has no public hook between building the train loaders (``train_dataloader()`` of
    the module or the datamodule, or the loaders given to ``fit``) and loading their saved states
    and calling ``iter()`` on them, so this wraps the fit loop's data source, a private object:
    ``trainer.fit_loop._data_source``, a dataclass ``_DataLoaderSource(instance, name)`` whose
    ``dataloader()`` the loop calls for the loaders (checked with lightning and pytorch_lightning
    2.6.6). If it is not that, the loaders' position could not be restored: refuse rather than
    resume onto other batches. ``after_build``: called each time the loaders were built, before
    Lightning loads their states and calls ``iter()`` on them.
    """
    loop = getattr(trainer, "fit_loop", None)
    source = getattr(loop, "_data_source", None)
    if isinstance(source, _TrackingSource):
        source.after_build = after_build
        return
    fields = {f.name for f in dataclasses.fields(source)} if dataclasses.is_dataclass(source) else set()
    if fields != {"instance", "name"} or not callable(getattr(source, "dataloader", None)):
        raise DataPositionError(
            f"ResurgoCallback: trainer.fit_loop._data_source is {type(source).__name__}, not the data source of the "
            "Lightning versions resurgo was checked with (2.6.6), so a plain DataLoader's position could not be saved "
            "and restored; use torchdata's StatefulDataLoader (whose position Lightning saves itself)")
    assert source is not None and loop is not None
    tracking = _tracking_source_class(type(source))(source.instance, source.name)
    tracking.after_build = after_build
    loop._data_source = tracking


class _TrackingSource:
    """Marks a data source whose loaders are tracked (mixed into Lightning's own class)."""

    after_build: Any = None  # called once the loaders are built

    def dataloader(self) -> Any:
        loaders = _track_loaders(super().dataloader())  # type: ignore[misc]
        if self.after_build is not None:
            self.after_build()
        return loaders


_TRACKING_SOURCES: dict[type, type] = {}


def _tracking_source_class(cls: type) -> type:
    tracking = _TRACKING_SOURCES.get(cls)
    if tracking is None:
        tracking = _TRACKING_SOURCES[cls] = type(f"Tracking{cls.__name__}", (_TrackingSource, cls), {})
    return tracking


def _track_loaders(value: Any) -> Any:
    """``value`` (a loader, a collection of loaders, or a CombinedLoader of them) with each plain
    DataLoader tracked in place; a loader with its own ``state_dict`` is left as it is."""
    from torch.utils.data import DataLoader

    if isinstance(value, DataLoader):
        # Saved at an epoch's last batch, Lightning resumes at the next epoch: so does the loader.
        if not callable(getattr(value, "state_dict", None)):
            # Resumed on another number of processes, the position is not restored (with a
            # warning), as the RNG states are not: the sharded strategies resume on any number.
            track_dataloader(value, on_world_size_change="warn", finished_epoch="next")
        else:
            track_dataloader(value, finished_epoch="next")
    elif isinstance(value, Mapping):
        for v in value.values():
            _track_loaders(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _track_loaders(v)
    elif hasattr(value, "flattened"):  # a CombinedLoader
        for v in value.flattened:
            _track_loaders(v)
    return value


class ShardedStrategyMethods:
    """The methods of a strategy whose model and optimizer state are sharded over the processes
    (``ModelParallelStrategy``: FSDP2 and tensor parallel; ``FSDPStrategy``). Lightning's own
    write a DCP folder from every process and bypass CheckpointIO; these write one resurgo
    checkpoint instead, collectively: every process saves its own shards (replicated values once),
    and a load fills this run's shards whatever number of processes saved it.

    The checkpoint holds what Lightning's CheckpointIO checkpoints hold, under the same keys
    (``state_dict``, ``optimizer_states``, loops, callbacks, ...), with the model and optimizer
    state as ``torch.distributed.checkpoint.state_dict`` gives them (keys by parameter name,
    tensors sharded): ``resurgo.load_dict`` reads it whole in one process. A path that holds no
    resurgo checkpoint (Lightning's own DCP folder or ``.ckpt`` file, from before resurgo was
    added) is read by Lightning's own code: a DCP folder (whose ``.metadata`` is a pickle) only
    with ``allow_pickle``, a ``.ckpt`` file without it if it holds only tensors and plain
    containers. ``allow_pickle`` and ``verify`` as in ResurgoCheckpointIO.
    """

    # What the Lightning strategy this is mixed into provides (for the type checker only).
    model: Any
    lightning_module: Any
    optimizers: Any
    global_rank: Any
    world_size: Any
    is_global_zero: Any
    broadcast: Any

    def __init__(self, *args: Any, allow_pickle: bool = False, verify: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle
        self.verify = verify

    # What Lightning puts in the checkpoint: the sharded state of every process.
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(filepath))  # rank 0's, as Lightning's strategies do
        step = checkpoint.get("global_step")
        # Collective: every process writes its shards. Lightning saves "last.ckpt" again and again:
        # overwrite replaces a resurgo checkpoint atomically, and refuses what resurgo did not write.
        save(_shards(_as_builtin(checkpoint)), path, overwrite=True, allow_pickle=self.allow_pickle,
             step=step if isinstance(step, int) else None)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
            set_optimizer_state_dict)

        path = Path(self.broadcast(checkpoint_path))
        if not (path / MANIFEST_NAME).is_file():  # Lightning's own checkpoint: its own reader
            self._check_foreign(path)
            return super().load_checkpoint(path, False if self.allow_pickle else weights_only)  # type: ignore[misc]
        strict = self.lightning_module.strict_loading
        # The optimizers are restored while fitting only, as Lightning's own strategies do.
        optimizers = self.optimizers if self.lightning_module.trainer.state.fn == "fit" else []
        model_state = get_model_state_dict(self.model)
        optimizer_states = [get_optimizer_state_dict(self.model, opt) for opt in optimizers]
        # The target: this run's shards for the model and optimizers (filled in place), and a new
        # value for every other key the checkpoint has (loops, callbacks, hyper-parameters).
        target: dict[str, Any] = dict.fromkeys(_top_level_keys(path))
        target["state_dict"] = _shards(model_state)
        if optimizers:
            target["optimizer_states"] = [_shards(state) for state in optimizer_states]
        load(target, path, strict=strict, verify=self.verify, allow_pickle=self.allow_pickle)
        set_model_state_dict(self.model, model_state, options=StateDictOptions(strict=strict))
        for opt, state in zip(optimizers, optimizer_states):
            set_optimizer_state_dict(self.model, opt, state)
        rest = {k: v for k, v in target.items() if k not in ("state_dict", "optimizer_states")}
        return _own_values(rest, self.global_rank, self.world_size)

    def _check_foreign(self, path: Path) -> None:
        """Without ``allow_pickle``, refuse (PickleNotAllowedError, naming the file) a checkpoint of
        Lightning's own strategy that its reader would unpickle: a DCP folder (its ``.metadata``
        always is a pickle), or a ``.ckpt`` file naming other globals than tensors and containers."""
        if self.allow_pickle:
            return
        fix = f"pass {type(self).__name__}(..., allow_pickle=True) for the run that loads it"
        if path.is_dir():
            raise refuse_dcp_folder(path, "a checkpoint of Lightning's own strategy", fix)
        if path.is_file():
            check_torch_file(path, what="a Lightning checkpoint", fix=fix)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        if self.is_global_zero:
            remove_checkpoint(Path(filepath))


def remove_checkpoint(target: Path) -> None:
    """Lightning's retention of ``target``: deleted only if resurgo can prove it wrote every file
    in it (else ForeignFilesError, nothing deleted), crash-safely; a file is not ours to delete."""
    if not target.exists():
        return
    if not target.is_dir():
        raise NotACheckpointError(
            f"{target}: not a resurgo checkpoint (a file), so resurgo's Lightning integration does not delete it; "
            "remove it yourself if it is not needed")
    remove(open_root(target.parent), target.name)


def _own_values(value: Any, rank: int, world: int) -> Any:
    """``value`` with each value saved per rank (a monitored score each process logged on its
    own, a data loader's position) resolved for this process: its own when the world is the one
    that saved it, else global rank 0's (what Lightning's own strategies save for every process)."""
    if isinstance(value, PerRank):
        saved = value.saved or []
        return saved[rank] if len(saved) == world else saved[0]
    if isinstance(value, dict):
        return {k: _own_values(v, rank, world) for k, v in value.items()}
    if isinstance(value, list):
        return [_own_values(v, rank, world) for v in value]
    return value


def _top_level_keys(path: Path) -> list[Any]:
    tree = read_manifest(path).tree
    return [decode_key(key, str(path)) for key, _ in tree.get("items", [])]


def _shards(value: Any) -> Any:
    """``value`` with FSDP1's ShardedTensors as resurgo Shards of their local blocks (sharing their
    memory: a load fills them in place); DTensors and everything else as they are."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        return _block(value)
    if isinstance(value, dict):
        return {k: _shards(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shards(v) for v in value]
    return value


def _block(tensor: Any) -> Shard:
    """The one block of an FSDP1 ShardedTensor this process holds (an empty one at its end if none)."""
    import torch

    local = tensor.local_shards()
    shape = tuple(tensor.size())
    if not local:
        return Shard(torch.empty((0,) + shape[1:], dtype=tensor.dtype), shape, (shape[0],) + (0,) * (len(shape) - 1))
    if len(local) > 1:
        raise UnsupportedValueError(f"a ShardedTensor with {len(local)} blocks on one process; "
                                    "resurgo's Lightning strategies save FSDP's, which has one")
    return Shard(local[0].tensor, shape, tuple(local[0].metadata.shard_offsets))
