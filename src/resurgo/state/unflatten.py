"""Load side: match the manifest's tree against the target state and plan what to fill.

:class:`TargetFill` walks the saved tree and the caller's state together, without touching either:
it finds the destination tensor of every saved tensor (the target's own, or a new one), checks
dtype and shape, collects missing and unexpected keys, and records, in post-order, the actions
that will put values into the target's containers and call ``load_state_dict`` once the bytes
are in. Nothing is mutated until every check has passed and every byte has been read. Every
error it raises, and every ResurgoError an action raises, names the checkpoint and the key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from resurgo.errors import (
    DTypeMismatchError,
    ManifestError,
    ResurgoError,
    ShapeMismatchError,
    TypeMismatchError,
    WorldSizeMismatchError,
    naming_checkpoint,
)
from resurgo.format import dtypes, values
from resurgo.format.expansion import MAX_EXPANSION, entry_bytes, expansion_error
from resurgo.format.manifest import Manifest, TensorEntry
from resurgo.format.tree import MAX_TREE_DEPTH, path_key
from resurgo.layout.box import ChunkBox
from resurgo.layout.shards import LocalPiece, is_sharded, local_layout
from resurgo.state.flatten import Array
from resurgo.state.per_rank import PerRank
from resurgo.state.stateful import is_stateful, prepare_for_load
from resurgo.wording import plural



@dataclass
class Destination:
    """Where one saved tensor's bytes go."""

    key: str
    entry: TensorEntry
    tensor: Array  # the final home of the values (a sharded target's local tensor)
    pieces: tuple[LocalPiece, ...] | None = None  # what this rank holds of a sharded target; None: all

    def local_pieces(self) -> tuple[LocalPiece, ...]:
        if self.pieces is not None:
            return self.pieces
        return (LocalPiece(ChunkBox.whole(tuple(self.entry.shape)), self.tensor),)  # type: ignore[arg-type]


@dataclass
class TargetFill:
    """How a checkpoint's tree fills a target: planned (:meth:`plan`), then applied
    (:meth:`run_actions`) once every byte is in. ``source`` names the checkpoint in every error. A tensor whose dtype or shape differs from
    its target raises (whatever ``strict`` says, which is about keys) unless ``ignore_mismatched``:
    then it is left as it is and its key listed in ``mismatched``."""

    manifest: Manifest
    allow_pickle: bool = False
    destinations: list[Destination] = field(default_factory=list)
    actions: list[tuple[str, Callable[[], None]]] = field(default_factory=list)  # (key, action)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    strict: bool = True
    rank: int = 0
    world: int = 1
    source: str = "checkpoint"
    ignore_mismatched: bool = False
    # The distinct bytes the checkpoint's chunks read, asked once, when a new tensor is first needed;
    # new tensors are refused beyond MAX_EXPANSION times it (None: no limit, the caller allowed it).
    stored_bytes: Callable[[], int] | None = None
    fresh_bytes: int = 0  # the bytes of the new tensors planned so far
    _seen: set = field(default_factory=set)
    _fresh_limit: int | None = None
    _stored: int = 0

    # -- public ---------------------------------------------------------------------------------
    def plan(self, target: Any) -> Any:
        """Plan the load of the whole tree into ``target`` (None: build new values)."""
        return self._node(self.manifest.tree, target, (), 0)

    def run_actions(self) -> None:
        for key, action in self.actions:
            with self._naming(key):
                action()

    @contextmanager
    def _naming(self, key: str) -> Iterator[None]:
        """Code of the target's (a Stateful refusing what was saved: RNG, data position, parts)
        raising: a ResurgoError is raised again naming the checkpoint and ``key``; another
        library's error keeps its type and gains a note saying so (Python 3.11+)."""
        try:
            yield
        except ResurgoError as e:
            named = naming_checkpoint(e, self.source, key)
            if named is e:
                raise
            raise named from e
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"while loading key {key!r} of the checkpoint {self.source}")
            raise

    def _at(self, path: tuple) -> str:
        """The start of every message: the checkpoint and the key."""
        return f"{self.source}: key {path_key(path)!r}"

    # -- walk -----------------------------------------------------------------------------------
    def _node(self, node: Any, target: Any, path: tuple, depth: int) -> Any:
        where = f"{self.source}: manifest tree at key {path_key(path)!r}"
        if depth > MAX_TREE_DEPTH:
            raise ManifestError(f"{where}: nesting deeper than {MAX_TREE_DEPTH}")
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise ManifestError(f"{where}: every tree node must be an object with a 'type'")
        t = node["type"]
        if target is not None and is_stateful(target) and t in ("stateful", "dict", "ordered_dict"):
            with self._naming(path_key(path)):
                prepare_for_load(target)
            inner = node["state"] if t == "stateful" else node
            filled = self._node(inner, target.state_dict(), path, depth + 1)
            self.actions.append((path_key(path), lambda: target.load_state_dict(filled)))
            return target
        if t == "stateful":
            return self._node(node.get("state"), target, path, depth + 1)
        if t == "per_rank":
            return self._per_rank(node, target, path, depth)
        if t in ("tensor", "ndarray"):
            return self._tensor(node, target, path)
        if t in ("dict", "ordered_dict"):
            return self._mapping(node, target, path, depth)
        if t in ("list", "tuple"):
            return self._sequence(node, target, path, depth)
        # A value (a size, a scalar) replaces no container: a target that is one keeps its contents,
        # which a load reporting success would leave unloaded.
        if (isinstance(target, (torch.Tensor, np.ndarray, Mapping, list, tuple)) or is_stateful(target)) \
                and not (t == "torch_size" and isinstance(target, torch.Size)):
            raise TypeMismatchError(
                f"{self._at(path)}: the checkpoint holds a {t} value, the target a {type(target).__name__}"
            )
        if t == "torch_size":
            items = node.get("items")
            if not isinstance(items, list) or not all(type(d) is int for d in items):
                raise ManifestError(f"{where}: torch_size needs a list of ints")
            return torch.Size(items)
        return values.decode_scalar(node, where, self.allow_pickle)

    def _items(self, node: dict, path: tuple) -> list:
        items = node.get("items")
        if not isinstance(items, list):
            raise ManifestError(f"{self.source}: manifest tree at key {path_key(path)!r}: '{node['type']}' needs a list of items")
        return items

    def _mapping(self, node: dict, target: Any, path: tuple, depth: int) -> Any:
        where = f"{self.source}: manifest tree at key {path_key(path)!r}"
        if target is not None and not isinstance(target, Mapping):
            self._type_mismatch(path, target, "a dict")
            target = None
        pairs = []
        for item in self._items(node, path):
            if not isinstance(item, list) or len(item) != 2:
                raise ManifestError(f"{where}: dict items must be [key, value] pairs")
            key = values.decode_key(item[0], where)
            try:
                hash(key)
            except TypeError:
                raise ManifestError(f"{where}: unhashable dict key") from None
            pairs.append((key, item[1]))
        out: dict = OrderedDict() if node["type"] == "ordered_dict" else {}
        if target is None:
            for k, v in pairs:
                out[k] = self._node(v, None, path + (k,), depth + 1)
            return out
        grow = len(target) == 0  # a fresh optimizer's empty 'state' accepts what was saved
        for k, v in pairs:
            if k in target:
                out[k] = self._node(v, target[k], path + (k,), depth + 1)
            elif grow:
                out[k] = self._node(v, None, path + (k,), depth + 1)
            else:
                self.unexpected.append(path_key(path + (k,)))
        saved = {k for k, _ in pairs}
        self.missing.extend(path_key(path + (k,)) for k in target if k not in saved)
        if isinstance(target, dict):
            self.actions.append((path_key(path), lambda: target.update(out)))
            return target
        return {**target, **out}

    def _sequence(self, node: dict, target: Any, path: tuple, depth: int) -> Any:
        items = self._items(node, path)
        if target is not None and not isinstance(target, (list, tuple)):
            self._type_mismatch(path, target, f"a {node['type']}")
            target = None
        if target is None:
            out = [self._node(v, None, path + (i,), depth + 1) for i, v in enumerate(items)]
        else:
            grow = len(target) == 0
            out = []
            for i, v in enumerate(items):
                if i < len(target):
                    out.append(self._node(v, target[i], path + (i,), depth + 1))
                elif grow:
                    out.append(self._node(v, None, path + (i,), depth + 1))
                else:
                    self.unexpected.append(path_key(path + (i,)))
            if len(items) < len(target):  # strict=False keeps what the checkpoint lacks
                self.missing.extend(path_key(path + (i,)) for i in range(len(items), len(target)))
                out.extend(target[len(items):])
            if type(target) is list and node["type"] == "list":
                self.actions.append((path_key(path), lambda: target.__setitem__(slice(None), out)))
                return target
        return tuple(out) if node["type"] == "tuple" else out

    def _per_rank(self, node: dict, target: Any, path: tuple, depth: int) -> Any:
        """A value saved once per rank: this rank's own, or ``on_resize`` of all of them."""
        items = self._items(node, path)
        wrapper = target if isinstance(target, PerRank) else None
        inner = wrapper.value if wrapper is not None else target
        if target is not None and len(items) == self.world:
            own = self._node(items[self.rank], inner, path, depth + 1)
            if wrapper is None:
                return own
            self.actions.append((path_key(path), lambda: setattr(wrapper, "value", own)))
            return wrapper
        if target is not None and (wrapper is None or wrapper.on_resize is None):
            raise WorldSizeMismatchError(
                f"{self._at(path)}: saved per rank by {plural(len(items), 'rank')}, loaded by {self.world}; "
                "wrap the target in resurgo.PerRank(value, on_resize=...) to say how its values carry over")
        saved = [self._node(item, None, path, depth + 1) for item in items]
        out = wrapper if wrapper is not None else PerRank(None)
        rank, world = self.rank, self.world

        def settle() -> None:
            out.saved = saved
            if wrapper is not None and wrapper.on_resize is not None:
                out.value = wrapper.on_resize(saved, rank, world)
            else:
                out.value = saved[rank] if rank < len(saved) else None

        self.actions.append((path_key(path), settle))
        return out

    def _type_mismatch(self, path: tuple, target: Any, expected: str) -> None:
        if isinstance(target, (torch.Tensor, np.ndarray, Mapping, list, tuple)) or is_stateful(target):
            raise TypeMismatchError(
                f"{self._at(path)}: the checkpoint holds {expected}, the target a {type(target).__name__}"
            )

    def _tensor(self, node: dict, target: Any, path: tuple) -> Array:
        key = node.get("key")
        if not isinstance(key, str) or key not in self.manifest.tensors:
            raise ManifestError(f"{self.source}: manifest tree at key {path_key(path)!r}: refers to unknown tensor {str(key)[:200]!r}")
        if key in self._seen:
            raise ManifestError(f"{self.source}: manifest tree: tensor {key!r} is referenced twice")
        self._seen.add(key)
        entry = self.manifest.tensors[key]
        if node["type"] == "tensor" and entry.kind != "torch" or node["type"] == "ndarray" and entry.kind != "numpy":
            raise ManifestError(f"{self.source}: manifest tree: node type {node['type']} of {key!r} disagrees with its entry kind {entry.kind}")
        shape = tuple(entry.shape)
        if is_sharded(target):
            layout = local_layout(target, key)
            tdtype = dtypes.TORCH_DTYPE_NAMES.get(layout.local.dtype)
            if tdtype != entry.dtype:
                return self._mismatch(DTypeMismatchError(
                    f"{self.source}: key {key!r}: checkpoint dtype {entry.dtype}, target dtype "
                    f"{tdtype or layout.local.dtype} (resurgo never casts){_SKIP_HINT}"
                ), key, target)
            if layout.global_shape != shape:
                return self._mismatch(ShapeMismatchError(
                    f"{self.source}: key {key!r}: checkpoint shape {list(shape)}, target global shape "
                    f"{list(layout.global_shape)}{_SKIP_HINT}"
                ), key, target)
            self.destinations.append(Destination(key, entry, layout.local, layout.pieces))
            return target
        if isinstance(target, (torch.Tensor, np.ndarray)):
            tdtype = (dtypes.TORCH_DTYPE_NAMES.get(target.dtype) if isinstance(target, torch.Tensor)
                      else dtypes.numpy_dtype_name(target.dtype))
            if tdtype != entry.dtype:
                return self._mismatch(DTypeMismatchError(
                    f"{self.source}: key {key!r}: checkpoint dtype {entry.dtype}, target dtype "
                    f"{tdtype or target.dtype} (resurgo never casts){_SKIP_HINT}"
                ), key, target)
            if tuple(target.shape) != shape:
                return self._mismatch(ShapeMismatchError(
                    f"{self.source}: key {key!r}: checkpoint shape {list(shape)}, target shape "
                    f"{list(target.shape)}{_SKIP_HINT}"
                ), key, target)
            self.destinations.append(Destination(key, entry, target))
            return target
        if target is not None and (isinstance(target, (Mapping, list, tuple)) or is_stateful(target)):
            raise TypeMismatchError(f"{self._at(path)}: the checkpoint holds a tensor, the target a {type(target).__name__}")
        self._count_fresh(key, entry)  # before allocating
        fresh = new_array(entry)
        self.destinations.append(Destination(key, entry, fresh))
        return fresh

    def _count_fresh(self, key: str, entry: TensorEntry) -> None:
        """ExpansionError when a new tensor for ``key`` would take the new tensors beyond
        MAX_EXPANSION times the distinct bytes stored (a manifest placing many tensors on the same
        bytes); the caller's own tensors are not counted: they cost the file nothing."""
        self.fresh_bytes += entry_bytes(entry)
        if self.stored_bytes is None:
            return
        if self._fresh_limit is None:
            self._stored = self.stored_bytes()
            self._fresh_limit = MAX_EXPANSION * self._stored
        if self.fresh_bytes > self._fresh_limit:
            raise expansion_error(self.source, f"key {key!r}: the new tensors the load would allocate take",
                                  self.fresh_bytes, self._stored, "pass allow_expansion=True")

    def _mismatch(self, error: Exception, key: str, target: Array) -> Array:
        if not self.ignore_mismatched:
            raise error
        self.mismatched.append(key)
        return target


_SKIP_HINT = "; pass ignore_mismatched=True to leave such tensors as they are"


def new_array(entry: TensorEntry) -> Array:
    """An uninitialized array for a saved tensor; its size is bounded by the bytes its chunks hold."""
    if entry.kind == "numpy":
        return np.empty(entry.shape, dtype=dtypes.NUMPY_DTYPES[entry.dtype])
    return dtypes.uninitialized(entry.shape, dtypes.TORCH_DTYPES[entry.dtype])
