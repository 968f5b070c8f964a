"""Disk-full scenario for tests/test_manager_faults.py, run on a real 8 MiB tmpfs or in-process.

``scenario(root, fill, free)``: a CheckpointManager saves steps 1 and 2 (1.5 MiB each), ``fill()``
leaves only 512 KiB free, saving step 3 must fail; ``free()`` gives the space back and saving
step 3 again must succeed. Returns what happened as plain data for the test to check.

Run as a script (``python disk_full.py DIR``, DIR on a small tmpfs, see the test) it fills the
filesystem with a real file and prints the results of the synchronous and asynchronous variants
as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import bits_equal  # noqa: E402

import resurgo  # noqa: E402
from resurgo.manager import CheckpointManager  # noqa: E402
from resurgo.pipeline.verify import verify_checkpoint  # noqa: E402

LEFT_FREE = 512 << 10


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(384, 1024, generator=g), "step": step}  # 1.5 MiB


def scenario(root: Path, fill: Callable[[], None], free: Callable[[], None], async_save: bool) -> dict:
    out: dict = {}
    with CheckpointManager(root, async_save=async_save) as mgr:
        for s in (1, 2):
            mgr.save(state_at(s), s)
        mgr.wait()
        fill()
        try:
            mgr.save(state_at(3), 3)
            mgr.wait()  # an asynchronous save's error is raised here
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["error"] = {"type": type(e).__name__, "is_resurgo_error": isinstance(e, resurgo.ResurgoError),
                            "errno": getattr(e, "errno", None), "message": str(e)}
        out["after_failure"] = sorted(p.name for p in root.iterdir())
        out["older_intact"] = {s: verify_checkpoint(mgr.path_for(s)).ok and bits_equal(
            resurgo.load_dict(mgr.path_for(s)), state_at(s)) for s in (1, 2)}
        free()
        mgr.save(state_at(3), 3)
        mgr.wait()
        out["after_retry"] = sorted(p.name for p in root.iterdir())
        out["retry_exact"] = bits_equal(resurgo.load_dict(mgr.path_for(3)), state_at(3))
    return out


def main(mount: Path) -> int:
    filler = mount / "filler"

    def fill() -> None:
        st = os.statvfs(mount)
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - LEFT_FREE))

    def free() -> None:
        filler.unlink()

    results = {}
    for mode in ("sync", "async"):
        results[mode] = scenario(mount / mode, fill, free, async_save=(mode == "async"))
        shutil.rmtree(mount / mode)  # the next variant starts on an empty filesystem
    print(json.dumps({"fs_bytes": os.statvfs(mount).f_blocks * os.statvfs(mount).f_frsize, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
