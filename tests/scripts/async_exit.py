"""For test_async_save: start an asynchronous save and leave the interpreter at once.

argv: checkpoint path, then "ok" (the save must still commit) or "fail" (its error must be raised
at exit, not lost).
"""

import os
import sys

import torch

import resurgo
from resurgo.storage import local

path, mode = sys.argv[1], sys.argv[2]
if mode == "fail":
    def broken_fsync(fd):
        raise OSError(5, "Input/output error")

    local.os.fsync = broken_fsync  # type: ignore[attr-defined]
state = {"big": torch.arange(8 << 20, dtype=torch.float32), "step": 3}
resurgo.async_save(state, path)
print("returned", flush=True)
# falling off the end: the interpreter exits while the save is in flight
