"""The study's training data: CIFAR-10-shaped tensors, synthetic by default, the real data set
when the user points ``--data`` at a local copy of its python batches.

This module owns producing ``(images, labels)`` and the training-time augmentation. Synthetic
data are made from a fixed seed (no download, no network). Real data: the directory must hold
``data_batch_1`` ... ``data_batch_5`` of "CIFAR-10 python version" (from
https://www.cs.toronto.edu/~kriz/cifar.html, unpacked: ``cifar-10-batches-py/``); the directory
itself or its ``cifar-10-batches-py`` subdirectory is accepted. Those files are pickles, so they
are read with an unpickler that accepts only the numpy array constructors the files need:
a tampered file fails to load instead of running code.

Augmentation (random crop with 4 pixels of zero padding, random horizontal flip) draws from the
global torch RNG inside ``__getitem__``, as torchvision transforms do; with a shuffled
DataLoader and dropout, training consumes random numbers the way real pipelines do, which is
what the determinism experiment needs.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from resurgo.errors import StudyError

__all__ = ["CIFARLike", "synthetic_cifar10", "load_cifar10", "make_dataset"]

CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
# per-channel mean and std of the CIFAR-10 training set, to normalise the real images
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
PAD = 4


class CIFARLike(Dataset):
    """3x32x32 float images and int64 labels in memory, with random crop + flip on access."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, augment: bool = True) -> None:
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, 32, 32) or len(images) != len(labels):
            raise StudyError(f"CIFAR-10-shaped data needs images of shape (N, 3, 32, 32) and N labels; "
                             f"got {tuple(images.shape)} and {tuple(labels.shape)}")
        self.images = images
        self.labels = labels
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i]
        if self.augment:
            dy, dx = (int(v) for v in torch.randint(0, 2 * PAD + 1, (2,)))
            x = _pad(x)[:, dy:dy + 32, dx:dx + 32]
            if torch.rand(()) < 0.5:
                x = x.flip(-1)
        return x, self.labels[i]


def _pad(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (PAD, PAD, PAD, PAD))


def synthetic_cifar10(n: int, seed: int = 0) -> CIFARLike:
    """``n`` images of standard-normal noise with labels in 0..9, a function of ``seed`` only."""
    g = torch.Generator().manual_seed(seed)
    return CIFARLike(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Resolves only the globals a CIFAR-10 python batch uses (numpy arrays); nothing else."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("_codecs", "encode"),  # how Python 3's protocol 2 stores bytes (array data); runs nothing
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a CIFAR-10 batch holds only "
                                         f"numpy arrays, lists and bytes")
        return super().find_class(module, name)


def _batch_dir(root: Path) -> Path:
    for d in (root, root / "cifar-10-batches-py"):
        if all((d / name).is_file() for name in CIFAR_BATCHES):
            return d
    raise StudyError(f"{root}: no CIFAR-10 python batches found; expected {', '.join(CIFAR_BATCHES)} in "
                     f"{root} or {root / 'cifar-10-batches-py'}")


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _ArraysOnlyUnpickler(f, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as e:
        raise StudyError(f"{path}: not a CIFAR-10 python batch (expected a dict with b'data' and "
                         f"b'labels'): {e}") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise StudyError(f"{path}: expected b'data' of shape (N, 3072) and N labels, got {data.shape} "
                         f"and {labels.shape}")
    return data, labels


def load_cifar10(root: str | Path, n: int | None = None) -> CIFARLike:
    """The first ``n`` (all if None) training images of a local CIFAR-10 copy, normalised."""
    d = _batch_dir(Path(root))
    images, labels = [], []
    have = 0
    for name in CIFAR_BATCHES:
        data, lab = _read_batch(d / name)
        images.append(data)
        labels.append(lab)
        have += len(lab)
        if n is not None and have >= n:
            break
    x = torch.from_numpy(np.concatenate(images)[:n]).reshape(-1, 3, 32, 32).float().div_(255)
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return CIFARLike((x - mean) / std, torch.from_numpy(np.concatenate(labels)[:n]))


def make_dataset(n: int, data_dir: str | Path | None, seed: int = 0) -> CIFARLike:
    """The real data set from ``data_dir`` when given, else synthetic data of ``n`` images."""
    return synthetic_cifar10(n, seed) if data_dir is None else load_cifar10(data_dir, n)
