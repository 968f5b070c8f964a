"""TrainState: training N steps equals training k steps, restoring into fresh objects, then N-k.

The fresh objects are built with another seed (different initial weights, other RNG states), so
anything the restore misses shows up. Round trips go through the core's semantics without files
(_state_roundtrip) and through the real resurgo.save/resurgo.load.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _state_roundtrip as core  # noqa: E402

import resurgo  # noqa: E402
from resurgo.errors import KeyMismatchError, UnsupportedValueError  # noqa: E402
from resurgo.state.data_position import is_tracked  # noqa: E402
from resurgo.state.rng import RNGState  # noqa: E402
from resurgo.state.train_state import TrainState  # noqa: E402

STEPS = 20  # 40 samples, batch 6: 7 batches per epoch, so the run crosses two epoch ends


def build(seed: int, scaler_enabled: bool = True) -> TrainState:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    # growth_interval=2: the scale changes during the run, so its state matters.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2, enabled=scaler_enabled)
    g = torch.Generator().manual_seed(1234)  # the data set itself is the same in every build
    x = torch.randn(40, 8, generator=g)
    y = torch.randint(0, 3, (40,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)
    return TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler, dataloader=loader,
                      step=0, epoch=0, best=math.inf)


def train(ts: TrainState, until: int, losses: list) -> None:
    """Step-based loop over epochs, stopping right after step ``until`` (possibly mid-epoch)."""
    model, opt, sched, scaler = ts.model, ts.optimizer, ts.scheduler, ts.scaler
    model.train()
    while ts.step < until:
        for x, y in ts.dataloader:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.detach().clone())
            ts.step += 1
            ts.best = min(ts.best, loss.item())
            if ts.step == until:
                return
        ts.epoch += 1


def assert_trees_equal(a, b, key: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), key
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), key
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), key
        for k in a:
            assert_trees_equal(a[k], b[k], f"{key}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            assert_trees_equal(x, y, f"{key}[{i}]")
    elif isinstance(a, float):
        assert type(b) is float and np.float64(a).tobytes() == np.float64(b).tobytes(), key
    else:
        assert type(a) is type(b) and a == b, key


def assert_runs_equal(ts_a: TrainState, losses_a: list, ts_b: TrainState, losses_b: list) -> None:
    assert len(losses_a) == len(losses_b) == STEPS
    for i, (x, y) in enumerate(zip(losses_a, losses_b)):
        assert torch.equal(x, y), f"loss at step {i + 1}: {x.item()!r} != {y.item()!r}"
    for (na, pa), (nb, pb) in zip(ts_a.model.named_parameters(), ts_b.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    assert_trees_equal(ts_a.optimizer.state_dict(), ts_b.optimizer.state_dict(), "optimizer")
    assert_trees_equal(ts_a.scheduler.state_dict(), ts_b.scheduler.state_dict(), "scheduler")
    assert_trees_equal(ts_a.scaler.state_dict(), ts_b.scaler.state_dict(), "scaler")
    assert (ts_a.step, ts_a.epoch, ts_a.best) == (ts_b.step, ts_b.epoch, ts_b.best)


def _reference(scaler_enabled: bool = True) -> tuple[TrainState, list, dict]:
    ts = build(0, scaler_enabled)
    losses: list = []
    train(ts, STEPS, losses)
    return ts, losses, RNGState().state_dict().value


# Save and load are separate steps: RNGState captures the process-global RNG when it is saved,
# so the fresh objects (whose construction reseeds it) must be built after the save.
def _sim_save(ts: TrainState, tmp_path: Path):
    return core.save(ts)


def _sim_load(fresh: TrainState, saved, tmp_path: Path) -> None:
    core.load(fresh, saved)


def _resurgo_save(ts: TrainState, tmp_path: Path):
    resurgo.save(ts, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _resurgo_load(fresh: TrainState, path, tmp_path: Path) -> None:
    resurgo.load(fresh, path)


@pytest.mark.parametrize("save,load", [(_sim_save, _sim_load), (_resurgo_save, _resurgo_load)],
                         ids=["core-semantics", "resurgo"])
@pytest.mark.parametrize("k", [3, 7, 11])  # mid epoch 1, exactly at an epoch's end, mid epoch 2
def test_resume_is_bitwise_identical(save, load, k: int, tmp_path: Path) -> None:
    ref_ts, ref_losses, ref_rng = _reference()

    ts = build(0)
    losses: list = []
    train(ts, k, losses)
    saved = save(ts, tmp_path)
    fresh = build(99)  # other weights, other RNG states: everything must come from the checkpoint
    assert not torch.equal(next(fresh.model.parameters()), next(ts.model.parameters()))
    load(fresh, saved, tmp_path)
    assert fresh.step == k and fresh.optimizer.state_dict()["state"]  # Adam state was added
    train(fresh, STEPS, losses)

    assert_runs_equal(ref_ts, ref_losses, fresh, losses)
    assert_trees_equal(RNGState().state_dict().value, ref_rng, "rng after the run")


def test_resume_with_disabled_scaler(tmp_path: Path) -> None:
    ref_ts, ref_losses, _ = _reference(scaler_enabled=False)
    ts = build(0, scaler_enabled=False)
    losses: list = []
    train(ts, 9, losses)
    saved = core.save(ts)
    fresh = build(5, scaler_enabled=False)
    core.load(fresh, saved)
    train(fresh, STEPS, losses)
    assert_runs_equal(ref_ts, ref_losses, fresh, losses)


def test_state_dict_has_only_given_parts() -> None:
    model = nn.Linear(2, 2)
    ts = TrainState(model=model, step=3)
    assert list(ts.state_dict()) == ["model", "step", "rng"]
    assert list(TrainState(model=model, rng=False).state_dict()) == ["model"]
    assert TrainState(rng=False).state_dict() == {}
    ts = TrainState(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rng=False, epoch=1, tag="x")
    assert list(ts.state_dict()) == ["optimizer", "epoch", "tag"]


def test_plain_extras_are_attributes() -> None:
    ts = TrainState(rng=False, step=0, history=[1.0])
    ts.step = 5
    ts.step += 1
    assert ts.step == 6 and ts.state_dict()["step"] == 6
    assert ts.extras == {"step": 6, "history": [1.0]}
    saved = core.save(ts)
    other = TrainState(rng=False, step=0, history=[])
    core.load(other, saved)
    assert other.step == 6 and other.history == [1.0]
    with pytest.raises(AttributeError, match="stpe"):
        ts.stpe = 1  # a typo must not silently add a key
    with pytest.raises(AttributeError, match="no component or extra 'nope'"):
        ts.nope  # noqa: B018
    with pytest.raises(AttributeError, match="set at construction"):
        ts.model = nn.Linear(1, 1)


def test_components_are_attributes_and_loader_is_tracked() -> None:
    model = nn.Linear(2, 2)
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    ts = TrainState(model=model, dataloader=loader)
    assert ts.model is model and ts.dataloader is loader and is_tracked(loader)
    assert ts.optimizer is None and isinstance(ts.rng, RNGState)
    assert "TrainState(model=Linear" in repr(ts)


def test_the_loaders_class_is_replaced_in_place_as_documented() -> None:
    # TrainState's docstring: a DataLoader's __class__ becomes a subclass of its class (Tracked...,
    # or Resumable... for one with its own state_dict); any other Stateful is used as it is.
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Position:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, sd: dict) -> None:
            pass

    for cls, name in ((DataLoader, "TrackedDataLoader"), (StatefulDataLoader, "ResumableStatefulDataLoader")):
        loader = cls(TensorDataset(torch.zeros(4, 2)), batch_size=2)
        ts = TrainState(dataloader=loader, rng=False)
        assert ts.dataloader is loader
        assert type(loader).__name__ == name and type(loader).__bases__ == (cls,)
    other = Position()
    assert TrainState(dataloader=other, rng=False).dataloader is other and type(other) is Position


class Counter:
    """A Stateful extra whose load draws random numbers: the RNG must still be restored exactly."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        torch.rand(3)  # e.g. a module re-initialising something


def test_stateful_extra_and_rng_restored_last() -> None:
    c = Counter()
    c.n = 4
    ts = TrainState(counter=c)
    saved = core.save(ts)
    expected = torch.rand(5)
    other = TrainState(counter=Counter())
    torch.manual_seed(77)
    core.load(other, saved)
    assert other.counter.n == 4
    assert torch.equal(torch.rand(5), expected)


@pytest.mark.parametrize("name", ["state_dict", "load_state_dict", "extras", "_private"])
def test_extra_name_collisions_raise(name: str) -> None:
    with pytest.raises(UnsupportedValueError, match="collides with a reserved name"):
        TrainState(**{name: 1})


def test_reserved_names_bind_to_components() -> None:
    # model=, rng= ... are parameters: passing them never creates an extra of that name.
    ts = TrainState(**{"rng": False, "step": 1})
    assert list(ts.state_dict()) == ["step"]


def test_bad_extra_name_and_non_stateful_component_raise() -> None:
    with pytest.raises(UnsupportedValueError, match="identifier"):
        TrainState(**{"a.b": 1})
    with pytest.raises(UnsupportedValueError, match="state_dict"):
        TrainState(model=object())
    with pytest.raises(UnsupportedValueError, match="DataLoader"):
        TrainState(dataloader=[1, 2])
    with pytest.raises(UnsupportedValueError, match="rng"):
        TrainState(rng="yes")


def test_load_state_dict_key_mismatch() -> None:
    ts = TrainState(rng=False, step=0)
    with pytest.raises(KeyMismatchError) as e:
        ts.load_state_dict({"epoch": 1})
    assert e.value.missing == ["step"] and e.value.unexpected == ["epoch"]


def test_a_train_states_step_is_the_checkpoints_step(tmp_path: Path) -> None:
    """Without step=, the int under "step" at the top of the state is the manifest's step."""
    model = nn.Linear(2, 2)
    ts = TrainState(model=model, rng=False, step=0, epoch=3)
    ts.step = 41
    resurgo.save(ts, tmp_path / "ts")
    assert resurgo.read_manifest(tmp_path / "ts").step == 41
    resurgo.save(ts, tmp_path / "given", step=7)  # step= wins
    assert resurgo.read_manifest(tmp_path / "given").step == 7
    resurgo.save({"w": torch.ones(1), "step": 12}, tmp_path / "dict")
    assert resurgo.read_manifest(tmp_path / "dict").step == 12
    # Not a step counter: a bool, a tensor, a nested "step", no "step" at all.
    for i, state in enumerate(({"step": True}, {"step": torch.tensor(3)}, {"opt": {"step": 5}},
                               TrainState(model=model, rng=False))):
        resurgo.save(state, tmp_path / f"none{i}")
        assert resurgo.read_manifest(tmp_path / f"none{i}").step is None, state
