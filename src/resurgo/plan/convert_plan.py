"""Conversion plan: which output file each tensor goes into, and which tensors are read together.

Pure data, no I/O. :func:`plan_shards` splits tensors into Hugging Face shards the way
``huggingface_hub.split_torch_state_dict_into_shards`` does (greedy, in order, a tensor larger
than the limit alone in its shard) and :func:`shard_file_names` names them as ``transformers``
does. :func:`plan_batches` groups consecutive tensors so that the bytes held in memory at once
stay within a budget (the same rule); a tensor that alone exceeds it is read window by window.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

HF_SINGLE_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
_HF_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into shards, in order: a shard's tensor bytes stay within ``max_shard_bytes``
    unless it holds one tensor larger than that. Like huggingface_hub, no bin packing: a new
    shard starts when the next tensor would not fit."""
    if max_shard_bytes <= 0:
        raise ValueError(f"the limit must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for key, nbytes in sizes:
        if nbytes > max_shard_bytes:  # alone in its own shard
            if current:
                shards.append(current)
                current, current_bytes = [], 0
            shards.append([key])
            continue
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(key)
        current_bytes += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors`` ..."""
    if count == 1:
        return [HF_SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def is_hf_output_file(name: str) -> bool:
    """True for the names a conversion to ``hf`` writes (what an overwrite may replace)."""
    return name in (HF_SINGLE_FILE, HF_INDEX_FILE) or _HF_SHARD.fullmatch(name) is not None


@dataclass(frozen=True)
class Batch:
    """Tensors read together: their bytes (``nbytes``) are held in memory at once. ``windowed``:
    one tensor whose reading costs more than the budget, read a window at a time."""

    keys: tuple[str, ...]
    nbytes: int
    windowed: bool = False


def plan_batches(tensors: Sequence[tuple[str, int, int]], budget: int) -> list[Batch]:
    """Consecutive tensors ``(key, nbytes, cost)`` grouped, in order, into batches that cost at
    most ``budget`` (the shards' rule); a tensor costing more is a windowed batch of its own.
    ``cost`` is the memory reading the tensor needs: its bytes, plus the reader's scratch when its
    chunks do not land straight in it."""
    info = {key: (nbytes, cost) for key, nbytes, cost in tensors}
    batches = []
    for keys in plan_shards([(key, cost) for key, _, cost in tensors], budget):
        if keys:
            cost = sum(info[k][1] for k in keys)
            batches.append(Batch(tuple(keys), sum(info[k][0] for k in keys), windowed=cost > budget))
    return batches
