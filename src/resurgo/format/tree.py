"""Structural check of the manifest's ``tree``: node types, their fields, tensor references, depth.

The tree is untrusted JSON. :func:`validate_tree` checks it completely, without unpickling and
without recursion deeper than :data:`MAX_TREE_DEPTH`, so that :func:`read_manifest` rejects what
a load would reject for reasons of the file alone (not of the target). Every node is an object
with a ``type`` and exactly the fields of that type (docs/format.md, "The tree").
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from resurgo.errors import ManifestError
from resurgo.format import values

# Containers nested inside one another, the root at depth 0. The JSON parser allows 200 nested
# JSON arrays/objects; a dict level costs 3 of them, so 64 levels (about 195) always parse.
MAX_TREE_DEPTH = 64

CONTAINERS = ("dict", "ordered_dict", "list", "tuple")
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
