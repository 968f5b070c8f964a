"""The study's ResNet-50 and VGG-16 in Chainer (``chainer.links``), layer for layer as
``resurgo.study.models`` defines them for PyTorch: the CIFAR-10 variants, with ``width``
channels in the first stage (64: the published networks).

Imports chainer only (this runs in the chainer environment). PyTorch's choices kept: a 3x3 stem
without max-pooling, bottleneck stages 3-4-6-3 with a projection shortcut where the shape
changes, no bias before a batch norm, a linear 10-class head on the global average;
batch-normalised VGG-16 (its convolutions keep their bias) with a (8 x width)-(8 x width)-10
classifier and dropout 0.5. Batch norm as PyTorch's defaults: epsilon 1e-5, running statistics
moved by 0.1 a step (Chainer's ``decay=0.9``); 3x3 convolutions pad one pixel on every side.
Parameters start from Chainer's default initialisers. ``params()`` equal PyTorch's
``parameters()``.
"""

from __future__ import annotations

from typing import Any

import chainer
import chainer.functions as F
import chainer.links as L

__all__ = ["ResNet50", "VGG16", "NETWORKS", "DESCRIPTIONS"]

NUM_CLASSES = 10
VGG16_PLAN = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")


def _norm(channels: int) -> L.BatchNormalization:
    return L.BatchNormalization(channels, decay=0.9, eps=1e-5)


class ConvNorm(chainer.Chain):
    """A convolution followed by its batch norm."""

    def __init__(self, in_ch: int, out_ch: int, size: int, stride: int = 1, bias: bool = False) -> None:
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(in_ch, out_ch, size, stride, size // 2, nobias=not bias)
            self.bn = _norm(out_ch)

    def forward(self, x: Any) -> Any:
        return self.bn(self.conv(x))


class Bottleneck(chainer.Chain):
    def __init__(self, in_ch: int, mid: int, stride: int) -> None:
        super().__init__()
        out_ch = mid * 4
        with self.init_scope():
            self.a = ConvNorm(in_ch, mid, 1)
            self.b = ConvNorm(mid, mid, 3, stride)
            self.c = ConvNorm(mid, out_ch, 1)
            self.shortcut = ConvNorm(in_ch, out_ch, 1, stride) if (stride != 1 or in_ch != out_ch) else None

    def forward(self, x: Any) -> Any:
        out = self.c(F.relu(self.b(F.relu(self.a(x)))))
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNet50(chainer.Chain):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        blocks = []
        in_ch = width
        for stage, n in enumerate((3, 4, 6, 3)):
            for i in range(n):
                blocks.append(Bottleneck(in_ch, width * 2 ** stage, 2 if (i == 0 and stage > 0) else 1))
                in_ch = width * 2 ** stage * 4
        with self.init_scope():
            self.stem = ConvNorm(3, width, 3)
            self.blocks = chainer.ChainList(*blocks)
            self.head = L.Linear(in_ch, NUM_CLASSES)

    def forward(self, x: Any) -> Any:
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(F.mean(x, axis=(2, 3)))


class VGG16(chainer.Chain):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        convs = []
        in_ch = 3
        for item in VGG16_PLAN:
            if item != "M":
                convs.append(ConvNorm(in_ch, width * int(item), 3, bias=True))
                in_ch = width * int(item)
        with self.init_scope():
            self.features = chainer.ChainList(*convs)
            self.fc1 = L.Linear(in_ch, in_ch)
            self.fc2 = L.Linear(in_ch, NUM_CLASSES)

    def forward(self, x: Any) -> Any:
        convs = iter(self.features)
        for item in VGG16_PLAN:
            x = F.max_pooling_2d(x, 2, 2) if item == "M" else F.relu(next(convs)(x))
        x = F.reshape(x, (x.shape[0], -1))
        x = F.relu(self.fc1(F.dropout(x, 0.5)))
        return self.fc2(F.dropout(x, 0.5))


NETWORKS = {"resnet50": ResNet50, "vgg16": VGG16}
DESCRIPTIONS = {"resnet50": "chainer.links, the PyTorch CIFAR-10 variant layer for layer (3x3 stem, no max-pool)",
                "vgg16": "chainer.links, the PyTorch CIFAR-10 variant layer for layer (batch norm, 512-512-10 "
                         "classifier at width 64, dropout)"}
