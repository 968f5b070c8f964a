"""ElasticSampler: a distributed sampler whose position is global, so the data-parallel size can change.

This module owns which sample every rank reads, and the saved data position. The position is
``(epoch, seed, consumed)``: the epoch's order is a function of ``seed + epoch`` alone, and
``consumed`` counts the samples of that order that ALL ranks together have consumed. Nothing in
it depends on the rank or on the world size, so ``state_dict()`` is identical on every rank: the
position can be saved once (by any rank) and loaded by every rank of a job of any size, which then
continues the same global sequence, no sample repeated and none skipped.

Layout (strided, as torch's ``DistributedSampler``). The epoch is a sequence of global positions
0, 1, 2, ... over ``order = randperm(n, seed + epoch)`` (or ``range(n)`` unshuffled). A pass that
starts at position ``p`` on ``W`` ranks gives rank ``r`` the positions ``p + r + W * j`` for
``j = 0, 1, ...``. When every rank has taken ``t`` samples (ranks step in lockstep), the positions
consumed are exactly ``[p, p + t * W)``, at any ``t``: the position does not depend on the batch
size, and global batch ``g`` of ``B`` samples per rank is ``[p + g*W*B, p + (g+1)*W*B)``. (Giving
each rank a contiguous block of ``B`` would only have a global position at whole global batches.)
A pass from ``p = 0`` is index for index what ``DistributedSampler`` yields with the same seed.

Tail of the epoch, ``R = n - p`` samples left:
- ``drop_last=False``: each rank gets ``ceil(R / W)``; the ``ceil(R / W) * W - R`` missing
  positions (fewer than ``W``) are padding, filled with the first samples of the epoch's order
  (``order[q % n]`` for position ``q >= n``), so those few samples are seen twice in that epoch,
  exactly as with ``DistributedSampler``. Padding is only ever added at the end of a pass that
  reaches the end of the epoch; a resumed pass pads for its own world size.
- ``drop_last=True``: each rank gets ``floor(R / W)`` (with ``batch_size=B``: ``floor(R / (W*B))
  * B``, whole global batches only); the last ``R mod W`` (or ``R mod W*B``) samples of the epoch
  are not seen in that epoch.
A pass whose ranks have taken all their samples has consumed the epoch: ``consumed == n``.

Which pass ``iter()`` starts: a position restored by ``load_state_dict`` is used by the next
``iter()`` if the sampler's epoch is still the restored one; any other ``iter()`` starts the
current epoch at position 0 (as ``DistributedSampler`` repeats an epoch that is iterated twice).
``load_state_dict`` adopts the saved epoch unless ``set_epoch`` was called on this sampler: an
explicit ``set_epoch`` wins (torchdata's ``StatefulDataLoader`` loads the sampler inside ``iter()``,
after the training loop's ``set_epoch``), and a restored position of another epoch is dropped.

The sampler counts the indices it hands out; a DataLoader that prefetches takes them before the
training loop sees them. The tracked DataLoader (``data_position``) and torchdata's
``StatefulDataLoader`` therefore record the position of the batches delivered to the loop, not
the sampler's live count (see ``elastic_loader``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from resurgo.errors import DataPositionError

__all__ = ["ElasticSampler", "EpochPass", "per_rank_count", "rank_positions", "consumed_after",
           "epoch_order", "POSITION_KEYS"]

_FORMAT_VERSION = 1
# Every key of a saved position; a dict with exactly these keys is an ElasticSampler position.
POSITION_KEYS = frozenset({"version", "epoch", "seed", "shuffle", "consumed", "num_samples", "num_replicas"})


# -- pure index logic ---------------------------------------------------------------------------
def per_rank_count(num_samples: int, start: int, num_replicas: int, *, drop_last: bool,
                   batch_size: int | None = None) -> int:
    """How many indices each rank takes in a pass from global position ``start`` to the epoch's end."""
    remaining = num_samples - start
    if not drop_last:
        return -(-remaining // num_replicas)  # ceil: the tail is padded
    if batch_size is None:
        return remaining // num_replicas
    return remaining // (num_replicas * batch_size) * batch_size


def rank_positions(start: int, num_replicas: int, rank: int, count: int) -> range:
    """The global positions rank ``rank`` takes, in order: ``start + rank + num_replicas * j``."""
    first = start + rank
    return range(first, first + count * num_replicas, num_replicas)


def consumed_after(num_samples: int, start: int, num_replicas: int, count: int, taken: int) -> int:
    """Global position once every rank has taken ``taken`` of its ``count`` indices of a pass.

    A finished pass has consumed the epoch (padding and a dropped tail included): ``num_samples``.
    """
    if taken >= count:
        return num_samples
    return start + taken * num_replicas


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's global order of sample indices (the same draw as ``DistributedSampler``)."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


@dataclass(frozen=True)
class EpochPass:
    """One pass over an epoch as one rank sees it: where it starts and how many indices it yields."""

    epoch: int
    start: int
    count: int
    num_samples: int
    num_replicas: int

    def consumed(self, taken: int) -> int:
        """Global position after every rank has taken ``taken`` indices of this pass."""
        return consumed_after(self.num_samples, self.start, self.num_replicas, self.count, taken)


class _Progress:
    """How many indices a live pass has handed out (one per iterator, so an old one cannot move a new one)."""

    __slots__ = ("epoch_pass", "taken")

    def __init__(self, epoch_pass: EpochPass) -> None:
        self.epoch_pass = epoch_pass
        self.taken = 0


# -- the sampler --------------------------------------------------------------------------------
class ElasticSampler(Sampler[int]):
    """A resumable distributed sampler whose saved position is global (see the module docstring).

    ``ElasticSampler(dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False,
    batch_size=None)``: ``num_replicas``/``rank`` default to torch.distributed's world size and rank
    when a process group is initialized, else 1 and 0. ``batch_size`` (the per-rank batch size) only
    matters with ``drop_last=True``: the tail is then dropped to whole global batches.

    ``state_dict()`` is ``{"version", "epoch", "seed", "shuffle", "consumed", "num_samples",
    "num_replicas"}`` where ``consumed`` is the number of samples of the epoch's order consumed by
    all ranks together. It is the same on every rank (``num_replicas`` is recorded for information
    and for converting batch counts; it does not change the position), so one copy restores every
    rank of any new world size. ``load_state_dict()`` checks the dataset length and the shuffle
    flag, adopts the saved seed, and makes the next ``iter()`` continue from ``consumed``.
    """

    def __init__(self, dataset: Sized, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 batch_size: int | None = None) -> None:
        world, me = _world(num_replicas, rank)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise DataPositionError(f"ElasticSampler: batch_size must be None or an int >= 1, got {batch_size!r}")
        _require_int("ElasticSampler", "seed", seed)
        self.dataset = dataset
        self.num_replicas = world
        self.rank = me
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.batch_size = batch_size
        self.epoch = 0
        self._epoch_set = False  # set_epoch() was called: it wins over a loaded epoch
        self._resume: tuple[int, int] | None = None  # (epoch, consumed) for the next iter()
        self._live: _Progress | None = None  # the latest pass handed out by iter()

    # -- epochs and passes ---------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order (seeded by ``seed + epoch``) from the next ``iter()`` on."""
        _require_int("ElasticSampler.set_epoch", "epoch", epoch, minimum=0)
        self.epoch = epoch
        self._epoch_set = True

    def next_pass(self) -> EpochPass:
        """The pass the next ``iter()`` would start (no side effect)."""
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        return self._pass_from(start)

    def whole_pass(self) -> EpochPass:
        """The pass over the whole current epoch, from its start (no side effect)."""
        return self._pass_from(0)

    def _pass_from(self, start: int) -> EpochPass:
        n = len(self.dataset)
        count = per_rank_count(n, start, self.num_replicas, drop_last=self.drop_last, batch_size=self.batch_size)
        return EpochPass(self.epoch, start, count, n, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        epoch_pass = self.next_pass()
        self._resume = None
        progress = _Progress(epoch_pass)
        self._live = progress
        return self._indices(progress)

    def _indices(self, progress: _Progress) -> Iterator[int]:
        p = progress.epoch_pass
        if p.count == 0:
            return
        order = epoch_order(p.num_samples, self.seed, p.epoch, self.shuffle)
        for position in rank_positions(p.start, p.num_replicas, self.rank, p.count):
            progress.taken += 1
            yield order[position % p.num_samples]  # positions >= n are the padding

    def __len__(self) -> int:
        """Indices in the current pass (a resumed pass has only what was left of the epoch)."""
        live = self._live
        if self._resume is None and live is not None and live.epoch_pass.epoch == self.epoch:
            return live.epoch_pass.count
        return self.next_pass().count

    # -- position ------------------------------------------------------------------------------
    def position(self, epoch: int, consumed: int) -> dict[str, Any]:
        """The saved form of position ``consumed`` in epoch ``epoch`` of this sampler."""
        return {
            "version": _FORMAT_VERSION,
            "epoch": int(epoch),
            "seed": int(self.seed),
            "shuffle": self.shuffle,
            "consumed": int(consumed),
            "num_samples": len(self.dataset),
            "num_replicas": self.num_replicas,
        }

    def state_dict(self) -> dict[str, Any]:
        """The global position: where the next sample of the current epoch comes from."""
        if self._resume is not None and self._resume[0] == self.epoch:
            consumed = self._resume[1]
        elif self._live is not None and self._live.epoch_pass.epoch == self.epoch:
            consumed = self._live.epoch_pass.consumed(self._live.taken)
        else:
            consumed = 0
        return self.position(self.epoch, consumed)

    def check_position(self, state_dict: Any) -> tuple[int, int, int]:
        """Validate a saved position against this sampler; returns ``(epoch, seed, consumed)``."""
        if not isinstance(state_dict, dict):
            raise DataPositionError(f"ElasticSampler position: expected a dict, got {type(state_dict).__name__}")
        missing = sorted(k for k in ("epoch", "seed", "consumed", "num_samples") if k not in state_dict)
        if missing:
            raise DataPositionError(
                f"ElasticSampler position: missing {', '.join(missing)}; got keys {sorted(map(str, state_dict))}")
        version = state_dict.get("version", _FORMAT_VERSION)
        if version != _FORMAT_VERSION:
            raise DataPositionError(f"ElasticSampler position 'version': expected {_FORMAT_VERSION}, got {version!r}")
        n = len(self.dataset)
        saved_n = _require_int("ElasticSampler position", "num_samples", state_dict["num_samples"], minimum=0)
        if saved_n != n:
            raise DataPositionError(
                f"ElasticSampler position 'num_samples': saved for a dataset of {saved_n} samples, this "
                f"sampler's dataset has {n}; the global order would differ")
        if "shuffle" in state_dict and bool(state_dict["shuffle"]) != self.shuffle:
            raise DataPositionError(
                f"ElasticSampler position 'shuffle': saved with shuffle={bool(state_dict['shuffle'])}, this "
                f"sampler has shuffle={self.shuffle}; the global order would differ")
        epoch = _require_int("ElasticSampler position", "epoch", state_dict["epoch"], minimum=0)
        seed = _require_int("ElasticSampler position", "seed", state_dict["seed"])
        consumed = _require_int("ElasticSampler position", "consumed", state_dict["consumed"], minimum=0)
        if consumed > n:
            raise DataPositionError(
                f"ElasticSampler position 'consumed': {consumed} is past the end of the epoch ({n} samples)")
        return epoch, seed, consumed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved position at the next ``iter()`` (of the saved epoch)."""
        epoch, seed, consumed = self.check_position(state_dict)
        self.seed = seed
        if not self._epoch_set:
            self.epoch = epoch
        self._resume = (epoch, consumed)

    def __repr__(self) -> str:
        return (f"ElasticSampler(num_samples={len(self.dataset)}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
                f"batch_size={self.batch_size}, epoch={self.epoch})")


def _require_int(where: str, key: str, value: Any, minimum: int | None = None) -> int:
    # bool is an int to Python, but never a count or a seed here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataPositionError(f"{where} '{key}': expected an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise DataPositionError(f"{where} '{key}': expected an int >= {minimum}, got {value}")
    return value


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(num_replicas, rank), defaulting to torch.distributed's when a process group exists."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if num_replicas is None:
        num_replicas = torch.distributed.get_world_size() if initialized else 1
    if rank is None:
        rank = torch.distributed.get_rank() if initialized else 0
    _require_int("ElasticSampler", "num_replicas", num_replicas, minimum=1)
    _require_int("ElasticSampler", "rank", rank, minimum=0)
    if rank >= num_replicas:
        raise DataPositionError(f"ElasticSampler 'rank': {rank} is not below num_replicas={num_replicas}")
    return num_replicas, rank

