"""Chainer for the study's driver: ``serializers.save_npz`` of the model and of the optimizer,
written as Chainer users write a training loop, training the study's ResNet-50 and VGG-16
(``chainer_nets``: PyTorch's CIFAR-10 definitions, layer for layer).

Imports the standard library, numpy and chainer only (this runs in the chainer environment).
Chainer's own ImageNet networks (``chainer.links.ResNet50Layers`` / ``VGG16Layers``,
``pretrained_model=None``, fitted to CIFAR-10 as users fine-tune them: the last classifier layer
replaced by a 10-class one and, for VGG-16, ``fc6`` by one that takes the 512x1x1 features a
32x32 image leaves after five poolings) are built only to count their parameters, for the
report's extra row. Data: synthetic CIFAR-10-shaped images, random crop + flip drawn from numpy's
global RNG (as a ``TransformDataset`` does), shuffled by a ``SerialIterator``; VGG-16 uses dropout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import chainer
import chainer.functions as F
import chainer.links as L
import numpy as np
from chainer import serializers

from chainer_nets import DESCRIPTIONS, NETWORKS

MECHANISM = "chainer_save_npz"
LABEL = "Chainer serializers.save_npz"
FORMAT = "NumPy .npz (zip of .npy arrays, compressed: save_npz's default)"
STORES = {"weights": True, "optimizer": True, "rng": False, "data_position": False}
EXECUTES_CODE = "yes"
EXECUTES_CODE_NOTE = ("load_npz opens the file with numpy.load(allow_pickle=True): an object array stored under a "
                      "parameter's key is unpickled, which can run code")
FSYNC = False
LR, MOMENTUM, WEIGHT_DECAY, PAD = 0.01, 0.9, 5e-4, 4


def versions() -> dict[str, str]:
    return {"chainer": chainer.__version__, "numpy": np.__version__}


def setup(threads: int) -> None:
    """Chainer runs on numpy; its BLAS threads are set by the environment the study passes."""


def describe(model: str) -> str:
    return DESCRIPTIONS[model]


class Stock(chainer.Chain):
    """Chainer's ImageNet network with the CIFAR-10 head (counted, not trained)."""

    def __init__(self, model: str) -> None:
        super().__init__()
        with self.init_scope():
            if model == "resnet50":
                self.base = L.ResNet50Layers(pretrained_model=None)
                del self.base.fc6  # a link is replaced by deleting it, then registering the new one
                with self.base.init_scope():
                    self.base.fc6 = L.Linear(2048, 10)
                self.out = "fc6"
            else:
                self.base = L.VGG16Layers(pretrained_model=None)
                del self.base.fc6, self.base.fc8
                with self.base.init_scope():
                    self.base.fc6 = L.Linear(512, 4096)
                    self.base.fc8 = L.Linear(4096, 10)
                self.out = "fc8"


def stock(model: str) -> Optional[dict[str, Any]]:
    """Chainer's own network of that name, as users fit it to CIFAR-10: its definition and
    parameter count (built, not trained)."""
    definition = ("chainer.links.ResNet50Layers (ImageNet stem: 7x7 conv, max-pool), fc6 replaced by 2048->10"
                  if model == "resnet50" else
                  "chainer.links.VGG16Layers (no batch norm), fc6 replaced by 512->4096, fc8 by 4096->10")
    return {"definition": definition, "parameters": int(sum(p.size for p in Stock(model).params()))}


def _augment(pair: tuple) -> tuple:
    x, y = pair
    dy, dx = np.random.randint(0, 2 * PAD + 1, size=2)
    x = np.pad(x, ((0, 0), (PAD, PAD), (PAD, PAD)))[:, dy:dy + 32, dx:dx + 32]
    if np.random.rand() < 0.5:
        x = x[:, :, ::-1]
    return np.ascontiguousarray(x), y


class Job:
    def __init__(self, model: str, config: dict) -> None:
        seed = config["seed"]
        np.random.seed(seed)
        rng = np.random.RandomState(seed)
        images = rng.standard_normal((config["samples"], 3, 32, 32)).astype(np.float32)
        labels = rng.randint(0, 10, config["samples"]).astype(np.int32)
        self.net = NETWORKS[model](config["width"])
        self.classifier = L.Classifier(self.net)
        self.optimizer = chainer.optimizers.MomentumSGD(lr=LR, momentum=MOMENTUM)
        self.optimizer.setup(self.classifier)
        self.optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(WEIGHT_DECAY))
        data = chainer.datasets.TransformDataset(chainer.datasets.TupleDataset(images, labels), _augment)
        self.iterator = chainer.iterators.SerialIterator(data, config["batch_size"], repeat=True, shuffle=True)
        self.step = 0


def build(model: str, config: dict) -> Job:
    return Job(model, config)


def train(job: Job, steps: int, on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = chainer.dataset.concat_examples(job.iterator.next())
        loss = job.classifier(x, y)
        job.classifier.cleargrads()
        loss.backward()
        job.optimizer.update()
        job.step += 1
        losses.append(float(loss.array))
        if on_step is not None:
            on_step(job.step)
    return losses


def set_step(job: Job, step: int) -> None:
    job.step = step


def parameters(job: Job) -> int:
    return int(sum(p.size for p in job.net.params()))


def state_bytes(job: Job) -> tuple[int, int]:
    """Bytes of what save_npz writes of the model (parameters and BatchNorm statistics) and of
    the optimizer (momentum per parameter, update counters)."""
    model = serializers.DictionarySerializer()
    model.save(job.classifier)
    optim = serializers.DictionarySerializer()
    optim.save(job.optimizer)
    size = lambda t: sum(np.asarray(v).nbytes for v in t.values())  # noqa: E731
    return size(model.target), size(optim.target)


def disturb_rng() -> None:
    np.random.seed(987654321)
    np.random.rand(1000)


class Checkpointer:
    """``save_npz`` of the model and of the optimizer into one directory per checkpoint."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def save(self, job: Job, step: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        serializers.save_npz(str(self.directory / "model.npz"), job.classifier)
        serializers.save_npz(str(self.directory / "optimizer.npz"), job.optimizer)

    def wait(self) -> None:
        pass

    def load(self, job: Job) -> Optional[int]:
        serializers.load_npz(str(self.directory / "model.npz"), job.classifier)
        serializers.load_npz(str(self.directory / "optimizer.npz"), job.optimizer)
        return None  # the step is not stored: users know it from the file name

    def close(self) -> None:
        pass
