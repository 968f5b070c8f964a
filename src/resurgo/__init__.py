"""resurgo: checkpoint/restart for deep-learning training.

Public API (see README.md and docs/): ``save``, ``load``, ``load_dict``, ``convert``,
``import_checkpoint``, ``TrainState``, ``ElasticSampler``, ``elastic_state``, ``CheckpointManager``, ``Tier``, ``daly_interval``,
``ResurgoError`` and its subclasses, ``SaveReport``, ``LoadReport``, ``ConvertReport``.

The names that need torch are imported on first use (PEP 562), so that ``import resurgo.cli``
(the command line, and its ``--help``) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from resurgo.errors import (
    BaseModelMismatchError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    DataPositionError,
    DTypeMismatchError,
    ExpansionError,
    ExternalFilesError,
    ForeignFilesError,
    ImportSpecError,
    IncompleteCheckpointError,
    KeyMismatchError,
    ManifestError,
    MemoryBudgetError,
    NotACheckpointError,
    PickleNotAllowedError,
    RankFailedError,
    ResurgoError,
    ResurgoWarning,
    SaveInFlightError,
    ShapeMismatchError,
    ShardingError,
    StorageError,
    StudyError,
    TypeMismatchError,
    UnsupportedValueError,
    WorldSizeMismatchError,
)
from resurgo.version import __version__

if TYPE_CHECKING:
    from resurgo.api import AsyncSaveHandle, async_save, load, load_dict, read_manifest, save
    from resurgo.conversion import convert
    from resurgo.diff import CheckpointDiff, diff_checkpoints
    from resurgo.layout.shards import FlatShard, Shard
    from resurgo.manager import CheckpointManager, MemoryTier, Tier, daly_interval
    from resurgo.interop.api import import_checkpoint
    from resurgo.reports import ConvertReport, ImportReport, LoadReport, SaveReport
    from resurgo.state.elastic_loader import elastic_state
    from resurgo.state.elastic_sampler import ElasticSampler
    from resurgo.state.per_rank import PerRank
    from resurgo.state.train_state import TrainState

# name -> the module that defines it (imported on first access)
_LAZY = {
    "save": "resurgo.api", "load": "resurgo.api", "load_dict": "resurgo.api", "read_manifest": "resurgo.api",
    "convert": "resurgo.conversion", "import_checkpoint": "resurgo.interop.api",
    "ImportReport": "resurgo.reports",
    "diff_checkpoints": "resurgo.diff", "CheckpointDiff": "resurgo.diff",
    "Shard": "resurgo.layout.shards", "FlatShard": "resurgo.layout.shards",
    "CheckpointManager": "resurgo.manager", "Tier": "resurgo.manager", "MemoryTier": "resurgo.manager", "daly_interval": "resurgo.manager",
    "async_save": "resurgo.api", "AsyncSaveHandle": "resurgo.api",
    "SaveReport": "resurgo.reports", "LoadReport": "resurgo.reports", "ConvertReport": "resurgo.reports",
    "PerRank": "resurgo.state.per_rank",
    "elastic_state": "resurgo.state.elastic_loader",
    "ElasticSampler": "resurgo.state.elastic_sampler",
    "TrainState": "resurgo.state.train_state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resurgo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))




__all__ = [
    "__version__", "save", "async_save", "AsyncSaveHandle", "load", "load_dict", "read_manifest", "convert", "import_checkpoint", "ImportReport", "ImportSpecError", "diff_checkpoints", "CheckpointDiff", "TrainState", "SaveReport", "LoadReport",
    "ConvertReport", "Shard", "FlatShard", "PerRank", "ShardingError", "WorldSizeMismatchError", "RankFailedError",
    "ElasticSampler", "elastic_state", "DataPositionError",
    "CheckpointManager", "Tier", "MemoryTier", "daly_interval",
    "ResurgoError", "ResurgoWarning", "CheckpointExistsError", "ForeignFilesError", "CheckpointReplacedError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "DTypeMismatchError", "IncompleteCheckpointError", "KeyMismatchError", "ManifestError",
    "NotACheckpointError", "PickleNotAllowedError", "ShapeMismatchError", "StorageError",
    "TypeMismatchError", "UnsupportedValueError", "MemoryBudgetError", "SaveInFlightError", "StudyError",
    "ExpansionError", "BaseModelMismatchError", "ExternalFilesError",
]
