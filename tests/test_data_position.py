"""Resuming a plain DataLoader mid-epoch gives exactly the batches of the uninterrupted run.

Each scenario runs a reference loop for a number of steps, then the same loop interrupted at
step k: loader position and RNG are saved, a fresh loader (built the same way) and scrambled
global RNGs stand for the new process, state is restored the way the core does (see
_state_roundtrip), and the loop finishes. Batches (which carry the sample index and a random
"augmentation" drawn while loading) and a per-step draw from the training RNG must be equal
bit for bit.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _state_roundtrip as core  # noqa: E402

from resurgo.errors import TypeMismatchError, UnsupportedValueError  # noqa: E402
from resurgo.state.data_position import is_tracked, track_dataloader  # noqa: E402
from resurgo.state.rng import RNGState  # noqa: E402

N_SAMPLES = 22  # with batch 4: 6 batches per epoch, the last one short


class IndexDataset(Dataset):
    """Sample i is (i, a random number): the random number shows which RNG loading used."""

    def __init__(self, n: int = N_SAMPLES, augment: bool = True) -> None:
        self.n = n
        self.augment = augment

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        noise = torch.rand(()) if self.augment else torch.zeros(())
        return torch.tensor(i), noise


def make_loader(kind: str) -> DataLoader:
    ds = IndexDataset()
    if kind == "shuffle":
        return DataLoader(ds, batch_size=4, shuffle=True)
    if kind == "workers":
        return DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    if kind == "persistent":
        # Worker-side augmentation cannot be reproduced with persistent workers (documented).
        return DataLoader(IndexDataset(augment=False), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=True)
    if kind == "generator":
        return DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    if kind == "two_generators":
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(11))
        return DataLoader(ds, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(12))
    if kind == "replacement":
        # Draws from its generator every 32 samples, lazily: skipping must replay those draws.
        sampler = RandomSampler(ds, replacement=True, num_samples=70, generator=torch.Generator().manual_seed(3))
        return DataLoader(ds, batch_size=5, sampler=sampler, drop_last=True)
    if kind == "sequential":
        return DataLoader(ds, batch_size=4)
    raise ValueError(kind)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_loop(loader, steps: int, record: list, stop_at: int | None = None) -> int:
    """Step-based loop over epochs; returns the step reached. Stops (mid-epoch) after ``stop_at``."""
    step = len(record)
    while step < steps:
        for idx, noise in loader:
            # The "training" RNG stream: must continue unchanged across the restart.
            record.append((idx.clone(), noise.clone(), torch.rand(2), random.random(), np.random.rand()))
            step += 1
            if step == steps or step == stop_at:
                return step
    return step


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x[0], y[0]), f"step {i}: indices {x[0].tolist()} != {y[0].tolist()}"
        assert torch.equal(x[1], y[1]), f"step {i}: loading noise differs"
        assert torch.equal(x[2], y[2]), f"step {i}: training torch RNG differs"
        assert x[3] == y[3] and x[4] == y[4], f"step {i}: python/numpy RNG differs"


def reference(kind: str, steps: int) -> list:
    seed_all(0)
    loader = track_dataloader(make_loader(kind))
    record: list = []
    train_loop(loader, steps, record)
    return record


def interrupted(kind: str, steps: int, k: int) -> list:
    seed_all(0)
    loader = track_dataloader(make_loader(kind))
    record: list = []
    assert train_loop(loader, steps, record, stop_at=k) == k
    saved_loader = core.save(loader)
    saved_rng = core.save(RNGState())
    del loader

    seed_all(12345)  # a new process starts with other RNG states
    fresh = track_dataloader(make_loader(kind))
    core.load(fresh, saved_loader)
    core.load(RNGState(), saved_rng)  # RNG last, as TrainState does
    train_loop(fresh, steps, record)
    return record


@pytest.mark.parametrize(
    "kind,k",
    [
        ("shuffle", 3),  # mid first epoch
        ("shuffle", 8),  # mid second epoch
        ("shuffle", 1),
        ("shuffle", 6),  # exactly at the end of epoch 1, before StopIteration was seen
        ("shuffle", 12),  # exactly at the end of epoch 2
        ("generator", 9),
        ("generator", 6),
        ("two_generators", 10),
        ("replacement", 9),  # 14 batches per epoch, resume inside the second 32-sample draw
        ("replacement", 20),
        ("sequential", 4),
    ],
)
def test_resume_single_process(kind: str, k: int) -> None:
    steps = k + 16  # at least two epoch starts after the resume
    assert_same(interrupted(kind, steps, k), reference(kind, steps))


@pytest.mark.parametrize("k", [2, 9])
def test_resume_with_workers(k: int) -> None:
    steps = 14
    assert_same(interrupted("workers", steps, k), reference("workers", steps))


def test_resume_with_persistent_workers_mid_second_epoch() -> None:
    steps = 14
    # k=8: the second epoch reset the live iterator; the resume must draw the same way.
    assert_same(interrupted("persistent", steps, 8), reference("persistent", steps))


@pytest.mark.parametrize("kind", ["shuffle", "workers", "persistent", "generator", "two_generators"])
def test_resume_at_epoch_boundary(kind: str) -> None:
    """Saved after StopIteration, before the next iter(): the next epoch starts normally."""
    def epochs(loader, n, record):
        for _ in range(n):
            for idx, noise in loader:
                record.append((idx.clone(), noise.clone(), torch.rand(2), random.random(), np.random.rand()))

    seed_all(0)
    ref: list = []
    epochs(track_dataloader(make_loader(kind)), 3, ref)

    seed_all(0)
    got: list = []
    loader = track_dataloader(make_loader(kind))
    epochs(loader, 1, got)
    sd = core.save(loader)
    assert sd["epoch_active"] is False and sd["batches_yielded"] == 6 and sd["epoch"] == 1
    saved_rng = core.save(RNGState())
    seed_all(99)
    fresh = track_dataloader(make_loader(kind))
    core.load(fresh, sd)
    core.load(RNGState(), saved_rng)
    epochs(fresh, 2, got)
    assert_same(got, ref)


def test_state_dict_counts_and_flags() -> None:
    loader = track_dataloader(make_loader("shuffle"))
    sd0 = loader.state_dict()
    assert sd0["batches_yielded"] == 0 and sd0["epoch_active"] is False and sd0["epoch"] == 0
    it = iter(loader)
    next(it), next(it)
    sd = loader.state_dict()
    assert (sd["batches_yielded"], sd["epoch_active"], sd["epoch"]) == (2, True, 1)
    # Same structure and shapes as a never-iterated loader: a fresh loader is a valid target.
    assert sd["epoch_rng"]["torch"].shape == sd0["epoch_rng"]["torch"].shape
    assert sd["epoch_rng"]["generators"] == {} == sd0["epoch_rng"]["generators"]
    list(it)
    sd = loader.state_dict()
    assert (sd["batches_yielded"], sd["epoch_active"]) == (6, False)
    # A new iter() starts a new epoch; an older iterator no longer moves the position.
    old = iter(loader)
    new = iter(loader)
    next(old), next(old), next(new)
    assert loader.state_dict()["batches_yielded"] == 1
    assert loader.state_dict()["epoch"] == 3


def test_state_dict_is_plain_and_has_generator_states() -> None:
    loader = track_dataloader(make_loader("two_generators"))
    sd = loader.state_dict()
    core.assert_plain(sd)
    gens = sd["epoch_rng"]["generators"]
    assert sorted(gens) == ["loader_generator", "sampler_generator"]
    assert all(t.dtype == torch.uint8 for t in gens.values())


def test_shared_generator_recorded_once() -> None:
    # DataLoader hands its generator to the RandomSampler it builds: one object, one entry.
    loader = track_dataloader(make_loader("generator"))
    assert list(loader.state_dict()["epoch_rng"]["generators"]) == ["loader_generator"]


def test_resume_does_not_touch_global_rng() -> None:
    loader = track_dataloader(make_loader("shuffle"))
    it = iter(loader)
    next(it), next(it), next(it)
    sd = core.save(loader)
    fresh = track_dataloader(make_loader("shuffle"))
    core.load(fresh, sd)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    iter(fresh)
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_order_independent_of_draws_between_iter_and_next() -> None:
    """The epoch's order is fixed at iter(), even if the caller draws before the first next()."""
    seed_all(0)
    a = track_dataloader(make_loader("shuffle"))
    order_a = [b[0] for b in a]
    seed_all(0)
    b = track_dataloader(make_loader("shuffle"))
    it = iter(b)
    torch.rand(10)
    order_b = [x[0] for x in it]
    assert all(torch.equal(x, y) for x, y in zip(order_a, order_b))


def test_class_swap_is_cached_and_transparent() -> None:
    a = make_loader("shuffle")
    b = make_loader("sequential")
    assert track_dataloader(a) is a and track_dataloader(b) is b
    assert type(a) is type(b) and isinstance(a, DataLoader) and is_tracked(a)
    assert track_dataloader(a) is a  # idempotent
    assert len(a) == 6 and len(iter(a)) == 6

    class MyLoader(DataLoader):
        pass

    c = track_dataloader(MyLoader(IndexDataset(), batch_size=4))
    assert isinstance(c, MyLoader) and type(c) is not type(a)


def test_loader_built_differently_is_rejected() -> None:
    sd = core.save(track_dataloader(make_loader("generator")))
    other = track_dataloader(make_loader("shuffle"))
    with pytest.raises(TypeMismatchError, match="generators"):
        other.load_state_dict(sd)


def test_non_loader_is_rejected() -> None:
    with pytest.raises(UnsupportedValueError, match="DataLoader"):
        track_dataloader([1, 2, 3])


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("with_generator", [False, True])
def test_stateful_dataloader_resumes_batches_and_rng(with_generator: bool) -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        g = torch.Generator().manual_seed(11) if with_generator else None
        return sdl.StatefulDataLoader(IndexDataset(augment=False), batch_size=4, shuffle=True, generator=g)

    assert isinstance(track_dataloader(make()), sdl.StatefulDataLoader)

    def run(loader, n, out):
        for _, (idx, _noise) in zip(range(n), (x for _ in range(2) for x in loader)):
            out.append((idx, torch.rand(2)))

    seed_all(0)
    ref: list = []
    run(make(), 11, ref)

    seed_all(0)
    loader = make()
    got: list = []
    run(loader, 3, got)
    saved, saved_rng = core.save(loader), core.save(RNGState())
    seed_all(7)
    fresh = track_dataloader(make())
    core.load(fresh, saved)
    core.load(RNGState(), saved_rng)
    run(fresh, 8, got)
    assert len(got) == len(ref) == 11
    for i, ((a, na), (b, nb)) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), f"batch {i}"
        # The training RNG stream too: a resumed StatefulDataLoader (torchdata 0.11) draws a fresh
        # base seed when its iterator is rebuilt; track_dataloader's guard hides that draw.
        assert torch.equal(na, nb), f"rng after batch {i}"


# -- a load into a loader whose iterator already exists ----------------------------------------------
def _stateful_loader():
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    return sdl.StatefulDataLoader(IndexDataset(augment=False), batch_size=4, shuffle=True,
                                  generator=torch.Generator().manual_seed(3))


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("kind", ["plain", "stateful"])
@pytest.mark.parametrize("yielded", [0, 2])
def test_load_refuses_a_loader_whose_iterator_exists(tmp_path: Path, kind: str, yielded: int) -> None:
    import resurgo
    from resurgo.errors import DataPositionError

    def make():
        return make_loader("generator") if kind == "plain" else _stateful_loader()

    model = torch.nn.Linear(2, 2)
    saving = make()
    ts = resurgo.TrainState(model=model, dataloader=saving, rng=False)
    it = iter(saving)
    expected = [next(it)[0] for _ in range(5)][2:]  # the run continues with batches 2, 3, 4
    del it
    ts2 = resurgo.TrainState(model=model, dataloader=make(), rng=False)
    early = iter(ts2.dataloader)
    next(early), next(early)
    resurgo.save(ts2, tmp_path / "ck")  # position: 2 batches into the epoch

    loader = make()
    target = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in target.parameters()]
    resumed = resurgo.TrainState(model=target, dataloader=loader, rng=False)
    it = iter(loader)  # the mistake: the iterator exists before the load
    for _ in range(yielded):
        next(it)
    with pytest.raises(DataPositionError, match=r"Call resurgo\.load before iter\(loader\) / the for loop") as e:
        resurgo.load(resumed, tmp_path / "ck")
    assert f"this {'DataLoader' if kind == 'plain' else 'StatefulDataLoader'}'s iterator was created" in str(e.value)
    assert str(e.value).startswith(f"{tmp_path / 'ck'}: dataloader: ")  # names the checkpoint
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))  # nothing was loaded
    del it  # once that iterator is gone, the load works and resumes where the save was
    resurgo.load(resumed, tmp_path / "ck")
    got = [batch[0] for _, batch in zip(range(3), loader)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_finished_epoch_iterator_does_not_block_a_load(tmp_path: Path) -> None:
    import resurgo

    loader = track_dataloader(make_loader("generator"))
    resurgo.save({"loader": loader}, tmp_path / "ck")
    it = iter(loader)
    assert len(list(it)) == 6  # exhausted, still held
    resurgo.load({"loader": loader}, tmp_path / "ck")


def test_a_changed_number_of_ranks_is_worded_in_the_singular() -> None:
    from torch.utils.data import DistributedSampler

    from resurgo.errors import DataPositionError

    ds = IndexDataset()
    sd = core.save(track_dataloader(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0))))
    other = track_dataloader(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 0)))
    with pytest.raises(DataPositionError, match="saved by 1 rank, this DistributedSampler has num_replicas=2"):
        other.load_state_dict(sd)


def test_a_distributed_sampler_resumes_in_the_epoch_it_was_saved_in_even_if_set_epoch_comes_after_iter() -> None:
    """Its order is a function of its epoch: a loop that calls set_epoch only after iter() (as
    Lightning does on resume) still gets the rest of the interrupted epoch's order."""
    from torch.utils.data import DistributedSampler

    def loader() -> DataLoader:
        ds = IndexDataset(augment=False)
        return track_dataloader(DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, 2, 1, shuffle=True, seed=7)))

    original = loader()
    original.sampler.set_epoch(3)
    it = iter(original)
    seen = [next(it)[0].tolist() for _ in range(2)]
    sd = core.save(original)
    assert sd["distributed_epoch"] == 3
    rest = [b[0].tolist() for b in it]

    resumed = loader()  # a fresh sampler, at epoch 0
    resumed.load_state_dict(sd)
    it = iter(resumed)
    resumed.sampler.set_epoch(3)  # too late to change this pass, as in Lightning
    assert [b[0].tolist() for b in it] == rest and len(seen + rest) == 6


def test_on_world_size_change_warn_loads_nothing_and_the_next_iter_starts_a_new_pass() -> None:
    from torch.utils.data import DistributedSampler

    ds = IndexDataset(augment=False)
    saved_by = track_dataloader(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 0, shuffle=False)))
    it = iter(saved_by)
    next(it)
    sd = core.save(saved_by)
    assert sd["batches_yielded"] == 1
    other = track_dataloader(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 1, 0, shuffle=False)),
                             on_world_size_change="warn")
    with pytest.warns(RuntimeWarning, match="saved by 2 ranks, this DistributedSampler has num_replicas=1.*not loaded"):
        other.load_state_dict(sd)
    assert next(iter(other))[0].tolist() == [0, 1, 2, 3]  # a new pass, from its start
    with pytest.raises(UnsupportedValueError, match="on_world_size_change must be 'raise' or 'warn'"):
        track_dataloader(other, on_world_size_change="ignore")


# -- a position saved once the epoch's last batch was handed out -----------------------------------
def _distributed_loader(finished_epoch: str | None = None) -> DataLoader:
    from torch.utils.data import DistributedSampler

    ds = IndexDataset()  # 11 samples per rank: 3 batches, the last one short
    return track_dataloader(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 1, shuffle=True, seed=5)),
                            finished_epoch=finished_epoch)


def _loader_for(kind: str, finished_epoch: str | None) -> DataLoader:
    if kind == "distributed":
        return _distributed_loader(finished_epoch)
    return track_dataloader(make_loader(kind), finished_epoch=finished_epoch)


def _epoch(it) -> list:
    """The batches of ``it`` with a draw of the training RNG after each, as train_loop records them."""
    return [(idx.clone(), noise.clone(), torch.rand(2), random.random(), np.random.rand()) for idx, noise in it]


def _start_epoch(loader: DataLoader, epoch: int):
    """A loop's start of an epoch as Lightning's on resume: iter() first, set_epoch() after."""
    it = iter(loader)
    if hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(epoch)
    return it


@pytest.mark.parametrize("kind", ["shuffle", "workers", "distributed"])
@pytest.mark.parametrize("finished_epoch", [None, "empty", "next"])
def test_a_position_saved_at_an_epochs_last_batch_resumes_empty_or_at_the_next_epoch(kind: str,
                                                                                    finished_epoch: str | None) -> None:
    """Saved after the epoch's last batch was handed out but before its StopIteration (a loop that
    knows the length never asks for it): by default the first iter() after the load gives the rest
    of that epoch, nothing; with finished_epoch="next" it gives the next epoch, the very batches
    (order, loading noise) and training draws of the uninterrupted loader's next epoch."""
    seed_all(0)
    loader = _loader_for(kind, finished_epoch)
    it = _start_epoch(loader, 0)
    first = [next(it) for _ in range(len(loader))]
    sd = core.save(loader)
    saved_rng = core.save(RNGState())
    assert (sd["batches_yielded"], sd["epoch_active"]) == (len(loader), True) and len(first) == len(loader)
    reference = _epoch(_start_epoch(loader, 1))  # the uninterrupted loop's next epoch
    assert len(reference) == len(loader)

    seed_all(12345)
    fresh = _loader_for(kind, finished_epoch)
    core.load(fresh, sd)
    core.load(RNGState(), saved_rng)
    got = _epoch(_start_epoch(fresh, 1))
    if finished_epoch == "next":
        assert_same(got, reference)
    else:
        assert got == []  # the rest of the finished epoch
        assert_same(_epoch(_start_epoch(fresh, 1)), reference)  # then the loop's next iter()


def test_an_elastic_samplers_position_at_an_epochs_last_batch_loads_as_the_next_epochs_start() -> None:
    """With finished_epoch="next", an ElasticSampler's finished pass loads as the next epoch's start:
    the loader's length is a whole epoch's before iter() (a loop reading it then, as Lightning does,
    would otherwise see 0), and its batches are the next epoch's."""
    from resurgo import ElasticSampler

    def elastic_loader() -> DataLoader:
        ds = IndexDataset()  # 11 samples per rank: 3 batches
        return track_dataloader(DataLoader(ds, batch_size=4, sampler=ElasticSampler(ds, num_replicas=2, rank=1, seed=5)),
                                finished_epoch="next")

    loader = elastic_loader()
    it = iter(loader)
    [next(it) for _ in range(len(loader))]
    sd = core.save(loader)
    assert sd["elastic"]["consumed"] == 22 and len(loader) == 3
    loader.sampler.set_epoch(1)
    reference = [idx.tolist() for idx, _ in loader]

    fresh = elastic_loader()
    core.load(fresh, sd)
    assert len(fresh) == 3 and fresh.sampler.epoch == 1
    fresh.sampler.set_epoch(1)
    assert [idx.tolist() for idx, _ in fresh] == reference


def _limited_loader(kind: str, finished_epoch: str) -> DataLoader:
    from resurgo import ElasticSampler

    if kind == "elastic":
        ds = IndexDataset()  # 11 samples per rank: 3 batches
        return track_dataloader(DataLoader(ds, batch_size=4, sampler=ElasticSampler(ds, num_replicas=2, rank=1, seed=5)),
                                finished_epoch=finished_epoch)
    if kind == "stateful":
        return track_dataloader(_stateful_loader(), finished_epoch=finished_epoch)
    return _loader_for(kind, finished_epoch)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("kind", ["shuffle", "workers", "distributed", "elastic", "stateful"])
@pytest.mark.parametrize("finished_epoch", ["empty", "next"])
def test_a_position_marked_finished_mid_epoch_resumes_at_the_next_epoch_or_empty(kind: str, finished_epoch: str) -> None:
    """A loop that ends its epoch before the loader runs out (Lightning's limit_train_batches) marks
    the position it saves there: with finished_epoch="next" the resumed loader gives the
    uninterrupted loop's next epoch (batches, loading noise, training draws); with "empty", the
    rest of the marked epoch first, nothing (a StatefulDataLoader: torchdata starts the next epoch).
    Unmarked, the same position resumes the epoch's last batch."""
    from resurgo.state.data_position import mark_epoch_finished

    def start(loader: DataLoader, epoch: int):
        if kind == "elastic":  # its pass is fixed by iter(): the loop sets the epoch first
            loader.sampler.set_epoch(epoch)
            return iter(loader)
        return _start_epoch(loader, epoch)

    seed_all(0)
    loader = _limited_loader(kind, finished_epoch)
    it = start(loader, 0)
    ended = [next(it) for _ in range(len(loader) - 1)]  # the loop's epoch ends one batch early
    sd = core.save(loader)
    marked = mark_epoch_finished(loader, sd)
    saved_rng = core.save(RNGState())
    reference = _epoch(start(loader, 1))  # the uninterrupted loop's next epoch
    assert len(ended) == len(loader) - 1 and len(reference) == len(loader)

    def resumed(state: dict) -> DataLoader:
        seed_all(12345)
        fresh = _limited_loader(kind, finished_epoch)
        core.load(fresh, state)
        core.load(RNGState(), saved_rng)
        assert len(fresh) == len(loader)  # a whole epoch's, before iter() (Lightning reads it then)
        return fresh

    fresh = resumed(marked)
    if finished_epoch == "empty" and kind != "stateful":
        assert _epoch(start(fresh, 0)) == []  # the rest of the marked epoch
    assert_same(_epoch(start(fresh, 1)), reference)
    assert len(_epoch(start(resumed(sd), 0))) == 1  # unmarked: the epoch's last batch


def test_a_marked_position_without_a_length_to_skip_or_with_a_bad_mark_is_refused() -> None:
    """Tracked with finished_epoch="empty", a marked epoch's rest is skipped, which needs the
    loader's length: an IterableDataset without one is refused, naming the key and the fix."""
    from torch.utils.data import IterableDataset

    from resurgo.errors import DataPositionError
    from resurgo.state.data_position import mark_epoch_finished

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = track_dataloader(DataLoader(Stream(), batch_size=2))
    next(iter(loader))
    marked = mark_epoch_finished(loader, loader.state_dict())
    with pytest.raises(DataPositionError, match=r"epoch_finished: .*no length.*finished_epoch='next'"):
        track_dataloader(DataLoader(Stream(), batch_size=2)).load_state_dict(marked)
    nexts = track_dataloader(DataLoader(Stream(), batch_size=2), finished_epoch="next")
    nexts.load_state_dict(marked)
    assert [b.tolist() for b in nexts] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]  # the next epoch, whole
    with pytest.raises(TypeMismatchError, match=r"epoch_finished: expected a bool, got 1"):
        nexts.load_state_dict({**marked, "epoch_finished": 1})


def test_finished_epoch_next_leaves_a_mid_epoch_position_as_it_is() -> None:
    """Only a position at the epoch's last batch moves on to the next epoch: one batch earlier, the
    resume gives that last batch."""
    seed_all(0)
    loader = track_dataloader(make_loader("shuffle"), finished_epoch="next")
    it = iter(loader)
    for _ in range(len(loader) - 1):
        next(it)
    sd, saved_rng = core.save(loader), core.save(RNGState())
    last = _epoch(it)
    assert len(last) == 1
    seed_all(3)
    fresh = track_dataloader(make_loader("shuffle"), finished_epoch="next")
    core.load(fresh, sd)
    core.load(RNGState(), saved_rng)
    assert_same(_epoch(iter(fresh)), last)


def test_finished_epoch_is_kept_or_changed_by_tracking_again_and_an_invalid_one_is_refused() -> None:
    loader = track_dataloader(make_loader("shuffle"), finished_epoch="next")
    assert type(loader)._resurgo_finished_epoch == "next"
    assert track_dataloader(loader) is loader and type(loader)._resurgo_finished_epoch == "next"
    track_dataloader(loader, finished_epoch="empty")
    assert type(loader)._resurgo_finished_epoch == "empty"
    assert type(track_dataloader(make_loader("shuffle")))._resurgo_finished_epoch == "empty"  # the default
    with pytest.raises(UnsupportedValueError, match=r"finished_epoch must be 'empty' or 'next', got 'skip'"):
        track_dataloader(make_loader("shuffle"), finished_epoch="skip")
    with pytest.raises(UnsupportedValueError, match=r"finished_epoch must be 'empty' or 'next', got 'skip'"):
        track_dataloader(loader, finished_epoch="skip")
    assert type(loader)._resurgo_finished_epoch == "empty"  # a refused value changed nothing


def test_a_distributed_samplers_order_is_read_at_the_first_batch_so_set_epoch_after_iter_applies() -> None:
    """Without workers a tracked loader leaves a DistributedSampler's order to the first batch, as an
    untracked one does: set_epoch() between iter() and the first next() (Lightning's order on
    resume) gives that epoch's order, and the position records that epoch."""
    from torch.utils.data import DistributedSampler

    def plain() -> DataLoader:
        ds = IndexDataset(augment=False)
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, 2, 0, shuffle=True, seed=5))

    untracked = plain()
    untracked.sampler.set_epoch(4)
    expected = [b[0].tolist() for b in untracked]
    untracked.sampler.set_epoch(0)
    assert [b[0].tolist() for b in untracked] != expected  # the epoch changes the order

    tracked = track_dataloader(plain())
    it = iter(tracked)
    tracked.sampler.set_epoch(4)
    assert [b[0].tolist() for b in it] == expected
    assert tracked.state_dict()["distributed_epoch"] == 4


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("finished_epoch", ["empty", "next"])
def test_a_stateful_dataloader_saved_at_its_epochs_last_batch_resumes_empty_or_at_the_next_epoch(
        finished_epoch: str) -> None:
    """torchdata's own position, saved before the epoch's StopIteration: as it is, the first iter()
    after the load gives nothing; with finished_epoch="next" it gives the uninterrupted loader's next
    epoch (its sampler's generator as saved, its base seed drawn as the uninterrupted run drew it)."""
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        # Its RandomSampler draws its seed from the global RNG when the loader is built.
        return track_dataloader(sdl.StatefulDataLoader(IndexDataset(augment=False), batch_size=4, shuffle=True),
                                finished_epoch=finished_epoch)

    seed_all(0)
    loader = make()
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    sd, saved_rng = core.save(loader), core.save(RNGState())
    reference = [(b[0], torch.rand(2)) for b in loader]

    seed_all(4)
    fresh = make()
    core.load(fresh, sd)
    core.load(RNGState(), saved_rng)
    got = [(b[0], torch.rand(2)) for b in fresh]
    if finished_epoch == "empty":
        assert got == []
        return
    assert len(got) == len(reference) == 6
    assert all(torch.equal(a, b) and torch.equal(na, nb) for (a, na), (b, nb) in zip(got, reference))
