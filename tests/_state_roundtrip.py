"""Test helper: round-trip a Stateful the way resurgo's core save/load treats it, without files.

Save: ``state_dict()``, checked to hold only plain data, deep-copied (the checkpoint).
Load: ``state_dict()`` on the (fresh) target gives the destination tree; its tensors and arrays are
filled in place (dtype and shape must match exactly), plain values are replaced by the saved ones,
keys the target lacks are added only inside containers that are empty in the target (a fresh
optimizer's ``state``), then ``load_state_dict(filled)`` is called.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from resurgo import PerRank

_SCALARS = (int, float, bool, str, bytes, type(None))


def assert_plain(tree: Any, key: str = "") -> None:
    """Every leaf is a tensor, a NumPy array/scalar or a Python scalar; containers are plain."""
    if isinstance(tree, (torch.Tensor, np.ndarray, np.generic) + _SCALARS):
        return
    if isinstance(tree, PerRank):  # one rank's value of a per-rank leaf (a world of one here)
        assert_plain(tree.value, key)
        return
    if isinstance(tree, dict):
        for k, v in tree.items():
            assert isinstance(k, (str, int)) and not isinstance(k, bool), f"{key}: bad key {k!r}"
            assert_plain(v, f"{key}.{k}")
        return
    if isinstance(tree, (list, tuple)):
        assert type(tree) in (list, tuple), f"{key}: {type(tree).__name__} is not a plain list/tuple"
        for i, v in enumerate(tree):
            assert_plain(v, f"{key}[{i}]")
        return
    raise AssertionError(f"{key}: {type(tree).__name__} is not plain data")


def save(stateful: Any) -> Any:
    tree = stateful.state_dict()
    assert_plain(tree)
    return copy.deepcopy(tree)


def _fill(dst: Any, src: Any, key: str) -> Any:
    if isinstance(dst, PerRank):
        assert isinstance(src, PerRank), f"{key}: PerRank expected, got {type(src).__name__}"
        dst.value = _fill(dst.value, src.value, key)
        return dst
    if isinstance(dst, torch.Tensor):
        assert isinstance(src, torch.Tensor), f"{key}: tensor expected, got {type(src).__name__}"
        assert dst.dtype == src.dtype, f"{key}: dtype {dst.dtype} != {src.dtype}"
        assert dst.shape == src.shape, f"{key}: shape {tuple(dst.shape)} != {tuple(src.shape)}"
        with torch.no_grad():
            dst.copy_(src)
        return dst
    if isinstance(dst, np.ndarray):
        assert isinstance(src, np.ndarray), f"{key}: array expected, got {type(src).__name__}"
        assert dst.dtype == src.dtype and dst.shape == src.shape, f"{key}: {dst.dtype}{dst.shape} != {src.dtype}{src.shape}"
        dst[...] = src
        return dst
    assert not isinstance(src, (torch.Tensor, np.ndarray)), f"{key}: target has a value, checkpoint a tensor"
    if isinstance(dst, dict):
        assert isinstance(src, dict), f"{key}: dict expected"
        if not dst:
            return copy.deepcopy(src)
        assert set(dst) == set(src), f"{key}: keys {sorted(map(str, dst))} != {sorted(map(str, src))}"
        return type(dst)((k, _fill(dst[k], src[k], f"{key}.{k}")) for k in dst)
    if isinstance(dst, (list, tuple)):
        assert type(dst) is type(src), f"{key}: {type(dst).__name__} != {type(src).__name__}"
        if not dst:
            return copy.deepcopy(src)
        assert len(dst) == len(src), f"{key}: length {len(dst)} != {len(src)}"
        return type(dst)(_fill(d, s, f"{key}[{i}]") for i, (d, s) in enumerate(zip(dst, src)))
    return copy.deepcopy(src)


def load(stateful: Any, saved: Any) -> None:
    filled = _fill(stateful.state_dict(), saved, "")
    stateful.load_state_dict(filled)


def roundtrip(source: Any, target: Any) -> None:
    load(target, save(source))
