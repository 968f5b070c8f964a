"""TrainState: the whole training state (model, optimizer, scheduler, scaler, data position, RNG,
step counters and any other extras) as one Stateful.

This module owns what "the training state" means and the order in which its parts are restored.
``resurgo.save(TrainState(...), path)`` and ``resurgo.load(ts, path)`` treat it like any Stateful:
``state_dict()`` gives a nested tree of plain data; ``load_state_dict()`` hands each part back.
"""

from __future__ import annotations

from typing import Any

from resurgo.errors import KeyMismatchError, UnsupportedValueError
from resurgo.state.data_position import track_dataloader
from resurgo.state.rng import RNGState
from resurgo.state.stateful import is_stateful, prepare_for_load

__all__ = ["TrainState"]

# Restore order: the RNG goes last, because restoring anything after it could draw random
# numbers (a DataLoader resuming, a module re-initialising) and shift the streams.
_COMPONENTS = ("model", "optimizer", "scheduler", "scaler", "dataloader", "rng")


class TrainState:
    """Model, optimizer, scheduler, scaler, DataLoader position, RNG and extras, as one Stateful.

    ``TrainState(model=m, optimizer=opt, dataloader=loader, step=0)``: every part is optional.
    ``rng=True`` (the default) captures the process-global RNGs (see :class:`RNGState`); pass
    ``rng=False`` to leave them out. Extras are Statefuls or plain values (numbers, strings, tensors, containers);
    plain extras are attributes: ``ts.step += 1`` is saved, and after a load ``ts.step`` holds the
    restored value.

    ``dataloader=``: a ``DataLoader`` is made resumable in place, and its class changes: its
    ``__class__`` is replaced by a subclass of its class (``Tracked<Class>``; ``Resumable<Class>``
    for one with its own ``state_dict()``, such as torchdata's ``StatefulDataLoader``), so that
    ``ts.dataloader is loader`` and ``isinstance(loader, <its class>)`` still holds, while
    ``type(loader)`` is the subclass (see :func:`resurgo.state.data_position.track_dataloader`).
    Create the TrainState before iterating the loader. Any other object with
    ``state_dict()``/``load_state_dict()`` is used as it is.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, scheduler: Any = None,
                 scaler: Any = None, dataloader: Any = None, rng: Any = True, **extra: Any) -> None:
        parts: dict[str, Any] = {}
        given = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        for name, obj in given.items():
            if obj is not None:
                parts[name] = _require_stateful(name, obj)
        if dataloader is not None:
            parts["dataloader"] = track_dataloader(dataloader)
        if rng is True:
            parts["rng"] = RNGState()
        elif rng is not None and rng is not False:
            parts["rng"] = _require_stateful("rng", rng)
        for name in extra:
            _check_extra_name(name)
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_extras", dict(extra))

    # -- components and extras as attributes -----------------------------------------------------
    @property
    def model(self) -> Any:
        return self._parts.get("model")

    @property
    def optimizer(self) -> Any:
        return self._parts.get("optimizer")

    @property
    def scheduler(self) -> Any:
        return self._parts.get("scheduler")

    @property
    def scaler(self) -> Any:
        return self._parts.get("scaler")

    @property
    def dataloader(self) -> Any:
        return self._parts.get("dataloader")

    @property
    def rng(self) -> Any:
        return self._parts.get("rng")

    @property
    def extras(self) -> dict[str, Any]:
        """The extras by name (a copy: set them as attributes)."""
        return dict(self._extras)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: extras live in _extras, not in __dict__.
        extras = self.__dict__.get("_extras", {})
        if name in extras:
            return extras[name]
        raise AttributeError(f"TrainState has no component or extra {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._extras:
            self._extras[name] = value
            return
        if name in _COMPONENTS:
            raise AttributeError(f"TrainState.{name} is set at construction: TrainState({name}=...)")
        # A new name would silently change the checkpoint's keys (and a typo would be lost).
        raise AttributeError(
            f"TrainState has no extra {name!r}; declare it at construction: TrainState(..., {name}=...)"
        )

    # -- Stateful ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for name in _COMPONENTS[:-1]:
            if name in self._parts:
                sd[name] = self._parts[name].state_dict()
        for name, value in self._extras.items():
            sd[name] = value.state_dict() if is_stateful(value) else value
        if "rng" in self._parts:
            sd["rng"] = self._parts["rng"].state_dict()
        return sd

    def _resurgo_before_load(self) -> None:
        """Before a load plans its reads: check the DataLoader can take a position (first, so that a
        refusal changes nothing), then create sharded optimizer state to be filled in place."""
        for name in sorted(self._parts, key=lambda n: n != "dataloader"):
            prepare_for_load(self._parts[name])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every part: components, then extras, then the RNG last."""
        expected = [n for n in _COMPONENTS if n in self._parts] + list(self._extras)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [str(k) for k in state_dict if k not in expected]
        if missing or unexpected:
            raise KeyMismatchError(
                f"TrainState.load_state_dict: parts differ; missing {missing}, unexpected {unexpected}",
                missing, unexpected,
            )
        for name in _COMPONENTS[:-1]:
            if name in self._parts:
                self._parts[name].load_state_dict(state_dict[name])
        for name, current in list(self._extras.items()):
            if is_stateful(current):
                current.load_state_dict(state_dict[name])
            else:
                self._extras[name] = state_dict[name]
        if "rng" in self._parts:
            self._parts["rng"].load_state_dict(state_dict["rng"])

    def __repr__(self) -> str:
        parts = [f"{n}={type(self._parts[n]).__name__}" for n in _COMPONENTS if n in self._parts]
        parts += [f"{k}={type(v).__name__ if is_stateful(v) else repr(v)[:40]}" for k, v in self._extras.items()]
        return f"TrainState({', '.join(parts)})"


def _require_stateful(name: str, obj: Any) -> Any:
    if not is_stateful(obj):
        raise UnsupportedValueError(
            f"TrainState({name}=...): a {type(obj).__module__}.{type(obj).__qualname__} has no "
            "state_dict()/load_state_dict()"
        )
    return obj


def _check_extra_name(name: str) -> None:
    # Extras become attributes and top-level keys: a name must not shadow a component or a
    # method, and a '.' would read as nesting in checkpoint keys.
    if name in _COMPONENTS or name.startswith("_") or hasattr(TrainState, name):
        raise UnsupportedValueError(
            f"TrainState extra {name!r} collides with a reserved name ({', '.join(_COMPONENTS)}, "
            "state_dict, load_state_dict, extras, or a leading underscore); choose another name"
        )
    if not name.isidentifier():
        raise UnsupportedValueError(f"TrainState extra {name!r} is not a Python identifier")
