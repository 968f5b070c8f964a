"""The manager's call forms: the state comes first in every method that takes one, and the form
it replaces still works for one release, warning and doing the same thing."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.manager import CheckpointManager
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

