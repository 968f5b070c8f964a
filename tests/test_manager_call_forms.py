"""The manager's call forms: the state comes first in every method that takes one, and the form
it replaces still works for one release, warning and doing the same thing; each rule is written
one way (a shortcut or its policy object, never both)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import UnsupportedValueError
from resurgo.manager import CheckpointManager, EveryNSteps, KeepAny, KeepEvery, KeepLast, MemoryTier, Tier
from helpers import bits_equal


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(32, 8, generator=g), "step": step}


def saved(root: Path, step: int) -> dict:
    return resurgo.load_dict(root / f"step_{step:09d}")


@pytest.mark.parametrize("method", ["save", "maybe_save"])
def test_the_state_first_does_not_warn(tmp_path, method):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CheckpointManager(tmp_path, every_steps=1, async_save=False) as mgr:
            getattr(mgr, method)(state_at(1), 1)
            getattr(mgr, method)(state_at(2), 2, {"loss": 0.5})
            assert mgr.steps() == [1, 2]
    assert bits_equal(saved(tmp_path, 2), state_at(2))


@pytest.mark.parametrize("method", ["save", "maybe_save"])
def test_the_step_first_warns_naming_the_new_order_and_saves_the_same(tmp_path, method):
    with CheckpointManager(tmp_path / "new", every_steps=1, async_save=False) as mgr:
        assert getattr(mgr, method)(state_at(3), 3, {"loss": 0.25}) in (None, True)
    with CheckpointManager(tmp_path / "old", every_steps=1, async_save=False) as mgr:
        with pytest.warns(DeprecationWarning, match=rf"CheckpointManager\.{method}\(step, state\) is deprecated: "
                                                    rf"call {method}\(state, step\)") as caught:
            returned = getattr(mgr, method)(3, state_at(3), {"loss": 0.25})
        assert returned in (None, True)
        assert [w.filename for w in caught] == [__file__]  # points at the caller's line
        assert mgr.steps() == [3]
    old, new = saved(tmp_path / "old", 3), saved(tmp_path / "new", 3)
    assert bits_equal(old, new) and bits_equal(old, state_at(3))
    meta = lambda root: resurgo.read_manifest(root / "step_000000003").metadata  # noqa: E731
    assert meta(tmp_path / "old") == meta(tmp_path / "new") == {"metrics": {"loss": 0.25}}


def test_keywords_need_no_order(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CheckpointManager(tmp_path, async_save=False) as mgr:
            mgr.save(step=4, state=state_at(4))
            assert mgr.steps() == [4]


# -- one way to write each rule ----------------------------------------------------------------------
@pytest.mark.parametrize("shortcut", [{"every_steps": 5}, {"every_seconds": 60.0}, {"at_steps": [3]},
                                      {"interval": "auto", "mtbf": 3600.0}], ids=lambda d: next(iter(d)))
def test_a_save_shortcut_beside_policy_is_refused_naming_both(tmp_path, shortcut):
    name = next(iter(shortcut))
    with pytest.raises(UnsupportedValueError, match=rf"policy=EveryNSteps\(.*\) and {name}= both say when to save"):
        CheckpointManager(tmp_path / "root", policy=EveryNSteps(10), **shortcut)
    assert not (tmp_path / "root").exists()  # refused before anything was made
    # each alone builds the same object
    with CheckpointManager(tmp_path / "a", every_steps=10) as a, CheckpointManager(tmp_path / "b", policy=EveryNSteps(10)) as b:
        assert a.save_policy == b.save_policy == EveryNSteps(10)


@pytest.mark.parametrize("shortcut", [{"keep_last": 3}, {"keep_every": 10}, {"keep_best": ("loss", "min")}],
                         ids=lambda d: next(iter(d)))
def test_a_retention_shortcut_beside_retention_is_refused_naming_both(tmp_path, shortcut):
    name = next(iter(shortcut))
    with pytest.raises(UnsupportedValueError, match=rf"retention=KeepLast\(n=2\) and {name}= both say what to keep"):
        CheckpointManager(tmp_path / "root", retention=KeepLast(2), **shortcut)
    assert not (tmp_path / "root").exists()
    with CheckpointManager(tmp_path / "a", keep_last=2) as a, CheckpointManager(tmp_path / "b", retention=KeepLast(2)) as b:
        assert a.retention == b.retention == KeepLast(2)


def test_the_first_tiers_keep_last_beside_the_managers_is_refused_naming_both(tmp_path):
    with pytest.raises(UnsupportedValueError, match=r"keep_last=3 and the first tier's Tier\(keep_last=2\) both say"):
        CheckpointManager(tiers=[Tier(tmp_path / "fast", keep_last=2), Tier(tmp_path / "durable")], keep_last=3)
    # a MemoryTier keeps 1 unless told: that is its rule, written at the tier
    with pytest.raises(UnsupportedValueError, match=r"MemoryTier\(keep_last=1\) both say .*keeps 1 unless told.*"
                                                    r"MemoryTier\(\.\.\., keep_last=3\)"):
        CheckpointManager(tiers=[MemoryTier(replicas=0, root=tmp_path / "mem", node=0)], keep_last=3)
    assert not (tmp_path / "fast").exists() and not (tmp_path / "mem").exists()


def test_the_first_tiers_keep_last_is_its_rule_kept_with_the_managers_other_rules(tmp_path):
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    with CheckpointManager(tiers=[Tier(fast, keep_last=1), Tier(durable)], keep_every=2, async_save=False) as mgr:
        assert mgr.retention == KeepAny(KeepLast(1), KeepEvery(2))
        for s in range(1, 6):
            mgr.save(state_at(s), s)
        mgr.wait()
        assert mgr.steps(0) == [2, 4, 5] and mgr.steps(1) == [1, 2, 3, 4, 5]
    with CheckpointManager(tiers=[Tier(fast, keep_last=1), Tier(durable)], retention=KeepEvery(2)) as mgr:
        assert mgr.retention == KeepAny(KeepEvery(2), KeepLast(1))
