"""The global data position of a loader whose sampler is an ElasticSampler.

This module owns reading that position out of the loaders resurgo supports, as of the batches
delivered to the training loop (never of what workers prefetched):
- a DataLoader made resumable by ``track_dataloader`` keeps it under its state's ``"elastic"``
  key (``data_position`` computes it from the batches it handed out);
- torchdata's ``StatefulDataLoader`` stores the sampler's ``state_dict()`` in its own state, taken
  when the indices of each delivered batch were drawn. With ``snapshot_every_n_steps=k > 1`` and
  workers, that snapshot can be up to ``k - 1`` batches old and torchdata replays those batches on
  load, which on another world size would replay other samples. :func:`fold_snapshot_steps` turns
  the batches since the snapshot into global samples (``batches * batch_size * saved world
  size``) so that nothing is replayed.
:func:`elastic_state` returns the position of any of them, or of an ElasticSampler itself.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

from resurgo.errors import DataPositionError, UnsupportedValueError
from resurgo.state.elastic_sampler import POSITION_KEYS, ElasticSampler, consumed_after, per_rank_count

T = TypeVar("T")

__all__ = ["elastic_state", "find_sampler", "find_elastic_sampler", "samples_per_batch", "fold_snapshot_steps",
           "prepare_stateful_load", "is_stateful_dataloader", "batches_of", "epoch_batches"]

# torchdata 0.11 StatefulDataLoader state keys (stateful_dataloader.py); a test checks them against
# torchdata's own constants so a rename fails loudly.
STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"
SNAPSHOT = "_snapshot"
SNAPSHOT_STEP = "_snapshot_step"
LAST_YIELDED_WORKER_ID = "_last_yielded_worker_id"
MAIN_SNAPSHOT = "_main_snapshot"
NUM_WORKERS = "_num_workers"
SAMPLER_ITER_YIELDED = "_sampler_iter_yielded"
SAMPLER_ITER_STATE = "_sampler_iter_state"
SAMPLES_YIELDED = "samples_yielded"  # torchdata's BatchSampler iterator: samples drawn
NUM_YIELDED = "_num_yielded"  # batches handed out, without workers
ITERATOR_FINISHED = "_iterator_finished"


def find_sampler(loader: Any, kind: type[T]) -> T | None:
    """The sampler of class ``kind`` a DataLoader draws from (``sampler=`` or inside ``batch_sampler=``)."""
    # With batch_sampler=, DataLoader.sampler is a SequentialSampler it made up: look inside first.
    for candidate in (getattr(getattr(loader, "batch_sampler", None), "sampler", None),
                      getattr(loader, "sampler", None)):
        if isinstance(candidate, kind):
            return candidate
    return None


def find_elastic_sampler(loader: Any) -> ElasticSampler | None:
    """The ElasticSampler a DataLoader draws from, if any."""
    return find_sampler(loader, ElasticSampler)


def samples_per_batch(loader: Any) -> int:
    """Samples per rank in each full batch the loader yields (1 without automatic batching)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None:
        return 1  # batch_size=None: every item is one sample
    size = getattr(batch_sampler, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UnsupportedValueError(
            f"dataloader.batch_sampler: a {type(batch_sampler).__name__} has no int batch_size; with an "
            "ElasticSampler the data position counts batches of a fixed size (use torch's BatchSampler)")
    return size


def batches_of(loader: Any, count: int) -> int | None:
    """How many batches ``loader`` makes of ``count`` samples of its rank; None if its batch
    sampler is not torch's ``BatchSampler`` (whose length is known from its size and drop_last)."""
    from torch.utils.data import BatchSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None:
        return count  # batch_size=None: every item is one sample
    if not isinstance(batch_sampler, BatchSampler):
        return None
    size = batch_sampler.batch_size
    return count // size if batch_sampler.drop_last else -(-count // size)


def epoch_batches(loader: Any, sampler: ElasticSampler) -> int | None:
    """Batches in the whole current epoch of ``loader`` drawing from ``sampler`` on this world size,
    whatever part of it a resumed pass still yields (None as for :func:`batches_of`)."""
    return batches_of(loader, sampler.whole_pass().count)


def _positions_in(tree: Any) -> list[dict[str, Any]]:
    """Every ElasticSampler position inside a nested state (dicts and lists)."""
    found: list[dict[str, Any]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if set(node) == POSITION_KEYS:
                found.append(node)
                continue
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return found


def fold_snapshot_steps(state: dict[str, Any], sampler: ElasticSampler, batch_size: int, *,
                        resized_only: bool = False) -> dict[str, Any]:
    """A copy of a StatefulDataLoader state with the batches since its snapshot folded into the position.

    The sampler position in the snapshot moves forward by ``steps * batch_size`` samples per rank on
    the world size that saved it; torchdata's own counters move by ``steps`` so that its snapshot
    schedule stays aligned; ``steps_since_snapshot`` becomes 0, so nothing is replayed on load.
    With ``resized_only``, a state saved on the sampler's own world size is returned as is: there
    torchdata's replay is exact (and replays worker-side state too).
    """
    steps = state.get(STEPS_SINCE_SNAPSHOT, 0)
    if not steps:
        return state
    if resized_only:
        saved = _positions_in(state.get(SNAPSHOT))
        if len(saved) == 1 and saved[0].get("num_replicas") == sampler.num_replicas:
            return state
    out = copy.deepcopy(state)
    try:
        snapshot = out[SNAPSHOT]
        main = snapshot[MAIN_SNAPSHOT]
        num_workers = main[NUM_WORKERS]
        snapshot[SNAPSHOT_STEP] += steps
        snapshot[LAST_YIELDED_WORKER_ID] = (snapshot[LAST_YIELDED_WORKER_ID] + steps) % num_workers
        main[SAMPLER_ITER_YIELDED] += steps
    except (KeyError, TypeError) as e:
        raise UnsupportedValueError(
            f"dataloader: a StatefulDataLoader state without the expected '{SNAPSHOT}.{MAIN_SNAPSHOT}' layout "
            f"(missing {e}); this torchdata version is not supported with an ElasticSampler and "
            "snapshot_every_n_steps > 1") from e
    iter_state = main.get(SAMPLER_ITER_STATE)
    if isinstance(iter_state, dict) and SAMPLES_YIELDED in iter_state:
        iter_state[SAMPLES_YIELDED] += steps * batch_size
    positions = _positions_in(main)
    if len(positions) != 1:
        raise DataPositionError(
            f"dataloader.{SNAPSHOT}.{MAIN_SNAPSHOT}: expected one ElasticSampler position, found {len(positions)}")
    position = positions[0]
    _, _, consumed = sampler.check_position(position)
    saved_world = position["num_replicas"]
    if isinstance(saved_world, bool) or not isinstance(saved_world, int) or saved_world < 1:
        raise DataPositionError(f"ElasticSampler position 'num_replicas': expected an int >= 1, got {saved_world!r}")
    n = position["num_samples"]
    count = per_rank_count(n, consumed, saved_world, drop_last=sampler.drop_last, batch_size=sampler.batch_size)
    position["consumed"] = consumed_after(n, consumed, saved_world, count, steps * batch_size)
    out[STEPS_SINCE_SNAPSHOT] = 0
    return out


def prepare_stateful_load(state: dict[str, Any], sampler: ElasticSampler, batch_size: int) -> dict[str, Any]:
    """A StatefulDataLoader state ready to load into a loader drawing from ``sampler``.

    The state must hold the sampler's position (torchdata saves it only for ``sampler=``: a
    ``batch_sampler=`` of torch's own would be fast-forwarded by a per-rank count). Batches since the
    last snapshot are folded into the position when the world size changed.
    """
    if state and not _positions_in(state):
        raise DataPositionError(
            "dataloader: the StatefulDataLoader state holds no ElasticSampler position, so it cannot resume on "
            "another world size; pass the ElasticSampler as sampler= (with batch_size=) so that torchdata's "
            "stateful batch sampler saves its state")
    return fold_snapshot_steps(state, sampler, batch_size, resized_only=True)


def is_stateful_dataloader(loader: Any) -> bool:
    """True if ``loader`` is a torchdata ``StatefulDataLoader`` (False when torchdata is not installed)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return False
    return isinstance(loader, StatefulDataLoader)


def elastic_state(loader: Any) -> dict[str, Any]:
    """The global data position of ``loader`` as of the batches delivered to the training loop.

    ``loader`` is an :class:`ElasticSampler`, a DataLoader made resumable by ``TrainState`` /
    ``track_dataloader``, or a torchdata ``StatefulDataLoader``, whose sampler is an ElasticSampler.
    The result is the same on every rank of the job (a global position): log it, compare it, or save
    it once. Raises UnsupportedValueError for any other loader.
    """
    if isinstance(loader, ElasticSampler):
        return loader.state_dict()
    sampler = find_elastic_sampler(loader)
    if sampler is None:
        raise UnsupportedValueError(
            f"elastic_state: a {type(loader).__name__} whose sampler is not an ElasticSampler has no global "
            "data position")
    if is_stateful_dataloader(loader):
        folded = fold_snapshot_steps(loader.state_dict(), sampler, samples_per_batch(loader))
        positions = _positions_in(folded)
        if len(positions) != 1:
            raise DataPositionError(
                f"elastic_state: expected one ElasticSampler position in the StatefulDataLoader state, found "
                f"{len(positions)}")
        return dict(positions[0])
    state_dict = getattr(loader, "state_dict", None)
    tracked = state_dict() if callable(state_dict) else None
    if not isinstance(tracked, dict) or "elastic" not in tracked:
        raise UnsupportedValueError(
            f"elastic_state: a {type(loader).__name__} is not tracked; pass it to resurgo.TrainState(dataloader=...) "
            "(or track_dataloader) before iterating it")
    return dict(tracked["elastic"])
