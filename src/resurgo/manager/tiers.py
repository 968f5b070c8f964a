"""Storage tiers of a CheckpointManager: a fast tier that takes every save, durable tiers that get
copies of selected checkpoints in the background, verified there.

SCR and VeloC save often to node-local storage and less often to a parallel filesystem; Gemini
and Orbax's emergency checkpointing keep recent checkpoints in memory or on local disk. Here the
first tier (local disk, ``/dev/shm``) takes every save and keeps few; each later tier (any URL)
receives copies of the steps it selects and keeps more. Restore takes the newest checkpoint that
verifies in any tier, so losing the fast tier (node replaced, directory deleted) costs only the
steps since the last durable copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from resurgo.renamed import renamed_keywords


@renamed_keywords("Tier", every_steps="copy_every_steps")
@dataclass(frozen=True)
class Tier:
    """One storage tier: a root (a directory or a URL), how many checkpoints it keeps, and, for a
    durable tier, which of the manager's checkpoints are copied to it (the steps that are multiples
    of ``copy_every_steps``; None: every checkpoint). When the manager saves is its own
    ``every_steps=``. The old name ``Tier(every_steps=)`` still works, with a DeprecationWarning.

    ``keep_last`` is this tier's own rule, the first tier's included: the first tier keeps its
    ``keep_last`` newest checkpoints and whatever the manager's other retention rules
    (``keep_every=``, ``keep_best=``, ``retention=``) keep. The manager's ``keep_last=`` would
    say the first tier's rule a second time: giving both raises UnsupportedValueError."""

    root: str | os.PathLike
    keep_last: int | None = None
    copy_every_steps: int | None = None
    storage_options: dict | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "copy_every_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Tier({self.root!r}): {name} must be an int >= 1 or None, not {value!r}")

    def selects(self, step: int) -> bool:
        return self.copy_every_steps is None or step % self.copy_every_steps == 0
