"""torchdata's ``StatefulDataLoader`` made exactly resumable: its own ``state_dict`` is kept, and
:func:`track_dataloader` swaps its class for a subclass (made once per class) that

- draws no RNG in the first ``iter()`` after a load: torchdata 0.11 draws a fresh base seed there
  and then overwrites it with the saved one, a draw the uninterrupted run made before the
  checkpoint, which would shift the restored RNG streams;
- refuses a load while an iterator made before it is still held and not exhausted;
- resumes at the next epoch a position saved with its iterator finished, or (``finished_epoch=
  "next"``) at its epoch's last batch;
- has the whole epoch's length with an ElasticSampler.

Also the parts both kinds of resumable loader share: that length, the live-iterator refusal and
the loader's own length.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader

from resurgo.errors import DataPositionError
from resurgo.state.elastic_loader import (
    NUM_YIELDED,
    ITERATOR_FINISHED,
    SNAPSHOT,
    SNAPSHOT_STEP,
    STEPS_SINCE_SNAPSHOT,
    epoch_batches,
    find_elastic_sampler,
    prepare_stateful_load,
    samples_per_batch,
)


def epoch_length(loader: Any) -> int:
    """A resumable loader's length: the batches of its epoch. With an ElasticSampler, a whole epoch's
    on this world size even while a resumed pass yields only the rest of it, as a plain DataLoader's
    length is its epoch's while a mid-epoch resume skips the batches before the checkpoint (a loop
    that reads the length after loading, as Lightning does, counts the resumed epoch's batches
    from its start)."""
    elastic = find_elastic_sampler(loader)
    whole = epoch_batches(loader, elastic) if elastic is not None else None
    return whole if whole is not None else loader._resurgo_base_class.__len__(loader)


def refuse_live_iterator(loader: str, progress: str) -> None:
    # A loaded position applies to the next iter(): an iterator made before the load would go on
    # from where it is, silently training on the wrong batches.
    raise DataPositionError(
        f"dataloader: this {loader}'s iterator was created before the load ({progress}); it would not move to "
        "the loaded data position. Call resurgo.load before iter(loader) / the for loop (or finish or drop "
        "that iterator first)")


def loader_length(loader: DataLoader) -> int | None:
    """The number of batches of an epoch, if the loader knows it."""
    try:
        return len(loader)
    except TypeError:
        return None


_GUARDED_CLASSES: dict[tuple[type, str], type] = {}
_RESUMING = "_resurgo_resuming"


class _WatchedIterator:
    """A StatefulDataLoader's iterator, watched: whether it is still held and not exhausted."""

    def __init__(self, it: Any) -> None:
        self._it = it
        self.exhausted = False

    def __iter__(self) -> _WatchedIterator:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self.exhausted = True
            raise

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        if name == "_it":
            raise AttributeError(name)
        return getattr(self._it, name)


_LIVE = "_resurgo_live"


def _guarded_before_load(self: Any) -> None:
    ref = self.__dict__.get(_LIVE)
    # No local reference to the iterator: the error's traceback would keep it alive.
    if ref is not None and ref() is not None and not ref().exhausted:
        refuse_live_iterator(self._resurgo_base_class.__name__, "its position is not the loaded one")


def _guarded_load_state_dict(self: Any, state_dict: Any) -> Any:
    _guarded_before_load(self)
    elastic = find_elastic_sampler(self)
    if elastic is not None and isinstance(state_dict, dict):
        # torchdata replays the batches since its last snapshot: on another world size those would
        # be other samples, so there they become part of the global position instead.
        state_dict = prepare_stateful_load(state_dict, elastic, samples_per_batch(self))
    finished = isinstance(state_dict, dict) and state_dict.get(ITERATOR_FINISHED) is True
    if finished or (self._resurgo_finished_epoch == "next" and _at_epoch_end(self, state_dict)):
        # Saved with its iterator finished, or at the epoch's last batch: the next iter() starts
        # the next epoch, as the uninterrupted run's did, drawing its seeds as that one did. Built
        # now (the loaded samplers and datasets take their saved states) without drawing; marked
        # finished, so that iter() builds or resets a new one.
        result = self._resurgo_base_class.load_state_dict(self, {**state_dict, ITERATOR_FINISHED: True})
        _without_rng_draws(self, lambda: setattr(self, "_iterator", self._get_iterator()))
        if elastic is not None:
            # The loaded pass is the finished epoch's: the next iter() starts the next epoch, and
            # the sampler's length (read before iter(), as Lightning does) is a whole epoch's.
            elastic.load_state_dict(elastic.position(elastic.epoch + 1, 0))
        return result
    result = self._resurgo_base_class.load_state_dict(self, state_dict)
    self.__dict__[_RESUMING] = True
    return result


def _at_epoch_end(loader: Any, state_dict: Any) -> bool:
    """True if a StatefulDataLoader's state was taken once every batch of its epoch was handed out."""
    if not isinstance(state_dict, dict):
        return False
    if NUM_YIELDED in state_dict:  # no workers
        handed_out = state_dict[NUM_YIELDED]
    elif isinstance(state_dict.get(SNAPSHOT), dict) and SNAPSHOT_STEP in state_dict[SNAPSHOT]:
        handed_out = state_dict[SNAPSHOT][SNAPSHOT_STEP] + state_dict.get(STEPS_SINCE_SNAPSHOT, 0)
    else:
        return False
    length = loader_length(loader)
    return isinstance(handed_out, int) and length is not None and handed_out >= length > 0


def _without_rng_draws(loader: Any, build: Any) -> Any:
    """``build()`` with the sources of a loader's base seed (the global CPU RNG, its generator)
    set back afterwards."""
    cpu = torch.get_rng_state()
    gen = getattr(loader, "generator", None)
    gen_state = gen.get_state() if isinstance(gen, torch.Generator) else None
    try:
        return build()
    finally:
        torch.set_rng_state(cpu)
        if gen is not None and gen_state is not None:
            gen.set_state(gen_state)


def _guarded_iter(self: Any) -> Any:
    watched = _WatchedIterator(_guarded_base_iter(self))
    self.__dict__[_LIVE] = weakref.ref(watched)
    return watched


def _guarded_base_iter(self: Any) -> Any:
    # A resumed StatefulDataLoader (torchdata 0.11) draws a fresh base seed from the global RNG
    # (or its generator) and then overwrites it with the saved one; the uninterrupted run made that
    # draw before the checkpoint, so the restored RNG streams must not see it again.
    if not self.__dict__.pop(_RESUMING, False):
        return self._resurgo_base_class.__iter__(self)
    # Only the sources of that base seed are guarded: the sampler's generator is legitimately
    # set from the checkpoint while the iterator is built.
    return _without_rng_draws(self, lambda: self._resurgo_base_class.__iter__(self))


def rng_guarded_class(cls: type, finished_epoch: str = "empty") -> type:
    """A subclass of a loader with its own state_dict whose first iter() after a load draws no RNG."""
    if cls in _GUARDED_CLASSES.values():
        cls = getattr(cls, "_resurgo_base_class")
    key = (cls, finished_epoch)
    guarded = _GUARDED_CLASSES.get(key)
    if guarded is None:
        guarded = type(f"Resumable{cls.__name__}", (cls,), {
            "__iter__": _guarded_iter,
            "__len__": epoch_length,
            "load_state_dict": _guarded_load_state_dict,
            "_resurgo_before_load": _guarded_before_load,
            "__module__": __name__,
            "__qualname__": f"Resumable{cls.__qualname__}",
            "__doc__": cls.__doc__,
            "_resurgo_base_class": cls,
            "_resurgo_finished_epoch": finished_epoch,
            "__slots__": (),
        })
        _GUARDED_CLASSES[key] = guarded
    return guarded
