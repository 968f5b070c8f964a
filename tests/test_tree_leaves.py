"""The one walk over a manifest tree (resurgo.format.tree.iter_leaves) finds exactly what the save
flattened: every tensor under the key the manifest gives it (``key@rankN`` under a per-rank value,
on any number of ranks) and every other value under the key the same rules make."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from resurgo import PerRank
from resurgo.format import values
from resurgo.format.tree import iter_leaves, iter_values, path_key, per_rank_key, validate_tree
from resurgo.plan.global_plan import merge_trees
from resurgo.state.flatten import flatten_state

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.text(max_size=4),
                    st.floats(allow_nan=False), st.binary(max_size=4))
TENSORS = st.one_of(st.integers(0, 3).map(lambda n: torch.arange(n, dtype=torch.float32)),
                    st.integers(0, 3).map(lambda n: np.arange(n, dtype=np.int16)))
KEYS = st.one_of(st.sampled_from(["a", "b", "c", "d"]), st.integers(5, 8))  # no two spell the same key


def containers(children):
    return st.one_of(
        st.dictionaries(KEYS, children, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        children.map(PerRank),
    )


STATES = st.recursive(st.one_of(SCALARS, TENSORS), containers, max_leaves=12)


def expected_values(obj, path=(), rank=None, world=1):
    """(key, value) of every non-tensor leaf of a Python state, by the rules the format documents:
    the path joined with '.', and '@rank<r>' inside a per-rank value (once, for the outermost)."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return []
    if isinstance(obj, PerRank):
        if rank is not None:
            return expected_values(obj.value, path, rank, world)
        return [kv for r in range(world) for kv in expected_values(obj.value, path, r, world)]
    key = path_key(path) if rank is None else per_rank_key(path_key(path), rank)
    if isinstance(obj, dict):
        if not obj:
            return [(key, {})]
        return [kv for k, v in obj.items() for kv in expected_values(v, path + (k,), rank, world)]
    if isinstance(obj, (list, tuple)):
        if not obj:
            return [(key, obj)]
        return [kv for i, v in enumerate(obj) for kv in expected_values(v, path + (i,), rank, world)]
    return [(key, obj)]


@given(state=st.dictionaries(KEYS, STATES, max_size=4), world=st.integers(1, 3))
def test_iter_leaves_yields_exactly_what_the_save_flattened(state, world):
    tree, leaves, _ = flatten_state(state)
    merged, per_rank = merge_trees([tree] * world, set())  # as a save on `world` ranks names them
    kinds = {k: leaves[k].kind for k in leaves if k not in per_rank}
    kinds.update({per_rank_key(k, r): leaves[k].kind for k in per_rank for r in range(world)})
    validate_tree(merged, kinds, False, "test")

    found = list(iter_leaves(merged))
    tensors = [leaf for leaf in found if leaf.is_tensor]
    assert all(leaf.key == leaf.node["key"] for leaf in tensors)  # the key rules give the saved key
    assert sorted(leaf.key for leaf in tensors) == sorted(kinds)  # each tensor once
    for leaf in tensors:
        assert (leaf.rank is None) == (leaf.key in leaves)

    got = [(leaf.key, leaf.node) for leaf in iter_values(merged)]
    want = expected_values(state, world=world)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (key, node), (_, value) in zip(got, want):
        if node["type"] in ("dict", "list", "tuple"):
            assert node["items"] == [] and value in ({}, [], ())
        else:
            decoded = values.decode_scalar(node, key, allow_pickle=False)
            assert type(decoded) is type(value) and (decoded == value or repr(decoded) == repr(value))


def test_nested_per_rank_values_take_the_outer_rank_as_their_tensors_do():
    tree, _, _ = flatten_state({"r": PerRank({"t": torch.zeros(1), "n": PerRank(3)})})
    merged, _ = merge_trees([tree, tree], set())
    assert [(leaf.key, leaf.rank) for leaf in iter_leaves(merged)] == [
        ("r.t@rank0", 0), ("r.n@rank0", 0), ("r.t@rank1", 1), ("r.n@rank1", 1)]
    assert [leaf.node["key"] for leaf in iter_leaves(merged) if leaf.is_tensor] == ["r.t@rank0", "r.t@rank1"]
