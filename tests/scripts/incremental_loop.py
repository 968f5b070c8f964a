"""Child of tests/test_incremental_faults.py: incremental saves, retention and gc in a loop until
killed. The state at step s is a pure function of s (:func:`state_at`), so the parent can check
every committed checkpoint bit for bit."""

from __future__ import annotations

import sys

import torch

import resurgo
from resurgo.manager import FullEvery
from resurgo.manager.gc import run_gc

ROWS, WIDTH = 2048, 128


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {"emb": torch.randn(ROWS, WIDTH, generator=g), "frozen": torch.randn(256, 1024, generator=g),
             "step": step}
    for i in range(1, step + 1):
        state["emb"][(i * 8) % ROWS] += float(i)
    return state


def main(root: str) -> None:
    state = state_at(0)
    with resurgo.CheckpointManager(root, keep_last=2, incremental=FullEvery(4), async_save=False) as m:
        step = m.restore(state) or 0
        while True:
            step += 1
            state["emb"][(step * 8) % ROWS] += float(step)
            state["step"] = step
            m.save(state, step)
            print(f"SAVED {step}", flush=True)
            if step % 3 == 0:
                run_gc(root, keep_last=1, stale_after=0)


if __name__ == "__main__":
    main(sys.argv[1])
