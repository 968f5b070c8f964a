"""PEFT adapters (LoRA and the other methods of the ``peft`` package) saved without their base model.

``AdapterOnly(peft_model)`` is the Stateful of a ``PeftModel``'s adapters: ``state_dict()`` holds
every adapter's weights (the tensors ``PeftModel.save_pretrained`` writes, under the same names),
its ``adapter_config.json`` and the frozen base model's identity: a content digest of the base
weights (xxh3-128 over every tensor of the base model that is not an adapter's, by name, dtype,
shape and bytes, in sorted key order), never a copy. Loading checks that digest against the
target model's base first, and raises :class:`BaseModelMismatchError` naming both digests before
a byte of the model changes. ``TrainState(model=AdapterOnly(model), optimizer=...)`` saves the
adapters with their optimizer state (the optimizer holds the trainable parameters only);
``ResurgoTrainer`` and ``ResurgoAccelerator`` save a PEFT model this way by themselves.

:func:`base_model_digest` is the digest of a model's base: of a ``PeftModel``, the tensors that are
not an adapter's, named as in the base model before PEFT wrapped it; of any other module, all of
its tensors. So the digest of a plain model equals that of the same model under an adapter.

Needs the ``peft`` package; this module imports it only when an adapter is saved or loaded.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from resurgo.errors import BaseModelMismatchError, KeyMismatchError, UnsupportedValueError
from resurgo.format import adapter as fmt
from resurgo.format.dtypes import TORCH_DTYPE_NAMES

__all__ = ["AdapterOnly", "base_model_digest", "is_peft_model"]

_HASH_SLICE = 1 << 26  # bytes copied off a device at a time while hashing
# The path components PEFT inserts into the names of the base model's own tensors.
_WRAPPER_PREFIX = "base_model.model."
_WRAPPER_PARTS = ("base_layer", "original_module")


def is_peft_model(obj: Any) -> bool:
    """True for a ``peft.PeftModel`` (without importing peft: a model of it means it is imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(obj, peft.PeftModel)


def model_state(model: Any, held: dict[int, AdapterOnly]) -> Any:
    """What an integration saves for ``model``: its adapters for a PEFT model, else the model.
    ``held``: the integration's AdapterOnly by model, kept so that the base model is hashed again
    only when its weights change, not at every save."""
    if not is_peft_model(model):
        return model
    adapter = held.get(id(model))
    if adapter is None or adapter.model is not model:
        adapter = held[id(model)] = AdapterOnly(model)
    return adapter


class AdapterOnly:
    """The adapters of a ``peft.PeftModel``, with its base model's digest; see the module docstring."""

    def __init__(self, model: Any) -> None:
        if not is_peft_model(model):
            raise UnsupportedValueError(
                f"AdapterOnly(model): a {type(model).__module__}.{type(model).__qualname__} is not a peft.PeftModel; "
                "wrap the model with peft.get_peft_model(model, config) first, or save the whole model "
                "(TrainState(model=model))")
        self.model = model
        self._digest: tuple[tuple, str] | None = None  # (what the digest was computed from, the digest)
        self._load_target = False

    # -- what is saved -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        adapters, owned = self._adapters()
        if self._load_target:
            # The target of a load: fresh tensors, so that nothing reaches the model before
            # load_state_dict has checked the base model's digest.
            self._load_target = False
            return {fmt.FORMAT_KEY: "", fmt.DIGEST_KEY: "",
                    fmt.ADAPTERS_KEY: {name: {fmt.CONFIG_KEY: "",
                                              fmt.WEIGHTS_KEY: {k: torch.empty_like(t) for k, (t, _) in w.items()}}
                                       for name, w in adapters.items()}}
        self._check_trainable(owned)
        return {fmt.FORMAT_KEY: fmt.FORMAT, fmt.DIGEST_KEY: self._base_digest(owned),
                fmt.ADAPTERS_KEY: {name: {fmt.CONFIG_KEY: _config_json(self.model, name),
                                          fmt.WEIGHTS_KEY: {k: t for k, (t, _) in w.items()}}
                                   for name, w in adapters.items()}}

    def _resurgo_before_load(self) -> None:
        self._load_target = True  # the next state_dict() is a load's target

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_target = False
        if state_dict.get(fmt.FORMAT_KEY) != fmt.FORMAT:
            raise UnsupportedValueError(
                f"adapter_format: expected {fmt.FORMAT!r}, found {state_dict.get(fmt.FORMAT_KEY)!r}: not adapters saved "
                "by AdapterOnly (a checkpoint of the whole model loads into the model itself)")
        adapters, owned = self._adapters()
        saved = state_dict.get(fmt.DIGEST_KEY)
        if saved is not None:
            current = self._base_digest(owned)
            if saved != current:
                raise BaseModelMismatchError(
                    f"the adapters were trained on a base model of digest {saved}, but this model's base has digest "
                    f"{current}: load them onto the base model they were trained on (same weights, same dtypes; "
                    "resurgo.integrations.peft.base_model_digest(model) gives a model's digest)")
        weights = {name: a.get(fmt.WEIGHTS_KEY, {}) for name, a in state_dict.get(fmt.ADAPTERS_KEY, {}).items()}
        missing = [f"{name}.{k}" for name, w in adapters.items() for k in w if k not in weights.get(name, {})]
        unexpected = [f"{name}.{k}" for name, w in weights.items() for k in w if k not in adapters.get(name, {})]
        if missing or unexpected:
            raise KeyMismatchError(f"the adapters differ from this model's: missing {missing[:5]}, unexpected "
                                   f"{unexpected[:5]} (the same peft config, adapter names and target modules are "
                                   "needed)", missing, unexpected)
        with torch.no_grad():
            for name, w in adapters.items():
                for key, (target, _) in w.items():
                    source = weights[name][key]
                    if source.data_ptr() != target.data_ptr():
                        target.copy_(source)

    # -- the model's tensors -------------------------------------------------------------------
    def _adapters(self) -> tuple[dict[str, dict[str, tuple[torch.Tensor, str]]], set[tuple]]:
        """({adapter name: {its PEFT name: (the model's tensor, the model's name)}}, the identities
        of every adapter tensor)."""
        from peft import get_peft_model_state_dict

        tensors = _named_tensors(self.model)
        by_identity = {_identity(t): (t, name) for name, t in tensors.items() if t.numel()}
        adapters: dict[str, dict[str, tuple[torch.Tensor, str]]] = {}
        owned: set[tuple] = set()
        for name in self.model.peft_config:
            if "." in name:
                raise UnsupportedValueError(f"adapter name {name!r}: resurgo needs adapter names without '.'")
            exported = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
            adapters[name] = {}
            for key, t in exported.items():
                if not isinstance(t, torch.Tensor) or not t.numel():
                    continue
                found = by_identity.get(_identity(t))
                if found is None:
                    raise UnsupportedValueError(
                        f"adapter {name!r}: its tensor {key!r} is computed, not a tensor of the model; AdapterOnly "
                        f"saves adapters whose tensors are the model's ({self.model.peft_config[name].peft_type}): save "
                        "the whole model (TrainState(model=model)) for this one")
                adapters[name][key] = (found[0].detach(), found[1])
                owned.add(_identity(t))
        return adapters, owned

    def _check_trainable(self, owned: set[tuple]) -> None:
        """A trainable parameter outside every adapter would be lost by an adapter-only save."""
        lost = [name for name, p in self.model.named_parameters() if p.requires_grad and _identity(p) not in owned]
        if lost:
            raise UnsupportedValueError(
                f"parameters {lost[:5]} are trainable but belong to no adapter, so an adapter-only save would lose "
                "them: list their modules in the peft config's modules_to_save, or save the whole model "
                "(TrainState(model=model))")

    def _base_digest(self, owned: set[tuple]) -> str:
        base = {name: t for name, t in _named_tensors(self.model).items() if _identity(t) not in owned}
        # The digest is recomputed only when a base tensor was replaced or changed in place.
        seen = tuple((name, t.data_ptr(), t._version) for name, t in sorted(base.items()))
        if self._digest is None or self._digest[0] != seen:
            self._digest = (seen, _digest(_base_names(base)))
        return self._digest[1]


def base_model_digest(model: Any) -> str:
    """The content digest of ``model``'s base: see the module docstring."""
    if is_peft_model(model):
        adapter = AdapterOnly(model)
        return adapter._base_digest(adapter._adapters()[1])
    return _digest(_named_tensors(model))


def _named_tensors(model: Any) -> dict[str, torch.Tensor]:
    return {name: t for name, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


def _identity(t: torch.Tensor) -> tuple:
    """The memory a tensor views: two names of it (a tied weight, a detached copy of a name) share it."""
    return t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())


def _base_names(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's tensors under the names they had before PEFT wrapped the model; as they
    are if two would get the same name."""
    renamed = {}
    for name, t in base.items():
        unprefixed = name[len(_WRAPPER_PREFIX):] if name.startswith(_WRAPPER_PREFIX) else name
        renamed[".".join(p for p in unprefixed.split(".") if p not in _WRAPPER_PARTS)] = t
    return renamed if len(renamed) == len(base) else base


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """xxh3-128 over each tensor's name, dtype, shape and bytes, in sorted name order."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.device.type == "meta":
            raise UnsupportedValueError(f"base model tensor {name!r} is on the meta device: no bytes to identify it by")
        h.update(f"{name}\0{TORCH_DTYPE_NAMES.get(t.dtype, str(t.dtype))}\0{list(t.shape)}\0".encode())
        for piece in _byte_slices(t):
            h.update(piece)
    return f"{fmt.DIGEST_ALGORITHM}:{h.hexdigest()}"


def _byte_slices(t: torch.Tensor) -> Iterable[memoryview]:
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), _HASH_SLICE):
        yield flat[start:start + _HASH_SLICE].cpu().numpy().data


def _config_json(model: Any, name: str) -> str:
    """The adapter's adapter_config.json as ``PeftModel.save_pretrained`` writes it (for inference,
    the base model's class named where no task type does), with sets sorted."""
    import copy

    config = copy.deepcopy(model.peft_config[name])
    if config.base_model_name_or_path is None:
        base = model.base_model if config.is_prompt_learning else model.base_model.model
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    out = config.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = sorted(value)
    if config.task_type is None:
        find = getattr(model, "_get_base_model_class", None)  # what PEFT itself names (a private method)
        cls = find(is_prompt_tuning=config.is_prompt_learning) if find is not None else type(model.get_base_model())
        out["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return json.dumps(out, indent=2, sort_keys=True)
