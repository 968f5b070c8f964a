"""ElasticSampler: a run resumed on another number of data-parallel ranks continues the same global
sample sequence, no sample repeated and none skipped.

Layers tested: the pure index logic (hypothesis: any chain of world-size changes at any step
consumes exactly a prefix of the epoch's order); the sampler itself (identical to torch's
DistributedSampler from the start of an epoch; state identical on every rank; epochs; errors);
real DataLoaders and torchdata StatefulDataLoaders with and without workers, where W "ranks" in one
process save their loader position with resurgo.save(TrainState) and W' other ranks resume it;
and real processes on gloo (tests/scripts/elastic_ranks.py).

A run's global sequence is rebuilt from what each rank's loop received: at every step, sample j
of rank r is global position ``start + (step * B + j) * W + r`` (the strided layout), so
interleaving the ranks' batches sample by sample gives the global order.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

import resurgo
from resurgo.errors import DataPositionError, TypeMismatchError, UnsupportedValueError
from resurgo.state import elastic_loader
from resurgo.state.data_position import is_tracked, track_dataloader
from resurgo.state.elastic_sampler import (
    ElasticSampler,
    consumed_after,
    per_rank_count,
    rank_positions,
)

N = 50  # samples; with B=3 on 4 ranks a global batch is 12, so epochs end with a partial one
B = 3
SEED = 7


def reference_order(epoch: int, n: int = N, seed: int = SEED) -> list[int]:
    """The epoch's order computed independently of resurgo: DistributedSampler's draw."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def padding(order: list[int], pad: int) -> list[int]:
    """The documented padding: the epoch's first samples again (cycling if the epoch is shorter)."""
    return [order[i % len(order)] for i in range(pad)]


def interleave(per_rank: list[list[list[int]]]) -> list[int]:
    """Global sequence of one lockstep segment: per_rank[r][step] is rank r's batch at that step."""
    steps = {len(batches) for batches in per_rank}
    assert len(steps) == 1, f"ranks took different numbers of steps: {[len(b) for b in per_rank]}"
    out: list[int] = []
    for step in range(steps.pop()):
        sizes = {len(batches[step]) for batches in per_rank}
        assert len(sizes) == 1, f"step {step}: ranks got batches of sizes {sizes}"
        for j in range(sizes.pop()):
            out.extend(batches[step][j] for batches in per_rank)
    return out


# -- pure index logic -------------------------------------------------------------------------
segments = st.lists(st.tuples(st.integers(1, 8), st.integers(0, 12)), min_size=1, max_size=5)


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 200), segs=segments, batch=st.integers(1, 4), drop_last=st.booleans(),
       batch_aware=st.booleans())
def test_world_size_changes_consume_exactly_a_prefix(n, segs, batch, drop_last, batch_aware) -> None:
    """W1 -> W2 -> ... at arbitrary step boundaries: every position of the epoch at most once, in order."""
    sampler_batch = batch if batch_aware else None
    start, taken_positions, padding = 0, [], []
    last_world, last_start, last_count = None, 0, 0
    for world, steps in segs:
        count = per_rank_count(n, start, world, drop_last=drop_last, batch_size=sampler_batch)
        taken = min(steps * batch, count)
        per_rank = [list(rank_positions(start, world, r, count))[:taken] for r in range(world)]
        # Strided: sample j of every rank together is the contiguous block [start + j*W, start + (j+1)*W).
        for j in range(taken):
            assert [per_rank[r][j] for r in range(world)] == list(range(start + j * world, start + (j + 1) * world))
        for positions in per_rank:
            taken_positions += [p for p in positions if p < n]
            padding += [p for p in positions if p >= n]
        last_world, last_start, last_count = world, start, count
        after = consumed_after(n, start, world, count, taken)
        assert after == (n if taken >= count else start + taken * world)
        start = after
        if start == n:
            break
    assert len(set(taken_positions)) == len(taken_positions), "a sample was taken twice"
    taken_positions.sort()
    if start < n:  # stopped mid-epoch: exactly the prefix [0, start)
        assert taken_positions == list(range(start)) and padding == []
        return
    assert last_world is not None
    if drop_last:
        end = last_start + last_count * last_world
        assert taken_positions == list(range(end)) and padding == []
        assert 0 <= n - end < last_world * (batch if batch_aware else 1)  # less than one (global) batch dropped
    else:
        assert taken_positions == list(range(n))
        # Padding (positions >= n) only at the tail of the last pass: fewer than W of them.
        assert sorted(padding) == list(range(n, n + (-(n - last_start)) % last_world))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 120), world=st.integers(1, 6), shuffle=st.booleans(), drop_last=st.booleans(),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 5))
def test_a_fresh_epoch_is_exactly_distributed_sampler(n, world, shuffle, drop_last, seed, epoch) -> None:
    data = list(range(n))
    for rank in range(world):
        ours = ElasticSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        torchs = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                    drop_last=drop_last)
        ours.set_epoch(epoch)
        torchs.set_epoch(epoch)
        assert list(ours) == list(torchs)
        assert len(ours) == len(torchs)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 90), segs=segments, drop_last=st.booleans(), seed=st.integers(0, 1000))
def test_sampler_state_moves_between_world_sizes(n, segs, drop_last, seed) -> None:
    """Through the class: state identical on every rank; resumed ranks continue the global order."""
    data = list(range(n))
    order = reference_order(0, n, seed)
    state = None
    sequence: list[int] = []
    for world, steps in segs:
        samplers = [ElasticSampler(data, num_replicas=world, rank=r, seed=seed, drop_last=drop_last)
                    for r in range(world)]
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        start = samplers[0].state_dict()["consumed"]
        its = [iter(s) for s in samplers]
        got = [list(itertools.islice(it, steps)) for it in its]
        states = [s.state_dict() for s in samplers]
        assert all(sd == states[0] for sd in states), "state differs between ranks"
        assert [sd["num_replicas"] for sd in states] == [world] * world
        sequence += interleave([[batch] for batch in got]) if got[0] else []
        state = states[0]
        if len(got[0]) < steps or state["consumed"] == n:
            assert state["consumed"] == n
            pad = (-(n - start)) % world if not drop_last else 0
            assert sequence == order[:len(sequence) - pad] + padding(order, pad)
            assert len(sequence) - pad == (n if not drop_last else len(sequence))
            return
        assert state["consumed"] == start + len(got[0]) * world
    assert sequence == order[:state["consumed"]]


# -- sampler semantics --------------------------------------------------------------------------
def test_state_dict_and_len_of_a_resumed_pass() -> None:
    s = ElasticSampler(range(N), num_replicas=4, rank=1, seed=SEED)
    assert s.state_dict() == {"version": 1, "epoch": 0, "seed": SEED, "shuffle": True, "consumed": 0,
                              "num_samples": N, "num_replicas": 4}
    assert len(s) == 13  # ceil(50 / 4)
    it = iter(s)
    [next(it) for _ in range(5)]
    assert s.state_dict()["consumed"] == 20
    t = ElasticSampler(range(N), num_replicas=3, rank=2, seed=0)
    t.load_state_dict(s.state_dict())
    assert t.seed == SEED and len(t) == 10  # ceil(30 / 3)
    assert list(t) == [reference_order(0)[p % N] for p in range(22, 50 + 2, 3)]  # the last one is padding
    assert t.state_dict()["consumed"] == N
    # A second pass of the same epoch starts at 0 again, as DistributedSampler's would.
    assert len(list(t)) == 17


def test_epochs_loaded_and_explicit() -> None:
    saved = ElasticSampler(range(N), seed=SEED)
    saved.set_epoch(3)
    it = iter(saved)
    [next(it) for _ in range(10)]
    position = saved.state_dict()
    assert (position["epoch"], position["consumed"]) == (3, 10)

    adopted = ElasticSampler(range(N), seed=SEED)
    adopted.load_state_dict(position)  # no set_epoch yet: the checkpoint's epoch is adopted
    assert adopted.epoch == 3 and list(adopted) == reference_order(3)[10:]

    explicit = ElasticSampler(range(N), seed=SEED)
    explicit.set_epoch(3)  # as a loop calls it before torchdata loads the sampler inside iter()
    explicit.load_state_dict(position)
    assert list(explicit) == reference_order(3)[10:]

    moved_on = ElasticSampler(range(N), seed=SEED)
    moved_on.set_epoch(4)
    moved_on.load_state_dict(position)  # a position of epoch 3 does not apply to epoch 4
    assert moved_on.epoch == 4 and moved_on.state_dict()["consumed"] == 0
    assert list(moved_on) == reference_order(4)

    ended = ElasticSampler(range(N), seed=SEED)
    ended.load_state_dict({**position, "consumed": N})  # saved after the epoch's last sample
    assert list(ended) == [] and ended.state_dict()["consumed"] == N
    ended.set_epoch(4)
    assert ended.state_dict()["consumed"] == 0 and list(ended) == reference_order(4)


def test_old_iterator_does_not_move_the_new_pass() -> None:
    s = ElasticSampler(range(N), num_replicas=2, rank=0, seed=SEED)
    old = iter(s)
    new = iter(s)
    next(old), next(old), next(old), next(new)
    assert s.state_dict()["consumed"] == 2


def test_drop_last_with_batch_size_drops_whole_global_batches() -> None:
    s = ElasticSampler(range(N), num_replicas=4, rank=0, drop_last=True, batch_size=B)
    assert len(s) == 12  # 4 global batches of 12 = 48; 2 dropped
    s = ElasticSampler(range(N), num_replicas=4, rank=0, drop_last=True)
    assert len(s) == 12  # floor(50 / 4)
    s = ElasticSampler(range(N), num_replicas=4, rank=0, drop_last=True, batch_size=5)
    assert len(s) == 10  # 2 global batches of 20 = 40; 10 dropped


@pytest.mark.parametrize("change,message", [
    ({"num_samples": 49}, "'num_samples': saved for a dataset of 49 samples, this sampler's dataset has 50"),
    ({"shuffle": False}, "'shuffle': saved with shuffle=False, this sampler has shuffle=True"),
    ({"consumed": 51}, "'consumed': 51 is past the end of the epoch \\(50 samples\\)"),
    ({"consumed": -1}, "'consumed': expected an int >= 0, got -1"),
    ({"epoch": 1.0}, "'epoch': expected an int, got float 1.0"),
    ({"seed": True}, "'seed': expected an int, got bool True"),
    ({"version": 2}, "'version': expected 1, got 2"),
])
def test_bad_positions_are_refused(change, message) -> None:
    s = ElasticSampler(range(N))
    good = s.state_dict()
    with pytest.raises(DataPositionError, match=message):
        s.load_state_dict({**good, **change})
    assert s.state_dict() == good  # nothing changed


def test_missing_keys_and_bad_arguments_are_refused() -> None:
    s = ElasticSampler(range(N))
    with pytest.raises(DataPositionError, match="missing consumed, num_samples"):
        s.load_state_dict({"epoch": 0, "seed": 0})
    with pytest.raises(DataPositionError, match="'rank': 4 is not below num_replicas=4"):
        ElasticSampler(range(N), num_replicas=4, rank=4)
    with pytest.raises(DataPositionError, match="'num_replicas': expected an int >= 1, got 0"):
        ElasticSampler(range(N), num_replicas=0, rank=0)
    with pytest.raises(DataPositionError, match="batch_size must be None or an int >= 1, got 0"):
        ElasticSampler(range(N), batch_size=0)
    with pytest.raises(DataPositionError, match="'epoch': expected an int >= 0, got -1"):
        s.set_epoch(-1)
    assert isinstance(DataPositionError("x"), ValueError)


def test_defaults_without_a_process_group() -> None:
    s = ElasticSampler(range(N))
    assert (s.num_replicas, s.rank, s.seed, s.shuffle, s.drop_last) == (1, 0, 0, True, False)
    assert list(s) == reference_order(0, seed=0)


# -- real loaders, W ranks simulated in one process -------------------------------------------------
def make_dataloader(kind: str, world: int, rank: int) -> DataLoader:
    data = list(range(N))
    if kind == "batch_sampler":  # the sampler inside a BatchSampler; the loader drops partial batches
        sampler = ElasticSampler(data, num_replicas=world, rank=rank, seed=SEED)
        return DataLoader(data, batch_sampler=BatchSampler(sampler, B, drop_last=True))
    sampler = ElasticSampler(data, num_replicas=world, rank=rank, seed=SEED)
    workers = {"workers0": 0, "workers2": 2, "persistent": 2}[kind]
    return DataLoader(data, batch_size=B, sampler=sampler, num_workers=workers,
                      persistent_workers=kind == "persistent")


def make_stateful(kind: str, world: int, rank: int):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    sampler = ElasticSampler(list(range(N)), num_replicas=world, rank=rank, seed=SEED)
    workers, snapshot_every = {"workers0": (0, 1), "workers2": (2, 1), "snapshot3": (2, 3)}[kind]
    return sdl.StatefulDataLoader(list(range(N)), batch_size=B, sampler=sampler, num_workers=workers,
                                  snapshot_every_n_steps=snapshot_every)


def sampler_of(loader) -> ElasticSampler:
    found = elastic_loader.find_elastic_sampler(loader)
    assert found is not None
    return found


def run_steps(loaders, steps: int | None, epoch: int) -> list[int]:
    """Every rank takes ``steps`` batches (None: to the epoch's end) in lockstep; the global sequence.

    After every step the global position must be the same on every rank.
    """
    for loader in loaders:
        sampler_of(loader).set_epoch(epoch)
    per_rank: list[list[list[int]]] = [[] for _ in loaders]
    iterators = [iter(loader) for loader in loaders]
    for _ in itertools.count() if steps is None else range(steps):
        batches = [next(it, None) for it in iterators]
        if batches[0] is None:
            assert all(b is None for b in batches), "ranks ended the epoch at different steps"
            break
        for r, batch in enumerate(batches):
            per_rank[r].append(batch.tolist())
        states = [resurgo.elastic_state(loader) for loader in loaders]
        assert all(s == states[0] for s in states), f"positions differ between ranks: {states}"
    return interleave(per_rank)


def check_epoch(sequence: list[int], epoch: int, *, pad: int = 0, max_dropped: int = 0) -> None:
    """The epoch's global sequence: its order, every sample once but for a dropped tail of at most
    ``max_dropped``, then ``pad`` samples of documented padding (the first of the order again)."""
    order = reference_order(epoch)
    real = len(sequence) - pad
    assert sequence == order[:real] + padding(order, pad)
    assert 0 <= N - real <= max_dropped


def save_ranks(loaders, root: Path, epoch: int) -> list[dict]:
    """Each rank saves its own TrainState (the loader and the epoch) with resurgo.save."""
    for r, loader in enumerate(loaders):
        resurgo.save(resurgo.TrainState(dataloader=loader, rng=False, epoch=epoch), root / f"rank{r}")
    return [resurgo.load_dict(root / f"rank{r}")["dataloader"] for r in range(len(loaders))]


def load_ranks(loaders, root: Path, saved_world: int) -> int:
    """New rank r loads the file of old rank r % saved_world (the global position is the same in all)."""
    epoch = -1
    for r, loader in enumerate(loaders):
        ts = resurgo.TrainState(dataloader=loader, rng=False, epoch=0)
        torch.manual_seed(1000 + r)
        rng_before = torch.get_rng_state()
        resurgo.load(ts, root / f"rank{r % saved_world}")
        if is_tracked(loader):  # (a StatefulDataLoader draws a seed when resurgo.load asks for its state)
            assert torch.equal(torch.get_rng_state(), rng_before)
        epoch = ts.epoch
    return epoch


@pytest.mark.parametrize("kind,full_epochs,steps", [
    ("workers0", 0, 2),
    ("workers2", 0, 2),
    ("persistent", 1, 2),  # saved in the second epoch: the resume resets live persistent workers
    ("batch_sampler", 0, 3),
])
def test_dataloader_resumes_on_other_world_sizes(tmp_path: Path, kind: str, full_epochs: int, steps: int) -> None:
    saved_world = 4
    loaders = [track_dataloader(make_dataloader(kind, saved_world, r)) for r in range(saved_world)]
    drop = kind == "batch_sampler"
    for epoch in range(full_epochs):
        check_epoch(run_steps(loaders, None, epoch), epoch, pad=(-N) % saved_world)
    epoch = full_epochs
    head = run_steps(loaders, steps, epoch)
    consumed = steps * B * saved_world
    assert head == reference_order(epoch)[:consumed]
    if kind in ("workers2", "persistent"):
        # The workers prefetched past what the loop received: the sampler alone is ahead.
        assert sampler_of(loaders[0]).state_dict()["consumed"] > consumed
    saved = save_ranks(loaders, tmp_path, epoch)
    assert all(s["elastic"] == saved[0]["elastic"] for s in saved)
    assert saved[0]["elastic"] == {"version": 1, "epoch": epoch, "seed": SEED, "shuffle": True,
                                   "consumed": consumed, "num_samples": N, "num_replicas": saved_world}
    del loaders

    for world in (1, 2, 3):
        fresh = [track_dataloader(make_dataloader(kind, world, r)) for r in range(world)]
        assert load_ranks(fresh, tmp_path, saved_world) == epoch
        rng_before = torch.get_rng_state()
        tail = run_steps(fresh, None, epoch)
        if kind == "workers0":  # the resume builds its iterator without moving the training RNG
            assert torch.equal(torch.get_rng_state(), rng_before)
        if drop:  # the loader drops each rank's partial batch: less than one global batch of the tail
            check_epoch(head + tail, epoch, max_dropped=world * B - 1)
            check_epoch(run_steps(fresh, None, epoch + 1), epoch + 1, max_dropped=world * B - 1)
        else:
            check_epoch(head + tail, epoch, pad=(-(N - consumed)) % world)
            # The next epoch starts from its own beginning.
            check_epoch(run_steps(fresh, None, epoch + 1), epoch + 1, pad=(-N) % world)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("kind,steps", [
    ("workers0", 2),
    ("workers2", 2),
    ("snapshot3", 2),  # saved 2 steps after a snapshot: folded into the position on another world size
])
def test_stateful_dataloader_resumes_on_other_world_sizes(tmp_path: Path, kind: str, steps: int) -> None:
    saved_world = 4
    loaders = [track_dataloader(make_stateful(kind, saved_world, r)) for r in range(saved_world)]
    head = run_steps(loaders, steps, 0)
    consumed = steps * B * saved_world
    assert head == reference_order(0)[:consumed]
    saved = save_ranks(loaders, tmp_path, 0)
    if kind == "snapshot3":
        assert saved[0]["_steps_since_snapshot"] == 2  # torchdata would replay two batches
    del loaders

    for world in (1, 3, 4):  # 4: the same world size, where torchdata's own replay is kept
        fresh = [track_dataloader(make_stateful(kind, world, r)) for r in range(world)]
        load_ranks(fresh, tmp_path, saved_world)
        tail = run_steps(fresh, None, 0)
        check_epoch(head + tail, 0, pad=(-(N - consumed)) % world)
        check_epoch(run_steps(fresh, None, 1), 1, pad=(-N) % world)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_between_epochs_starts_the_next_epoch(tmp_path: Path) -> None:
    loaders = [track_dataloader(make_stateful("workers0", 2, r)) for r in range(2)]
    check_epoch(run_steps(loaders, None, 0), 0, pad=(-N) % 2)
    save_ranks(loaders, tmp_path, 0)
    fresh = [track_dataloader(make_stateful("workers0", 3, r)) for r in range(3)]
    load_ranks(fresh, tmp_path, 2)
    # The loop moves on to epoch 1 (set_epoch before iter(), which is when torchdata loads).
    check_epoch(run_steps(fresh, None, 1), 1, pad=(-N) % 3)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_with_a_torch_batch_sampler_is_refused() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make(world: int, rank: int):
        sampler = ElasticSampler(list(range(N)), num_replicas=world, rank=rank, seed=SEED)
        return track_dataloader(sdl.StatefulDataLoader(list(range(N)), batch_sampler=BatchSampler(sampler, B, False)))

    saved = make(4, 0)
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    with pytest.raises(DataPositionError, match="holds no ElasticSampler position.*pass the ElasticSampler as sampler="):
        make(2, 0).load_state_dict(state)
    with pytest.raises(DataPositionError, match="expected one ElasticSampler position in the StatefulDataLoader state, found 0"):
        resurgo.elastic_state(saved)


def test_saved_after_the_last_batch_resumes_to_the_next_epoch(tmp_path: Path) -> None:
    """Saved when the last batch was handed out but before StopIteration: the epoch is consumed."""
    loaders = [track_dataloader(make_dataloader("workers0", 4, r)) for r in range(4)]
    head = run_steps(loaders, 5, 0)  # 13 indices per rank: batches of 3, 3, 3, 3, 1
    check_epoch(head, 0, pad=2)
    assert save_ranks(loaders, tmp_path, 0)[0]["elastic"]["consumed"] == N
    fresh = [track_dataloader(make_dataloader("workers0", 3, r)) for r in range(3)]
    load_ranks(fresh, tmp_path, 4)
    assert run_steps(fresh, None, 0) == []
    check_epoch(run_steps(fresh, None, 1), 1, pad=(-N) % 3)


def test_fold_keys_are_torchdatas() -> None:
    sdl = pytest.importorskip("torchdata.stateful_dataloader.stateful_dataloader")
    it = sdl._StatefulMultiProcessingDataLoaderIter
    assert (it._SNAPSHOT, it._SNAPSHOT_STEP, it._LAST_YIELDED_WORKER_ID, it._MAIN_SNAPSHOT, it._NUM_WORKERS,
            it._STEPS_SINCE_SNAPSHOT) == (
        elastic_loader.SNAPSHOT, elastic_loader.SNAPSHOT_STEP, elastic_loader.LAST_YIELDED_WORKER_ID,
        elastic_loader.MAIN_SNAPSHOT, elastic_loader.NUM_WORKERS, elastic_loader.STEPS_SINCE_SNAPSHOT)
    assert (sdl._SAMPLER_ITER_YIELDED, sdl._SAMPLER_ITER_STATE) == (
        elastic_loader.SAMPLER_ITER_YIELDED, elastic_loader.SAMPLER_ITER_STATE)
    from torchdata.stateful_dataloader.sampler import _BatchSamplerIterator
    assert _BatchSamplerIterator._SAMPLES_YIELDED == elastic_loader.SAMPLES_YIELDED
    assert (sdl._StatefulSingleProcessDataLoaderIter._NUM_YIELDED, sdl._ITERATOR_FINISHED) == (
        elastic_loader.NUM_YIELDED, elastic_loader.ITERATOR_FINISHED)


def test_loader_built_differently_is_refused() -> None:
    plain = track_dataloader(DataLoader(list(range(N)), batch_size=B, shuffle=True))
    elastic = track_dataloader(make_dataloader("workers0", 2, 0))
    with pytest.raises(TypeMismatchError, match="dataloader.elastic: the checkpoint has no ElasticSampler position"):
        elastic.load_state_dict(plain.state_dict())
    with pytest.raises(TypeMismatchError, match="has an ElasticSampler position, this DataLoader's sampler is not"):
        plain.load_state_dict(elastic.state_dict())
    other_length = track_dataloader(DataLoader(list(range(N + 1)), batch_size=B,
                                               sampler=ElasticSampler(list(range(N + 1)))))
    with pytest.raises(DataPositionError, match="saved for a dataset of 50 samples, this sampler's dataset has 51"):
        other_length.load_state_dict(elastic.state_dict())


def test_loader_rng_is_per_rank_and_carries_over_to_new_ranks() -> None:
    from resurgo.state.data_position import _carry_over_epoch_rng

    loader = track_dataloader(make_dataloader("workers0", 2, 0))
    sd = loader.state_dict()
    assert isinstance(sd["epoch_rng"], resurgo.PerRank) and isinstance(sd["generators"], resurgo.PerRank)
    saved = []
    for seed in (10, 11):
        torch.manual_seed(seed)
        saved.append({"torch": torch.get_rng_state(), "generators": {"loader_generator": torch.tensor([seed])}})
    before = torch.get_rng_state()
    assert _carry_over_epoch_rng(saved, 1, 3) is saved[1]  # an old rank keeps its own
    new = _carry_over_epoch_rng(saved, 2, 3)
    assert torch.equal(torch.get_rng_state(), before)  # deriving moves no global stream
    assert all(not torch.equal(new["torch"], s["torch"]) for s in saved)  # its own stream...
    assert torch.equal(_carry_over_epoch_rng(saved, 2, 3)["torch"], new["torch"])  # ...deterministically
    assert not torch.equal(_carry_over_epoch_rng(saved, 4, 5)["torch"], new["torch"])
    assert new["generators"] is saved[0]["generators"]


def test_distributed_sampler_position_refuses_another_world_size() -> None:
    """A DistributedSampler's position is per rank: resuming it on another number of ranks is refused."""
    def make(world: int) -> DataLoader:
        sampler = DistributedSampler(list(range(N)), num_replicas=world, rank=0, seed=SEED)
        return track_dataloader(DataLoader(list(range(N)), batch_size=B, sampler=sampler))

    saved = make(4)
    next(iter(saved))
    state = saved.state_dict()
    assert state["distributed_num_replicas"] == 4
    with pytest.raises(DataPositionError, match="saved by 4 ranks, this DistributedSampler has num_replicas=2; "
                                                ".* use resurgo.ElasticSampler"):
        make(2).load_state_dict(state)
    same = make(4)
    same.load_state_dict(state)  # the same number of ranks resumes as before
    assert torch.equal(next(iter(same)), torch.tensor(list(DistributedSampler(
        list(range(N)), num_replicas=4, rank=0, seed=SEED))[B:2 * B]))


def test_elastic_state_refuses_other_loaders() -> None:
    with pytest.raises(UnsupportedValueError, match="whose sampler is not an ElasticSampler"):
        resurgo.elastic_state(DataLoader(list(range(N)), batch_size=B))
    untracked = DataLoader(list(range(N)), batch_size=B, sampler=ElasticSampler(list(range(N))))
    with pytest.raises(UnsupportedValueError, match="is not tracked"):
        resurgo.elastic_state(untracked)


# -- real processes -----------------------------------------------------------------------------------
def test_gloo_ranks_resume_on_another_world_size(tmp_path: Path) -> None:
    """2 ranks train and save (one collective checkpoint, and a file per rank); 3 ranks resume from
    each: the global sequence is the epoch's order. The position is stored once in the collective
    checkpoint; the loader's RNG states are per rank (carried over to the new rank)."""
    from dist_harness import run_ranks

    from scripts.elastic_ranks import STEPS

    train = run_ranks(2, "scripts.elastic_ranks:train", str(tmp_path))
    consumed = STEPS * B * 2
    # The sampler took its world size and rank from torch.distributed; every rank holds one position.
    assert [t["world"] for t in train] == [[2, 0], [2, 1]]
    assert train[0]["position"] == train[1]["position"]
    assert train[0]["position"]["consumed"] == consumed
    stored = resurgo.load_dict(tmp_path / "ckpt")["dataloader"]
    assert stored["elastic"] == train[0]["position"]  # one plain copy, not one per rank
    assert isinstance(stored["epoch_rng"], resurgo.PerRank) and len(stored["epoch_rng"].saved) == 2
    assert all(resurgo.load_dict(tmp_path / f"rank{r}")["dataloader"]["elastic"] == train[0]["position"]
               for r in range(2))

    resume = run_ranks(3, "scripts.elastic_ranks:resume", str(tmp_path))
    assert all(r["positions_agree"] for r in resume)
    # The loop ran to the epoch's end: the next pass starts at 0.
    assert all(r["end_position"] == {**train[0]["position"], "consumed": 0, "num_replicas": 3} for r in resume)
    head = interleave([t["batches"] for t in train])
    for source in ("collective", "from_file"):
        tail = interleave([r[source] for r in resume])
        check_epoch(head + tail, 0, pad=(-(N - consumed)) % 3)
