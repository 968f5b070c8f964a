"""resurgo: checkpoint/restart for deep-learning training.

Public API (see README.md and docs/): ``save``, ``load``, ``load_dict``, ``convert``,
``TrainState``, ``ElasticSampler``, ``elastic_state``, ``CheckpointManager``, ``Tier``, ``daly_interval``,
``ResurgoError`` and its subclasses, ``SaveReport``, ``LoadReport``, ``ConvertReport``.
"""

from resurgo.api import __version__, load, load_dict, read_manifest, save
from resurgo.convert import convert
from resurgo.diff import CheckpointDiff, diff_checkpoints
from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CorruptCheckpointError,
    DataPositionError,
    DTypeMismatchError,
    ForeignFilesError,
    IncompleteCheckpointError,
    KeyMismatchError,
    ManifestError,
    MemoryBudgetError,
    NotACheckpointError,
    PickleNotAllowedError,
    RankFailedError,
    ResurgoError,
    SaveInFlightError,
    ShapeMismatchError,
    ShardingError,
    StorageError,
    StudyError,
    TypeMismatchError,
    UnsupportedValueError,
    WorldSizeMismatchError,
)
from resurgo.layout.shards import FlatShard, Shard
from resurgo.manager import CheckpointManager, Tier, daly_interval
from resurgo.pipeline.async_save import AsyncSaveHandle, async_save
from resurgo.reports import ConvertReport, LoadReport, SaveReport
from resurgo.state.per_rank import PerRank
from resurgo.state.elastic_loader import elastic_state
from resurgo.state.elastic_sampler import ElasticSampler
from resurgo.state.train_state import TrainState

__all__ = [
    "__version__", "save", "async_save", "AsyncSaveHandle", "load", "load_dict", "read_manifest", "convert", "diff_checkpoints", "CheckpointDiff", "TrainState", "SaveReport", "LoadReport",
    "ConvertReport", "Shard", "FlatShard", "PerRank", "ShardingError", "WorldSizeMismatchError", "RankFailedError",
    "ElasticSampler", "elastic_state", "DataPositionError",
    "CheckpointManager", "Tier", "daly_interval",
    "ResurgoError", "CheckpointExistsError", "ForeignFilesError", "CheckpointReplacedError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "DTypeMismatchError", "IncompleteCheckpointError", "KeyMismatchError", "ManifestError",
    "NotACheckpointError", "PickleNotAllowedError", "ShapeMismatchError", "StorageError",
    "TypeMismatchError", "UnsupportedValueError", "MemoryBudgetError", "SaveInFlightError", "StudyError",
]
