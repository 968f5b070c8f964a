"""RNG state as plain data: Python ``random``, NumPy's global generator, torch CPU and CUDA.

This module owns capturing and restoring the process-global random number generators, so that a
restarted run draws exactly the same random streams (dropout masks, shuffles, augmentations) as the
run it continues. Each rank captures its own RNG; the state is per rank by nature.

The state is a tree of tensors, NumPy arrays and Python scalars whose structure and leaf shapes do
not depend on the values drawn so far, so a fresh process can offer destination tensors of the
right shape for the checkpoint to be read into (see :class:`RNGState`).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch
import xxhash

from resurgo.errors import TypeMismatchError
from resurgo.state.per_rank import PerRank
from resurgo.wording import plural

__all__ = ["RNGState", "capture_rng_state", "restore_rng_state"]

# Version tag of Python's Mersenne Twister state (random.getstate()[0]); other versions are
# rejected on restore rather than silently misread.
_PY_RANDOM_VERSION = 3


def _capture_python() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    # 624 words plus the position (<= 624): all fit in uint32. One array leaf instead of a
    # 625-element tuple keeps the checkpoint compact and the leaf shape fixed.
    return {
        "version": int(version),
        "state": np.asarray(internal, dtype=np.uint32),
        # gauss_next is None or a float; split in two so the leaf kinds never change.
        "has_gauss_next": gauss_next is not None,
        "gauss_next": float(gauss_next) if gauss_next is not None else 0.0,
    }


def _restore_python(sd: dict[str, Any]) -> None:
    version = int(sd["version"])
    if version != _PY_RANDOM_VERSION:
        raise TypeMismatchError(
            f"rng.python.version: expected Python random state version {_PY_RANDOM_VERSION}, got {version}"
        )
    internal = tuple(int(x) for x in np.asarray(sd["state"]).reshape(-1).tolist())
    if len(internal) != 625:
        raise TypeMismatchError(f"rng.python.state: expected 625 words, got {len(internal)}")
    gauss_next = float(sd["gauss_next"]) if bool(sd["has_gauss_next"]) else None
    random.setstate((version, internal, gauss_next))


def _capture_numpy() -> dict[str, Any]:
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "bit_generator": str(name),
        "keys": np.array(keys, dtype=np.uint32, copy=True),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _restore_numpy(sd: dict[str, Any]) -> None:
    np.random.set_state(
        (
            str(sd["bit_generator"]),
            np.asarray(sd["keys"], dtype=np.uint32),
            int(sd["pos"]),
            int(sd["has_gauss"]),
            float(sd["cached_gaussian"]),
        )
    )


def _capture_cuda() -> list[torch.Tensor]:
    # Only touch CUDA when it is available: get_rng_state_all() would initialise it otherwise.
    if torch.cuda.is_available():
        return [t.clone() for t in torch.cuda.get_rng_state_all()]
    return []


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if not states:
        return
    if not torch.cuda.is_available():
        # Saved on a GPU machine, restored on one without: there is no CUDA stream to reproduce.
        return
    n = torch.cuda.device_count()
    # Restore the devices both sides have; a different device count cannot be bit-exact anyway.
    for i, st in enumerate(list(states)[:n]):
        torch.cuda.set_rng_state(st.to(device="cpu", dtype=torch.uint8), i)


def capture_rng_state() -> dict[str, Any]:
    """Return every process-global RNG state of this process as a plain tree."""
    return {
        "python": _capture_python(),
        "numpy": _capture_numpy(),
        # get_rng_state() returns a copy, so later draws never alter a captured state.
        "torch": torch.get_rng_state(),
        "cuda": _capture_cuda(),
    }


def restore_rng_state(sd: dict[str, Any]) -> None:
    """Set every process-global RNG from a tree made by :func:`capture_rng_state`.

    Parts missing from ``sd`` are left alone (a checkpoint from a run that did not track them).
    """
    if "python" in sd:
        _restore_python(sd["python"])
    if "numpy" in sd:
        _restore_numpy(sd["numpy"])
    if "torch" in sd:
        t = sd["torch"]
        if not isinstance(t, torch.Tensor):
            t = torch.as_tensor(np.asarray(t), dtype=torch.uint8)
        torch.set_rng_state(t.to(device="cpu", dtype=torch.uint8).contiguous())
    if "cuda" in sd:
        _restore_cuda(sd["cuda"])


def carry_over_rng(saved: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
    """The RNG state of ``rank`` in a job of ``world`` ranks resumed from ``len(saved)`` ranks.

    Ranks that existed keep their own stream. A new rank gets fresh Python, NumPy and torch CPU
    streams seeded from the xxh64 of (the saved torch state of rank ``rank % len(saved)``, rank),
    so they are deterministic, differ between ranks, and never repeat a saved stream. CUDA states
    of new ranks are left as the process has them. When the job shrinks, the streams of ranks
    ``world..len(saved)-1`` are not used (rank 0 warns).
    """
    if rank == 0 and world < len(saved):
        warnings.warn(f"resurgo: resuming {len(saved)} ranks' RNG states on {plural(world, 'rank')}: "
                      f"the streams of ranks {world}..{len(saved) - 1} are not used", stacklevel=2)
    if rank < len(saved):
        return saved[rank]
    base = saved[rank % len(saved)].get("torch")
    h = xxhash.xxh64(np.asarray(base, dtype=np.uint8).tobytes() if base is not None else b"")
    h.update(rank.to_bytes(8, "little"))
    seed = h.intdigest()
    kept = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        random.seed(seed)
        np.random.seed(seed % (1 << 32))
        torch.manual_seed(seed % (1 << 63))
        derived = {"python": _capture_python(), "numpy": _capture_numpy(), "torch": torch.get_rng_state()}
    finally:
        random.setstate(kept[0])
        np.random.set_state(kept[1])
        torch.set_rng_state(kept[2])
    return derived


class RNGState:
    """Stateful view of the process-global RNGs (Python, NumPy, torch CPU, CUDA).

    ``state_dict()`` captures them now, as a :class:`~resurgo.PerRank` value (every rank's streams
    are its own); ``load_state_dict(sd)`` sets them, on another number of ranks through
    :func:`carry_over_rng`. Restoring makes the following draws identical to those that followed
    the capture. Put it last in restore order: anything restored after it that draws random
    numbers would shift the streams.
    """

    def state_dict(self) -> PerRank:
        return PerRank(capture_rng_state(), on_resize=carry_over_rng)

    def load_state_dict(self, state_dict: Any) -> None:
        restore_rng_state(state_dict.value if isinstance(state_dict, PerRank) else state_dict)

    def __repr__(self) -> str:
        return "RNGState()"
