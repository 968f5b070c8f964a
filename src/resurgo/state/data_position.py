"""Data position of a plain ``torch.utils.data.DataLoader``, so a run can resume mid-epoch.

This module owns making a DataLoader resumable: after a restart, iterating the loader yields
exactly the batches the uninterrupted run would have got next, in the same order.

How: :func:`track_dataloader` swaps the loader's class to a subclass made once per original class.
Its ``__iter__`` records, *before* creating the underlying iterator, every RNG state that the
epoch's order depends on (the torch global CPU RNG, and ``loader.generator`` /
``sampler.generator`` when set), then counts the batches handed out. ``state_dict()`` returns
``{"epoch_rng", "batches_yielded", "epoch_active", "epoch_finished", ...}``. After
``load_state_dict()``, the next ``iter()`` sets those RNGs back to the epoch start, rebuilds the
iterator, skips the batches already seen, then puts the global RNG back where it was, so the
training stream (restored by :class:`resurgo.state.rng.RNGState`) is untouched. Saved between
epochs, nothing is replayed; the loader's own generators are set to their saved current states
instead (``"generators"``).
A loop that ends its epochs before the loader runs out (Lightning's ``limit_train_batches``) marks
the position saved at an epoch's end with :func:`mark_epoch_finished` (``"epoch_finished"``): it
then loads as a finished epoch, as one saved once the epoch's last batch was handed out does.

Where the RNG is drawn inside a DataLoader (torch 2.x), which is why the order above matters:
1. iterator construction draws ``_base_seed`` (the worker seed) from ``loader.generator`` or,
   when that is None, from the global CPU RNG;
2. ``RandomSampler`` without a generator draws its own seed from the global CPU RNG lazily, on its
   first ``next()``: with workers that happens inside construction (prefetch), without workers on
   the first batch. The tracked loader pulls the first index batch right after construction, so
   the epoch's order depends only on the recorded epoch-start state.
3. with persistent workers, only the first ``iter()`` builds an iterator; later epochs ``_reset()``
   it and draw no ``_base_seed``. A resume repeats whichever the original epoch did.

Limits: a sampler that draws from the global RNG lazily during the epoch, an IterableDataset
whose stream is not a function of the epoch-start RNG, and random augmentation inside persistent
workers (their RNG lives in the worker processes) are not reproduced exactly.
``torchdata``'s ``StatefulDataLoader`` has its own ``state_dict``; it keeps it, and only its first
``iter()`` after a load is guarded so that the base seed it redraws (then overwrites with the saved
one) does not shift the restored RNG streams (:mod:`resurgo.state.stateful_loader`).

With an :class:`~resurgo.state.elastic_sampler.ElasticSampler` (as ``sampler=`` or inside
``batch_sampler=``), the state also has ``"elastic"``: the sampler's global position as of the
batches handed to the loop, ``start + batches * batch_size * num_replicas`` for the pass the epoch
started at (the whole epoch once its last batch was handed out), whatever the workers prefetched.
A mid-epoch load then resumes through the sampler instead of replaying batches, so the number of
ranks may differ; the epoch-start RNG is still set while the iterator is built, so the worker base
seed and the restored RNG streams are as in the original epoch. (Random augmentation in workers is
then not reproduced bit for bit: the workers do not replay the batches before the checkpoint.)
The loader's length is the whole epoch's on this world size, as a plain DataLoader's is, while
a resumed pass yields only the rest (a loop that reads it after loading counts the epoch whole).
The RNG parts of such a loader's state (``epoch_rng``, ``generators``) are the rank's own, so they
are :class:`~resurgo.PerRank` values with a carry-over policy: on another number of ranks an old
rank keeps its own and a new rank derives its own. A StatefulDataLoader with an ElasticSampler
gets the batches since its last snapshot folded into the position when it is loaded on another
world size (see ``elastic_loader``).

A ``DistributedSampler``'s position is a per-rank count: the state records its ``num_replicas``
(``"distributed_num_replicas"``) and a load on another number of ranks is refused. Its order is a
function of its epoch, so the state also records the epoch the current pass was started with
(``"distributed_epoch"``), which a mid-epoch resume sets again before replaying.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from resurgo.errors import DataPositionError, TypeMismatchError, UnsupportedValueError
from resurgo.state.elastic_loader import (
    ITERATOR_FINISHED,
    find_elastic_sampler,
    find_sampler,
    is_stateful_dataloader,
    samples_per_batch,
)
from resurgo.state.elastic_sampler import ElasticSampler, EpochPass
from resurgo.state.per_rank import PerRank
from resurgo.state.rng import carry_over_rng
from resurgo.state.stateful_loader import epoch_length, loader_length, refuse_live_iterator, rng_guarded_class
from resurgo.wording import plural

__all__ = ["track_dataloader", "is_tracked", "mark_epoch_finished"]

_FORMAT_VERSION = 1
# A tracked loader's state key (optional, False when absent): the training loop ended the epoch at
# this position, before the loader ran out (see mark_epoch_finished).
EPOCH_FINISHED = "epoch_finished"
_TRACKED_CLASSES: dict[tuple[type, str, str], type] = {}
_ATTR = "_resurgo_position"


class _Position:
    """Where a tracked loader stands in its current epoch (kept on the loader instance)."""

    __slots__ = ("epoch_rng", "batches_yielded", "epoch_active", "epoch", "reset_iterator",
                 "persistent_iterator", "generation", "pending", "elastic_pass", "elastic_base",
                 "elastic_loaded", "live", "sampler_epoch")

    def __init__(self) -> None:
        self.epoch_rng: dict[str, Any] | None = None  # RNG states just before the epoch's iter()
        self.batches_yielded = 0
        self.epoch_active = False  # an epoch was started and its StopIteration not yet seen
        self.epoch = 0  # epochs started (iter() calls) so far, for the reader's benefit
        self.reset_iterator = False  # the epoch reused a persistent-workers iterator (_reset)
        self.persistent_iterator = False  # loaded: persistent workers were alive at save time
        self.generation = 0  # which iterator is the live one; older iterators stop counting
        self.pending = False  # load_state_dict() was called; the next iter() resumes
        # With an ElasticSampler: the pass the current epoch's iterator draws (or, after a load, the
        # pass it will resume), batches_yielded when that pass started, and the loaded position.
        self.elastic_pass: EpochPass | None = None
        self.elastic_base = 0
        self.elastic_loaded: dict[str, Any] | None = None
        self.live: weakref.ref | None = None  # the iterator of the current epoch, while someone holds it
        self.sampler_epoch: int | None = None  # a DistributedSampler's epoch when the epoch's iter() began


def _generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """Dedicated generators that decide the epoch's order, by a stable name, each object once."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [
        ("loader_generator", getattr(loader, "generator", None)),
        ("sampler_generator", getattr(getattr(loader, "sampler", None), "generator", None)),
        ("batch_sampler_generator", getattr(batch_sampler, "generator", None)),
        ("batch_sampler_sampler_generator",
         getattr(getattr(batch_sampler, "sampler", None), "generator", None)),
    ]
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    for name, g in candidates:
        # DataLoader hands loader.generator to its RandomSampler: the same object, stored once.
        if isinstance(g, torch.Generator) and id(g) not in seen:
            seen.add(id(g))
            found[name] = g
    return found


def _capture_epoch_rng(loader: DataLoader) -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "generators": {name: g.get_state() for name, g in _generators(loader).items()},
    }


def _set_epoch_rng(loader: DataLoader, epoch_rng: dict[str, Any]) -> None:
    torch.set_rng_state(_as_uint8(epoch_rng["torch"], "epoch_rng.torch"))
    gens = _generators(loader)
    saved = epoch_rng.get("generators", {}) or {}
    if set(saved) != set(gens):
        raise TypeMismatchError(
            f"dataloader.epoch_rng.generators: the checkpoint has generators {sorted(saved)}, "
            f"this DataLoader has {sorted(gens)}; build the loader the same way as when saving"
        )
    for name, g in gens.items():
        g.set_state(_as_uint8(saved[name], f"epoch_rng.generators.{name}"))


def _as_uint8(value: Any, key: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except Exception as e:  # noqa: BLE001 - re-raised as our own error with the key
            raise TypeMismatchError(f"dataloader.{key}: expected a uint8 tensor, got {type(value).__name__}") from e
    if value.dtype != torch.uint8:
        raise TypeMismatchError(f"dataloader.{key}: expected dtype uint8, got {value.dtype}")
    return value.detach().to("cpu").contiguous()


def _clone_rng(epoch_rng: dict[str, Any]) -> dict[str, Any]:
    return {
        "torch": epoch_rng["torch"].clone(),
        "generators": {k: v.clone() for k, v in epoch_rng["generators"].items()},
    }


def _fast_skip_possible(loader: DataLoader, it: Any) -> bool:
    """True when index batches can be pulled from the sampler without loading any data.

    Only without workers (workers prefetch on their own) and for map-style datasets (an
    IterableDataset's position lives in its own iterator, not in the sampler).
    """
    try:  # private names: if a torch version lacks them, fall back to consuming batches
        from torch.utils.data.dataloader import _DatasetKind, _SingleProcessDataLoaderIter
    except ImportError:
        return False
    return (
        getattr(loader, "num_workers", 0) == 0
        and getattr(loader, "_dataset_kind", None) == _DatasetKind.Map
        and isinstance(it, _SingleProcessDataLoaderIter)
        and getattr(it, "_sampler_iter", None) is not None
    )


def _prime(loader: DataLoader, it: Any) -> bool:
    """Pull the first index batch now, while the RNG is still at the epoch-start state.

    RandomSampler draws its seed at its first next(); pulling it here makes the epoch's order a
    function of the recorded state alone, whatever the caller draws before the first batch.
    The batch is chained back in front, so nothing is lost. Returns True if the order is left to
    the first batch instead: a DistributedSampler's order is its seed and epoch, read at its first
    next(), and a loop may call set_epoch() after iter() (Lightning does, on resume), as it would
    without tracking.
    """
    if not _fast_skip_possible(loader, it):
        return False
    if find_sampler(loader, DistributedSampler) is not None:
        return True
    try:
        first = next(it._sampler_iter)
    except StopIteration:
        return False
    it._sampler_iter = itertools.chain([first], it._sampler_iter)
    return False


def _skip(loader: DataLoader, it: Any, n: int) -> None:
    """Advance a fresh iterator past its first ``n`` batches."""
    if _fast_skip_possible(loader, it):
        # Advance the index sampler only: no data is read, no augmentation runs.
        sampler_iter = it._sampler_iter
        try:
            first = next(sampler_iter)  # at the epoch-start RNG, as in the original epoch
        except StopIteration:
            return
        if n == 0:
            it._sampler_iter = itertools.chain([first], sampler_iter)
            return
        skipped = 1
        for _ in range(n - 1):
            try:
                next(sampler_iter)
            except StopIteration:
                break
            skipped += 1
        if hasattr(it, "_num_yielded"):
            it._num_yielded = skipped  # keeps torch's IterableDataset length warning right
        return
    # Workers, an IterableDataset, or an iterator we do not know: consume real batches.
    for _ in range(n):
        try:
            next(it)
        except StopIteration:
            break


class _TrackedIterator:
    """Wraps the loader's iterator to count batches handed out and notice the epoch's end."""

    def __init__(self, pos: _Position, it: Any, generation: int, epoch_of: DistributedSampler | None = None) -> None:
        self._pos = pos
        self._it = it
        self._generation = generation
        self._epoch_of = epoch_of  # a sampler whose epoch, read at the first batch, is the pass's

    def __iter__(self) -> _TrackedIterator:
        return self

    def __next__(self) -> Any:
        if self._epoch_of is not None:
            if self._pos.generation == self._generation:
                self._pos.sampler_epoch = int(self._epoch_of.epoch)
            self._epoch_of = None
        try:
            batch = next(self._it)
        except StopIteration:
            if self._pos.generation == self._generation:
                self._pos.epoch_active = False
            raise
        if self._pos.generation == self._generation:
            self._pos.batches_yielded += 1
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        # Anything else (e.g. _num_yielded) is the underlying iterator's business.
        if name == "_it":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._it, name)


# For type checkers the mixin is a DataLoader (at run time its methods are copied into one).
_MixinBase = DataLoader if TYPE_CHECKING else object


class _TrackedDataLoaderMixin(_MixinBase):  # type: ignore[misc,valid-type]
    """Methods of a tracked DataLoader's class. Its state lives in ``_resurgo_position``.

    Not used as a base: its functions are copied into ``type(name, (cls,), ...)``, because a
    second base would change the instance layout and forbid the ``__class__`` assignment.
    """

    _resurgo_base_class: type[DataLoader]
    # A DistributedSampler's position loaded on another number of ranks: "raise", or "warn" and
    # load nothing. A class attribute: a loader re-created from this one's class (Lightning does,
    # to give it a DistributedSampler) keeps it.
    _resurgo_on_world_size_change: str
    # A position saved once the epoch's last batch was handed out (before its StopIteration):
    # "empty", the next iter() gives the rest of that epoch, nothing; or "next", the next epoch,
    # for a loop that counts that epoch as done when it resumes (Lightning does).
    _resurgo_finished_epoch: str

    # -- iteration ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return epoch_length(self)

    def __iter__(self):  # type: ignore[no-untyped-def]
        pos = _position(self)
        pending, pos.pending = pos.pending, False
        pos.generation += 1
        epoch_of: DistributedSampler | None = None
        if pending and pos.epoch_active:
            it = self._resurgo_resume(pos)
        else:
            if pending and pos.persistent_iterator and self._resurgo_persistent() \
                    and getattr(self, "_iterator", None) is None:
                # Saved between epochs while persistent workers were alive: the original run's
                # next iter() reset that iterator (no _base_seed draw), so this one must too.
                self._resurgo_build_iterator_silently()
            will_reset = self._resurgo_will_reset()
            epoch_rng = _capture_epoch_rng(self)  # before construction: it draws from these
            elastic = find_elastic_sampler(self)
            # Before construction: building the iterator starts the sampler's pass.
            elastic_pass = elastic.next_pass() if elastic is not None else None
            it = self._resurgo_base_class.__iter__(self)
            deferred = _prime(self, it)
            pos.epoch_rng = epoch_rng
            pos.batches_yielded = 0
            pos.elastic_pass, pos.elastic_base = elastic_pass, 0
            pos.epoch_active = True
            pos.reset_iterator = will_reset
            distributed = find_sampler(self, DistributedSampler)
            # Workers read its order at construction; without, at the first batch (see _prime).
            pos.sampler_epoch = int(distributed.epoch) if distributed is not None else None
            epoch_of = distributed if deferred else None
            pos.epoch += 1
        tracked = _TrackedIterator(pos, it, pos.generation, epoch_of)
        pos.live = weakref.ref(tracked)
        return tracked

    def _resurgo_persistent(self) -> bool:
        return bool(getattr(self, "persistent_workers", False) and getattr(self, "num_workers", 0) > 0)

    def _resurgo_will_reset(self) -> bool:
        # DataLoader.__iter__ reuses (and _reset()s) one iterator when workers are persistent;
        # a reset draws no _base_seed, a construction does: the resume must do the same.
        return self._resurgo_persistent() and getattr(self, "_iterator", None) is not None

    def _resurgo_build_iterator_silently(self) -> None:
        """Start the persistent iterator (workers) without moving any RNG."""
        saved = _capture_epoch_rng(self)
        try:
            self._resurgo_base_class.__iter__(self)
        finally:
            torch.set_rng_state(saved["torch"])
            for name, g in _generators(self).items():
                g.set_state(saved["generators"][name])

    def _resurgo_resume(self, pos: _Position) -> Any:
        assert pos.epoch_rng is not None
        before = torch.get_rng_state()
        try:
            if self._resurgo_persistent():
                if pos.reset_iterator and getattr(self, "_iterator", None) is None:
                    # The original epoch reset a live iterator: start one, so that the real
                    # iter() below is a reset too.
                    self._resurgo_build_iterator_silently()
                elif not pos.reset_iterator and getattr(self, "_iterator", None) is not None:
                    self._iterator = None  # the original epoch built a new iterator: do the same
            _set_epoch_rng(self, pos.epoch_rng)
            elastic = find_elastic_sampler(self)
            if elastic is not None and pos.elastic_loaded is not None:
                # Resume through the sampler's global position: nothing is replayed. Loaded again
                # here because starting persistent workers above may have begun a pass.
                elastic.load_state_dict(pos.elastic_loaded)
                pos.elastic_pass, pos.elastic_base = elastic.next_pass(), pos.batches_yielded
                it = self._resurgo_base_class.__iter__(self)
                _prime(self, it)
            else:
                distributed = find_sampler(self, DistributedSampler)
                if distributed is not None and pos.sampler_epoch is not None:
                    # Its order is a function of its epoch, which a training loop may set only
                    # after iter() (Lightning does): the replay takes the interrupted epoch's.
                    distributed.set_epoch(pos.sampler_epoch)
                it = self._resurgo_base_class.__iter__(self)
                _skip(self, it, pos.batches_yielded)
        finally:
            # Only the global RNG goes back: the training stream continues as restored by
            # RNGState. The loader's own generators stay where the replay left them, which is
            # where the original run had them.
            torch.set_rng_state(before)
        return it

    # -- Stateful ----------------------------------------------------------------------------
    def _resurgo_elastic_position(self, sampler: ElasticSampler) -> dict[str, Any]:
        """The sampler's global position as of the batches handed to the loop."""
        pos = _position(self)
        if pos.epoch_active and pos.elastic_pass is not None:
            taken = (pos.batches_yielded - pos.elastic_base) * samples_per_batch(self)
            return sampler.position(pos.elastic_pass.epoch, pos.elastic_pass.consumed(taken))
        # Between epochs or never iterated: where the next iter() starts.
        upcoming = sampler.next_pass()
        return sampler.position(upcoming.epoch, upcoming.start)

    def state_dict(self) -> dict[str, Any]:
        """Position in the current epoch, as plain data (tensors, ints, bools)."""
        pos = _position(self)
        # Never iterated: the current states stand in, so the tree has the same shapes as one
        # from a loader mid-epoch (a fresh loader is the destination of a load).
        epoch_rng = pos.epoch_rng if pos.epoch_rng is not None else _capture_epoch_rng(self)
        elastic = find_elastic_sampler(self)
        extra: dict[str, Any] = {}
        if elastic is not None:
            extra["elastic"] = self._resurgo_elastic_position(elastic)
        distributed = find_sampler(self, DistributedSampler)
        if distributed is not None:
            extra["distributed_num_replicas"] = int(distributed.num_replicas)
            # Never iterated: the sampler's epoch stands in, so that a fresh loader (the target of
            # a load) has the keys of a saved one.
            extra["distributed_epoch"] = int(pos.sampler_epoch if pos.sampler_epoch is not None else distributed.epoch)
        epoch_rng_out: Any = _clone_rng(epoch_rng)
        generators_out: Any = {name: g.get_state() for name, g in _generators(self).items()}
        if elastic is not None:
            # The position is global, but these RNG states are the rank's own (ranks are often
            # seeded differently): kept per rank, and carried over to another number of ranks.
            epoch_rng_out = PerRank(epoch_rng_out, on_resize=_carry_over_epoch_rng)
            generators_out = PerRank(generators_out, on_resize=_carry_over_generators)
        return {
            "version": _FORMAT_VERSION,
            "epoch_rng": epoch_rng_out,
            "batches_yielded": int(pos.batches_yielded),
            "epoch_active": bool(pos.epoch_active),
            "epoch": int(pos.epoch),
            "reset_iterator": bool(pos.reset_iterator),
            # The loader's own generators as they are now: between epochs nothing is replayed,
            # so the next epoch's order depends on these.
            "generators": generators_out,
            "persistent_iterator": bool(self._resurgo_will_reset()),
            # Set by mark_epoch_finished only; present always, so that a fresh loader is a load target.
            EPOCH_FINISHED: False,
            **extra,
        }

    def _resurgo_before_load(self) -> None:
        """Refuse a load while an iterator of this loader is live (checked before anything is loaded)."""
        pos = _position(self)
        # No local reference to the iterator: the error's traceback would keep it alive.
        if pos.live is not None and pos.live() is not None and pos.epoch_active:
            refuse_live_iterator(self._resurgo_base_class.__name__, f"{plural(pos.batches_yielded, 'batch', 'batches')} handed out")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position on the next ``iter()`` (nothing is read until then)."""
        self._resurgo_before_load()
        sd = dict(state_dict)
        _check_version(sd)
        rng, now, gens = _loaded_rngs(self, sd)
        n = _batches_yielded(sd)
        elastic = find_elastic_sampler(self)
        _check_sampler_kind(elastic, sd)
        if _refused_world_size(self, sd):
            return
        sampler_epoch, epoch_finished = _epoch_marks(sd)
        elastic_loaded: dict[str, Any] | None = None
        if elastic is not None:
            elastic_loaded, finished = _load_elastic(self, elastic, sd["elastic"], epoch_finished)
        else:
            n, finished = _count_finished(self, n, epoch_finished)
        pos = _position(self)
        pos.generation += 1  # an iterator already handed out no longer moves the position
        pos.epoch_rng = rng
        pos.batches_yielded = n
        pos.epoch_active = bool(sd["epoch_active"])
        if pos.epoch_active and finished and self._resurgo_finished_epoch == "next":
            pos.epoch_active = False
        pos.epoch = int(sd.get("epoch", 0))
        pos.reset_iterator = bool(sd.get("reset_iterator", False))
        pos.persistent_iterator = bool(sd.get("persistent_iterator", False))
        pos.sampler_epoch = sampler_epoch
        pos.pending = True
        if elastic is not None:
            pos.elastic_loaded = elastic_loaded
            pos.elastic_pass, pos.elastic_base = elastic.next_pass(), n
        if not pos.epoch_active:
            # Between epochs: the next epoch starts from the generators' saved states. (Mid-epoch,
            # the replay from the epoch start brings them there.)
            for name, g in gens.items():
                g.set_state(now[name])


# -- the steps of a tracked loader's load_state_dict, in order: each checks before anything changes
def _check_version(sd: dict[str, Any]) -> None:
    version = sd.get("version", _FORMAT_VERSION)
    if version != _FORMAT_VERSION:
        raise TypeMismatchError(f"dataloader.version: expected {_FORMAT_VERSION}, got {version!r}")
    missing = [k for k in ("epoch_rng", "batches_yielded", "epoch_active") if k not in sd]
    if missing:
        raise TypeMismatchError(f"dataloader: state has no {', '.join(missing)}; not a DataLoader position")


def _loaded_rngs(loader: DataLoader, sd: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Generator]]:
    """The saved epoch-start RNG states (copies), the generators' saved current states, and the
    loader's generators, which must be those saved."""
    epoch_rng = _own(sd["epoch_rng"])
    rng: dict[str, Any] = {
        "torch": _as_uint8(epoch_rng["torch"], "epoch_rng.torch").clone(),
        "generators": {k: _as_uint8(v, f"epoch_rng.generators.{k}").clone()
                       for k, v in (epoch_rng.get("generators") or {}).items()},
    }
    now = {k: _as_uint8(v, f"generators.{k}") for k, v in (_own(sd.get("generators")) or {}).items()}
    # Fail now, not at the next iter(), if the loader is built differently.
    gens = _generators(loader)
    for key, saved in (("epoch_rng.generators", rng["generators"]), ("generators", now)):
        if set(saved) != set(gens):
            raise TypeMismatchError(
                f"dataloader.{key}: the checkpoint has generators {sorted(saved)}, this DataLoader "
                f"has {sorted(gens)}; build the loader the same way as when saving"
            )
    return rng, now, gens


def _batches_yielded(sd: dict[str, Any]) -> int:
    n = sd["batches_yielded"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeMismatchError(f"dataloader.batches_yielded: expected an int >= 0, got {n!r}")
    return n


def _check_sampler_kind(elastic: ElasticSampler | None, sd: dict[str, Any]) -> None:
    if (elastic is not None) != ("elastic" in sd):
        raise TypeMismatchError(
            "dataloader.elastic: the checkpoint "
            + ("has no ElasticSampler position, this DataLoader's sampler is an ElasticSampler"
               if elastic is not None else
               "has an ElasticSampler position, this DataLoader's sampler is not an ElasticSampler")
            + "; build the loader the same way as when saving")


def _refused_world_size(loader: Any, sd: dict[str, Any]) -> bool:
    """True (after a warning) when a DistributedSampler's position saved by another number of ranks
    is not loaded; DataPositionError when the loader is to raise."""
    distributed = find_sampler(loader, DistributedSampler)
    if distributed is None or "distributed_num_replicas" not in sd \
            or sd["distributed_num_replicas"] == distributed.num_replicas:
        return False
    # Its position is a per-rank count: on another number of ranks the replay would take
    # other samples (some twice, some never).
    message = (f"dataloader.distributed_num_replicas: saved by {plural(sd['distributed_num_replicas'], 'rank')}, "
               f"this DistributedSampler has num_replicas={distributed.num_replicas}; a DistributedSampler's "
               "position is per rank and cannot change the number of ranks")
    if loader._resurgo_on_world_size_change == "warn":
        warnings.warn(f"{message}: not loaded, the next epoch starts a new pass (resurgo.ElasticSampler "
                      "keeps a position that loads on any number of ranks)", RuntimeWarning, stacklevel=3)
        return True
    raise DataPositionError(f"{message}: use resurgo.ElasticSampler")


def _epoch_marks(sd: dict[str, Any]) -> tuple[int | None, bool]:
    """The DistributedSampler's epoch of the pass (None without one), and whether the loop marked
    the epoch finished."""
    sampler_epoch = sd.get("distributed_epoch")
    if sampler_epoch is not None and (isinstance(sampler_epoch, bool) or not isinstance(sampler_epoch, int)):
        raise TypeMismatchError(f"dataloader.distributed_epoch: expected an int, got {sampler_epoch!r}")
    epoch_finished = sd.get(EPOCH_FINISHED, False)
    if not isinstance(epoch_finished, bool):
        raise TypeMismatchError(f"dataloader.{EPOCH_FINISHED}: expected a bool, got {epoch_finished!r}")
    return sampler_epoch, epoch_finished


def _load_elastic(loader: Any, elastic: ElasticSampler, saved: Any, epoch_finished: bool) -> tuple[dict[str, Any], bool]:
    """Load the ElasticSampler's global position (validated first): the position loaded, and
    whether its epoch was finished (every sample consumed, or marked finished)."""
    elastic_loaded = dict(saved)
    elastic.load_state_dict(elastic_loaded)  # validates before anything below changes
    if epoch_finished:  # the loop ended the epoch here: its rest is consumed
        elastic_loaded = elastic.position(elastic_loaded["epoch"], elastic_loaded["num_samples"])
        elastic.load_state_dict(elastic_loaded)
    finished = elastic_loaded["consumed"] >= elastic_loaded["num_samples"]
    if finished and loader._resurgo_finished_epoch == "next":
        # The next epoch from its start, so that the sampler's length (which a loop may
        # read before iter(), as Lightning does) is a whole epoch's, not the finished one's 0.
        elastic_loaded = elastic.position(elastic_loaded["epoch"] + 1, 0)
        elastic.load_state_dict(elastic_loaded)
    return elastic_loaded, finished


def _count_finished(loader: Any, n: int, epoch_finished: bool) -> tuple[int, bool]:
    """Without an ElasticSampler: the batches to skip on resume (every batch of an epoch marked
    finished, for ``finished_epoch="empty"``), and whether the epoch was finished (its last batch
    handed out, or marked finished)."""
    length = loader_length(loader)
    finished = epoch_finished or n >= (length or n + 1)
    if epoch_finished and loader._resurgo_finished_epoch == "empty":
        # The rest of the epoch is empty: the resume skips every batch of it.
        if length is None:
            raise DataPositionError(
                f"dataloader.{EPOCH_FINISHED}: the position marks its epoch finished, and this "
                f"{loader._resurgo_base_class.__name__} has no length, so the rest of that epoch cannot be skipped; "
                "track it with finished_epoch='next' to resume at the next epoch")
        n = max(n, length)
    return n, finished

def _own(value: Any) -> Any:
    """This rank's value of a per-rank entry (a plain value passes through)."""
    return value.value if isinstance(value, PerRank) else value


def _carry_over_epoch_rng(saved: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
    """Epoch-start RNG of ``rank`` in a job resumed from ``len(saved)`` ranks (ElasticSampler loaders).

    A rank that existed keeps its own. A new rank gets a torch state derived from rank
    ``rank % len(saved)``'s and its own rank number (as :func:`carry_over_rng` derives new ranks'
    streams), so its workers' base seed is its own; the loader's generators are those of that rank.
    """
    if rank < len(saved):
        return saved[rank]
    derived = carry_over_rng([{"torch": s["torch"]} for s in saved], rank, world)
    return {"torch": derived["torch"], "generators": saved[rank % len(saved)]["generators"]}


def _carry_over_generators(saved: list[Any], rank: int, world: int) -> Any:
    """The loader's generator states for ``rank``: its own, or for a new rank those of ``rank % len(saved)``."""
    return saved[rank] if rank < len(saved) else saved[rank % len(saved)]


def _position(loader: Any) -> _Position:
    pos = loader.__dict__.get(_ATTR)
    if pos is None:
        pos = _Position()
        loader.__dict__[_ATTR] = pos
    return pos


def _tracked_class(cls: type, on_world_size_change: str = "raise", finished_epoch: str = "empty") -> type:
    key = (cls, on_world_size_change, finished_epoch)
    tracked = _TRACKED_CLASSES.get(key)
    if tracked is None:
        methods = {k: v for k, v in vars(_TrackedDataLoaderMixin).items()
                   if k not in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__",
                                "__annotations__")}
        tracked = type(f"Tracked{cls.__name__}", (cls,), {
            **methods,
            "__module__": __name__,
            "__qualname__": f"Tracked{cls.__qualname__}",
            "__doc__": cls.__doc__,
            "_resurgo_base_class": cls,
            "_resurgo_on_world_size_change": on_world_size_change,
            "_resurgo_finished_epoch": finished_epoch,
            "__slots__": (),  # same layout as cls, so that __class__ can be assigned
        })
        _TRACKED_CLASSES[key] = tracked
    return tracked


def mark_epoch_finished(loader: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict``, ``loader``'s saved position, marked as at its epoch's end.

    For a training loop that ends an epoch before the loader runs out (Lightning's
    ``limit_train_batches``): the loader's own count says "mid-epoch", while the loop will resume at
    the next epoch. Loaded into a loader tracked with ``finished_epoch="next"``, the marked position
    resumes at the next epoch's start, as a position saved at the epoch's last batch does.
    ``loader``: a DataLoader made resumable by :func:`track_dataloader` (its ``"epoch_finished"``
    key; with an ElasticSampler, that epoch's samples count as consumed; tracked with ``"empty"``,
    the first ``iter()`` after the load gives the rest of the marked epoch: nothing) or a torchdata
    ``StatefulDataLoader`` (its iterator marked finished, which torchdata resumes at the next epoch
    whatever ``finished_epoch``). Any other loader's state is returned as it is: its position is
    its own.
    """
    if is_tracked(loader):
        return {**state_dict, EPOCH_FINISHED: True}
    if is_stateful_dataloader(loader):
        return {**state_dict, ITERATOR_FINISHED: True}
    return dict(state_dict)


def is_tracked(loader: Any) -> bool:
    """True if ``loader`` was made resumable by :func:`track_dataloader`."""
    return type(loader) in _TRACKED_CLASSES.values()


def track_dataloader(loader: DataLoader, *, on_world_size_change: str | None = None,
                     finished_epoch: str | None = None) -> DataLoader:
    """Make ``loader`` resumable in place and return it (the same object).

    Its ``__class__`` is replaced, in place, by a subclass of its class (made once per class, named
    ``Tracked<Class>``) with ``state_dict()``/``load_state_dict()``; iteration is unchanged and
    ``isinstance`` checks against its own class still hold. Call it before the first ``iter()`` of
    an epoch that should be resumable. A DataLoader that has its own ``state_dict()`` (torchdata's
    ``StatefulDataLoader``) keeps it, and its class becomes ``Resumable<Class>``, which guards its
    first ``iter()`` after a load (:mod:`resurgo.state.stateful_loader`). Any other object with
    ``state_dict()``/``load_state_dict()`` is returned as is, its class unchanged.
    ``on_world_size_change``: what a load of a DistributedSampler's position saved by another
    number of ranks does: ``"raise"`` (the default, DataPositionError) or ``"warn"`` (a
    RuntimeWarning, and nothing is loaded: the next ``iter()`` starts a new pass).
    ``finished_epoch``: what the first ``iter()`` after loading a position saved once the
    epoch's last batch was handed out (before its StopIteration) gives: ``"empty"`` (the default:
    the rest of that epoch, no batch) or ``"next"`` (the next epoch, for a loop that counts that
    epoch as done when it resumes, as Lightning does). Options not given stay as they were.
    """
    if on_world_size_change not in (None, "raise", "warn"):
        raise UnsupportedValueError(f"track_dataloader: on_world_size_change must be 'raise' or 'warn', "
                                    f"got {on_world_size_change!r}")
    if finished_epoch not in (None, "empty", "next"):
        raise UnsupportedValueError(f"track_dataloader: finished_epoch must be 'empty' or 'next', got {finished_epoch!r}")
    if is_tracked(loader):
        tracked = type(loader)
        loader.__class__ = _tracked_class(
            getattr(tracked, "_resurgo_base_class"),
            on_world_size_change or getattr(tracked, "_resurgo_on_world_size_change"),
            finished_epoch or getattr(tracked, "_resurgo_finished_epoch"))
        return loader
    if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
        if isinstance(loader, DataLoader):
            kept = getattr(type(loader), "_resurgo_finished_epoch", "empty")
            loader.__class__ = rng_guarded_class(type(loader), finished_epoch or kept)
        return loader
    if not isinstance(loader, DataLoader):
        raise UnsupportedValueError(
            f"dataloader: expected a torch.utils.data.DataLoader or an object with state_dict()/"
            f"load_state_dict(), got {type(loader).__name__}"
        )
    loader.__class__ = _tracked_class(type(loader), on_world_size_change or "raise", finished_epoch or "empty")
    _position(loader)
    return loader
