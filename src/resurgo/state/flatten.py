"""Save side: turn a nested state into the manifest's tagged ``tree`` plus a flat {key: tensor}.

Keys are the path of each tensor joined with ``.`` (``model.fc.weight``, ``optimizer.state.0.exp_avg``;
the key rules are :mod:`resurgo.format.tree`'s); Statefuls contribute their ``state_dict()`` and no
path component. Containers, dict key types and
scalars are kept exactly in the tree, so the structure comes back as it went in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

import numpy as np
import torch

from resurgo.errors import UnsupportedValueError
from resurgo.format import dtypes, values
from resurgo.format.tree import MAX_TREE_DEPTH, path_key
from resurgo.layout.shards import LocalPiece, is_sharded, local_layout
from resurgo.state.per_rank import PerRank
from resurgo.state.stateful import class_name, is_stateful

Array = Union[torch.Tensor, np.ndarray]


@dataclass
class TensorLeaf:
    """One tensor of the state, as found at save time (not yet copied)."""

    key: str
    value: Array
    kind: Literal["torch", "numpy"]
    dtype: str
    shape: tuple[int, ...]  # the global shape
    pieces: tuple[LocalPiece, ...] | None = None  # what this rank holds of a sharded tensor; None: all of it

    @property
    def nbytes(self) -> int:
        n = dtypes.itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n


def describe_tensor(value: Array, key: str) -> TensorLeaf:
    """Validate a tensor leaf and describe it; raise UnsupportedValueError for what we cannot store."""
    if isinstance(value, np.ndarray):
        name = dtypes.numpy_dtype_name(value.dtype)
        if name is None:
            raise UnsupportedValueError(f"key {key!r}: numpy dtype {value.dtype} is not plain data")
        return TensorLeaf(key, value, "numpy", name, tuple(value.shape))
    if value.layout != torch.strided:
        raise UnsupportedValueError(f"key {key!r}: {value.layout} tensors are not supported; convert to dense")
    if value.is_quantized or value.dtype not in dtypes.TORCH_DTYPE_NAMES:
        raise UnsupportedValueError(f"key {key!r}: quantized dtype {value.dtype} is not supported")
    if value.device.type == "meta":
        raise UnsupportedValueError(f"key {key!r}: a meta tensor has no data to save")
    return TensorLeaf(key, value, "torch", dtypes.TORCH_DTYPE_NAMES[value.dtype], tuple(value.shape))


class Flattener:
    def __init__(self, allow_pickle: bool = False):
        self.allow_pickle = allow_pickle
        self.leaves: dict[str, TensorLeaf] = {}
        self.pickled = False
        self._active: set[int] = set()

    def flatten(self, state: Any) -> dict:
        return self._node(state, (), 0)

    def _node(self, obj: Any, path: tuple, depth: int) -> dict:
        where = f"key {path_key(path)!r}"
        if depth > MAX_TREE_DEPTH:
            raise UnsupportedValueError(f"{where}: containers nested deeper than {MAX_TREE_DEPTH} (the format's limit)")
        if isinstance(obj, (torch.Tensor, np.ndarray)) or is_sharded(obj):
            return self._tensor(obj, path)
        if isinstance(obj, PerRank):
            return {"type": "per_rank", "items": [self._node(obj.value, path, depth + 1)]}
        scalar = values.encode_scalar(obj)
        if scalar is not None:
            return scalar
        if id(obj) in self._active:
            raise UnsupportedValueError(f"{where}: the state contains a reference cycle")
        self._active.add(id(obj))
        try:
            if is_stateful(obj):
                return {"type": "stateful", "class": class_name(obj), "state": self._node(obj.state_dict(), path, depth + 1)}
            if isinstance(obj, Mapping) and type(obj) in (dict, OrderedDict):
                items = []
                for k, v in obj.items():
                    knode = values.encode_key(k)
                    if knode is None:
                        raise UnsupportedValueError(f"{where}: dict key {k!r} of type {type(k).__name__} is not plain data")
                    items.append([knode, self._node(v, path + (k,), depth + 1)])
                return {"type": "dict" if type(obj) is dict else "ordered_dict", "items": items}
            if type(obj) in (list, tuple):
                return {"type": type(obj).__name__, "items": [self._node(v, path + (i,), depth + 1) for i, v in enumerate(obj)]}
            if type(obj) is torch.Size:
                return {"type": "torch_size", "items": [int(d) for d in obj]}
            if self.allow_pickle:
                self.pickled = True
                return values.encode_pickle(obj, where)
            raise UnsupportedValueError(
                f"{where}: a {class_name(obj)} is not plain data (tensor, array, number, str, bytes, None, "
                "dict, list, tuple or Stateful). Convert it, or pass allow_pickle=True to store it pickled."
            )
        finally:
            self._active.discard(id(obj))

    def _tensor(self, obj: Array, path: tuple) -> dict:
        key = path_key(path)
        if key in self.leaves:
            raise UnsupportedValueError(
                f"key {key!r}: two different paths flatten to the same key (for example int 0 and str '0')"
            )
        if is_sharded(obj):
            layout = local_layout(obj, key)
            local = describe_tensor(layout.local, key)
            leaf = TensorLeaf(key, layout.local, "torch", local.dtype, layout.global_shape, layout.pieces)
        else:
            leaf = describe_tensor(obj, key)
        self.leaves[key] = leaf
        return {"type": "tensor" if leaf.kind == "torch" else "ndarray", "key": key}


def flatten_state(state: Any, allow_pickle: bool = False) -> tuple[dict, dict[str, TensorLeaf], bool]:
    """(tree, leaves by key, whether anything was pickled)."""
    f = Flattener(allow_pickle)
    tree = f.flatten(state)
    return tree, f.leaves, f.pickled
