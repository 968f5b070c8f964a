"""The manifest's ``tree``: its node kinds, the key rules, one walk over its leaves, and its check.

Node kinds: containers (dict, ordered_dict, list, tuple), ``stateful`` (an object's state_dict,
no key component of its own), ``per_rank`` (one subtree per saving rank), tensor references
(tensor, ndarray) and scalar leaves (docs/format.md, "The tree"). Key rules: a leaf's flat key is
its path joined with ``.`` (:func:`path_key`); inside a per-rank subtree the key gains
``@rank<r>`` (:func:`per_rank_key`), as the manifest names per-rank tensors. :func:`iter_leaves`
walks a validated tree once for everything that reads it (inspect, convert, diff).

The tree is untrusted JSON. :func:`validate_tree` checks it completely, without unpickling and
without recursion deeper than :data:`MAX_TREE_DEPTH`, so that :func:`read_manifest` rejects what
a load would reject for reasons of the file alone (not of the target). Every node is an object
with a ``type`` and exactly the fields of that type.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from resurgo.errors import ManifestError
from resurgo.format import values

# Containers nested inside one another, the root at depth 0. The JSON parser allows 200 nested
# JSON arrays/objects; a dict level costs 3 of them, so 64 levels (about 195) always parse.
MAX_TREE_DEPTH = 64

CONTAINERS = ("dict", "ordered_dict", "list", "tuple")
MAPPINGS = ("dict", "ordered_dict")
TENSORS = ("tensor", "ndarray")  # references to a manifest tensor entry, by key
PER_RANK, STATEFUL = "per_rank", "stateful"
KEY_TYPES = values.KEY_TYPES
FIELDS: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "bool": frozenset({"value"}),
    "int": frozenset({"value"}),
    "float": frozenset({"bits"}),
    "complex": frozenset({"real", "imag"}),
    "str": frozenset({"value"}),
    "bytes": frozenset({"base64"}),
    "numpy_scalar": frozenset({"dtype", "hex"}),
    "torch_dtype": frozenset({"value"}),
    "torch_device": frozenset({"value"}),
    "pickle": frozenset({"class", "base64"}),
    "torch_size": frozenset({"items"}),
    "dict": frozenset({"items"}),
    "ordered_dict": frozenset({"items"}),
    "list": frozenset({"items"}),
    "tuple": frozenset({"items"}),
    "per_rank": frozenset({"items"}),  # one subtree per saving rank, in rank order
    "stateful": frozenset({"class", "state"}),
    "tensor": frozenset({"key"}),
    "ndarray": frozenset({"key"}),
}


def path_key(path: tuple) -> str:
    """The flat key of a path of dict keys and list indexes: ``model.fc.weight``, ``opt.state.0``."""
    return ".".join(str(c) for c in path)


def per_rank_key(key: str, rank: int) -> str:
    """The key of rank ``rank``'s own value of a per-rank ``key``: ``rng.torch@rank3``."""
    return f"{key}@rank{rank}"


@dataclass(frozen=True)
class Leaf:
    """A leaf of a validated tree: a tensor reference, a scalar, a torch_size, or an empty container."""

    key: str  # its flat key; inside a per-rank subtree, per_rank_key(path_key(path), rank)
    node: dict
    path: tuple  # dict keys (decoded) and list indexes from the root; Statefuls add none
    rank: int | None  # the item of the (outermost) per_rank node it is under; None: under none

    @property
    def is_tensor(self) -> bool:
        return self.node["type"] in TENSORS


def iter_leaves(tree: dict, whole: Callable[[dict], bool] | None = None) -> Iterator[Leaf]:
    """Every leaf of a validated ``tree``, in tree order; ``whole(node)``: yield that container as
    one leaf instead of its items. A tensor leaf's key is the key its node refers to: the save names
    a tensor under a per_rank node after its path and the rank of the outermost per_rank node
    (nested ones, of one item each, add nothing). Iterative, so deep trees need no recursion."""
    stack: list[tuple[dict, tuple, int | None]] = [(tree, (), None)]
    while stack:
        node, path, rank = stack.pop()
        t = node["type"]
        children: list[tuple[dict, tuple, int | None]] = []
        if t == STATEFUL:
            children = [(node["state"], path, rank)]
        elif t == PER_RANK:
            children = [(item, path, r if rank is None else rank) for r, item in enumerate(node["items"])]
        elif t in CONTAINERS and node["items"] and not (whole is not None and whole(node)):
            if t in MAPPINGS:
                children = [(v, path + (values.decode_key(k, path_key(path)),), rank) for k, v in node["items"]]
            else:
                children = [(v, path + (i,), rank) for i, v in enumerate(node["items"])]
        else:
            key = path_key(path)
            yield Leaf(key if rank is None else per_rank_key(key, rank), node, path, rank)
        stack.extend(reversed(children))


def iter_values(tree: dict, whole: Callable[[dict], bool] | None = None) -> Iterator[Leaf]:
    """The leaves of :func:`iter_leaves` that are not tensors: the values the tree holds itself."""
    return (leaf for leaf in iter_leaves(tree, whole) if not leaf.is_tensor)


def validate_tree(tree: Any, tensor_kinds: Mapping[str, str], pickled: bool, source: str) -> None:
    """Raise ManifestError unless ``tree`` is a well-formed v1 tree.

    ``tensor_kinds`` maps each tensor key of the manifest to its kind ("torch" or "numpy"): a
    ``tensor`` node must name a torch entry, an ``ndarray`` node a numpy one, each at most once.
    A ``pickle`` node requires the manifest's ``pickled`` flag.
    """
    seen: set[str] = set()
    stack: list[tuple[Any, int, str]] = [(tree, 0, "")]
    while stack:
        node, depth, at = stack.pop()
        where = f"{source}: tree node {at or '<root>'}"
        if depth > MAX_TREE_DEPTH:
            raise ManifestError(f"{where}: nesting deeper than {MAX_TREE_DEPTH}")
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise ManifestError(f"{where}: every tree node must be an object with a string 'type'")
        t = _check_fields(node, where)
        if t in ("dict", "ordered_dict"):
            items = _list(node, where)
            for i, pair in enumerate(items):
                if not (isinstance(pair, list) and len(pair) == 2 and (isinstance(pair[0], str) or (
                        isinstance(pair[0], dict) and pair[0].get("type") in KEY_TYPES))):
                    raise ManifestError(f"{where}: item {i} must be a [key, value] pair with a string or plain scalar key")
                if isinstance(pair[0], dict):
                    _check_fields(pair[0], f"{where} key {i}")
                    _scalar(pair[0], f"{where} key {i}")
                stack.append((pair[1], depth + 1, f"{at}/{i}"))
        elif t in ("list", "tuple", "per_rank"):
            if t == "per_rank" and not _list(node, where):
                raise ManifestError(f"{where}: a per_rank node needs one item per saving rank")
            stack.extend((v, depth + 1, f"{at}/{i}") for i, v in enumerate(_list(node, where)))
        elif t == "stateful":
            if not isinstance(node["class"], str):
                raise ManifestError(f"{where}: a stateful node needs a string 'class'")
            stack.append((node["state"], depth + 1, f"{at}/state"))
        elif t == "torch_size":
            if not all(type(d) is int and -(1 << 63) <= d < 1 << 63 for d in _list(node, where)):
                raise ManifestError(f"{where}: torch_size items must be 64-bit signed ints")
        elif t in ("tensor", "ndarray"):
            key = node["key"]
            if not isinstance(key, str) or key not in tensor_kinds:
                raise ManifestError(f"{where}: refers to unknown tensor {str(key)[:200]!r}")
            if (t == "tensor") != (tensor_kinds[key] == "torch"):
                raise ManifestError(f"{where}: node type {t} of {key!r} disagrees with its entry kind {tensor_kinds[key]}")
            if key in seen:
                raise ManifestError(f"{where}: tensor {key!r} is referenced twice")
            seen.add(key)
        elif t == "pickle":
            if not pickled:
                raise ManifestError(f"{where}: a pickle node in a manifest whose 'pickled' flag is false")
            if not isinstance(node["class"], str) or not isinstance(node["base64"], str):
                raise ManifestError(f"{where}: a pickle node needs string 'class' and 'base64'")
            try:
                base64.b64decode(node["base64"], validate=True)  # checked, never unpickled here
            except ValueError:
                raise ManifestError(f"{where}: invalid base64 in a pickle node") from None
        else:
            _scalar(node, where)


def top_level_step(tree: dict) -> int | None:
    """The int saved under the key ``"step"`` at the top of the state, or None.

    The top is the root dict, or the root Stateful's ``state_dict()`` (a TrainState's extras):
    ``TrainState(..., step=n)`` and ``{"model": ..., "step": n}`` give ``n``. A bool, a tensor, a
    value that differs between ranks (per rank) or a ``step`` nested deeper is not taken.
    """
    node = tree["state"] if tree.get("type") == "stateful" else tree
    if node.get("type") not in ("dict", "ordered_dict"):
        return None
    for key, value in node["items"]:
        if key == "step" and value.get("type") == "int":
            return value["value"]
    return None


def _check_fields(node: dict, where: str) -> str:
    """The node's type, once its fields are exactly those of that type."""
    t = node["type"]
    fields = FIELDS.get(t)
    if fields is None:
        raise ManifestError(f"{where}: unknown node type {t[:40]!r}")
    if node.keys() - {"type"} != fields:
        raise ManifestError(f"{where}: a {t} node has exactly the fields {sorted(fields)}, found "
                            f"{sorted(k[:40] for k in node.keys() - {'type'})[:10]}")
    return t


def _list(node: dict, where: str) -> list:
    items = node["items"]
    if not isinstance(items, list):
        raise ManifestError(f"{where}: '{node['type']}' needs a list of items")
    return items


def _scalar(node: dict, where: str) -> None:
    try:
        values.decode_scalar(node, where, allow_pickle=False)
    except ManifestError as e:
        message = str(e)
        raise ManifestError(message if message.startswith(where) else f"{where}: {message}") from None
