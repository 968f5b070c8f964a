"""The Stateful protocol: anything with ``state_dict()`` and ``load_state_dict(sd)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def is_stateful(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, np.ndarray, Mapping, list, tuple, type)):
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def prepare_for_load(obj: Any) -> None:
    """Give a load target the chance to create state that loading fills in place.

    A Stateful may define ``_resurgo_before_load()`` (TrainState does). A torch optimizer over
    sharded parameters (DTensor: FSDP2, tensor parallel) with no state yet gets its state created
    now, as sharded tensors, by one step with zero gradients and a zero learning rate (what
    ``torch.distributed.checkpoint.state_dict`` does): loading then fills each rank's shards
    instead of materializing full tensors.
    """
    hook = getattr(obj, "_resurgo_before_load", None)
    if callable(hook):
        hook()
        return
    if isinstance(obj, torch.optim.Optimizer) and not obj.state:
        params = [p for group in obj.param_groups for p in group["params"]]
        if any(type(p).__name__ == "DTensor" for p in params):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(obj)
