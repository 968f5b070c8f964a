"""Saves forever (for kill tests): iteration i writes a state filled with i to `latest`
(overwrite=True) and to `step_i`; prints 'committed i' after each commit."""

import sys

import torch

import resurgo


def state_for(i: int) -> dict:
    return {
        "big": torch.full((3 << 20,), float(i)),  # 12 MiB: a save takes a while
        "small": torch.full((100,), i, dtype=torch.int64),
        "i": i,
    }


if __name__ == "__main__":
    root = sys.argv[1]
    i = 0
    while True:
        resurgo.save(state_for(i), f"{root}/latest", overwrite=True)
        resurgo.save(state_for(i), f"{root}/step_{i:06d}")
        print(f"committed {i}", flush=True)
        i += 1
