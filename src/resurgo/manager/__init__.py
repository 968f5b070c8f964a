"""The checkpoint manager: save policies, retention, restore, tiers, preemption (``manager.py``
orchestrates; its docstring lists the module of each concern).

``CheckpointManager``, ``Tier``, ``MemoryTier`` and ``daly_interval`` are also exported by the ``resurgo`` package.
"""

from resurgo.manager.daly import daly_interval
from resurgo.manager.full_policy import FullEvery, FullSavePolicy, IncrementalContext
from resurgo.manager.config import MTBF_ENV
from resurgo.manager.manager import CheckpointManager
from resurgo.manager.memory import MemoryTier
from resurgo.manager.policies import (
    AllOf,
    AnyOf,
    AtSteps,
    DalyInterval,
    EveryNSteps,
    EverySeconds,
    OnPreemption,
    SaveContext,
    SavePolicy,
)
from resurgo.manager.retention import KeepAny, KeepBest, KeepEvery, KeepLast, Kept, RetentionPolicy, steps_to_delete
from resurgo.manager.tiers import Tier

__all__ = [
    "CheckpointManager", "Tier", "MemoryTier", "daly_interval", "MTBF_ENV",
    "SavePolicy", "SaveContext", "EveryNSteps", "EverySeconds", "AtSteps", "OnPreemption", "DalyInterval",
    "AnyOf", "AllOf", "FullSavePolicy", "FullEvery", "IncrementalContext",
    "RetentionPolicy", "Kept", "KeepLast", "KeepEvery", "KeepBest", "KeepAny", "steps_to_delete",
]
