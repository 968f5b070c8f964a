"""resurgo: checkpoint/restart for deep-learning training.

Public API (see README.md and docs/): ``save``, ``load``, ``load_dict``, ``TrainState``,
``ResurgoError`` and its subclasses, ``SaveReport``, ``LoadReport``.
"""

from resurgo.api import __version__, load, load_dict, read_manifest, save
from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DTypeMismatchError,
    IncompleteCheckpointError,
    KeyMismatchError,
    ManifestError,
    MemoryBudgetError,
    NotACheckpointError,
    PickleNotAllowedError,
    ResurgoError,
    SaveInFlightError,
    ShapeMismatchError,
    StorageError,
    TypeMismatchError,
    UnsupportedValueError,
)
from resurgo.pipeline.async_save import AsyncSaveHandle, async_save
from resurgo.reports import LoadReport, SaveReport
from resurgo.state.train_state import TrainState

__all__ = [
    "__version__", "save", "async_save", "AsyncSaveHandle", "load", "load_dict", "read_manifest", "TrainState", "SaveReport", "LoadReport",
    "ResurgoError", "CheckpointExistsError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "DTypeMismatchError", "IncompleteCheckpointError", "KeyMismatchError", "ManifestError",
    "NotACheckpointError", "PickleNotAllowedError", "ShapeMismatchError", "StorageError",
    "TypeMismatchError", "UnsupportedValueError", "MemoryBudgetError", "SaveInFlightError",
]
