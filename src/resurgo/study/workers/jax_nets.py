"""The study's ResNet-50 and VGG-16 in Flax (linen), layer for layer as ``resurgo.study.models``
defines them for PyTorch: the CIFAR-10 variants, with ``width`` channels in the first stage (64:
the published networks).

Imports flax and jax only (this runs in the jax environment). PyTorch's choices kept: a 3x3 stem
without max-pooling, bottleneck stages 3-4-6-3 with a projection shortcut where the shape
changes, no bias before a batch norm, a dense 10-class head on the global average;
batch-normalised VGG-16 (its convolutions keep their bias) with a (8 x width)-(8 x width)-10
classifier and dropout 0.5. Batch norm as PyTorch's defaults: epsilon 1e-5, running statistics
moved by 0.1 a step (Flax's ``momentum=0.9``); 3x3 convolutions pad one pixel on every side.
Parameters start from Flax's default initialisers. ``params`` equal PyTorch's ``parameters()``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["ResNet50", "VGG16", "NETWORKS", "DESCRIPTIONS"]

NUM_CLASSES = 10
VGG16_PLAN = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")


def _norm(train: bool) -> nn.BatchNorm:
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)


class Bottleneck(nn.Module):
    mid: int
    stride: int

    @nn.compact
    def __call__(self, x: Any, train: bool) -> Any:
        out_ch = self.mid * 4
        out = nn.relu(_norm(train)(nn.Conv(self.mid, (1, 1), use_bias=False)(x)))
        out = nn.relu(_norm(train)(nn.Conv(self.mid, (3, 3), self.stride, padding=1, use_bias=False)(out)))
        out = _norm(train)(nn.Conv(out_ch, (1, 1), use_bias=False)(out))
        if self.stride != 1 or x.shape[-1] != out_ch:
            x = _norm(train)(nn.Conv(out_ch, (1, 1), self.stride, padding=0, use_bias=False)(x))
        return nn.relu(out + x)


class ResNet50(nn.Module):
    width: int = 64

    @nn.compact
    def __call__(self, x: Any, train: bool) -> Any:
        x = nn.relu(_norm(train)(nn.Conv(self.width, (3, 3), padding=1, use_bias=False)(x)))
        for stage, blocks in enumerate((3, 4, 6, 3)):
            for i in range(blocks):
                x = Bottleneck(self.width * 2 ** stage, 2 if (i == 0 and stage > 0) else 1)(x, train)
        return nn.Dense(NUM_CLASSES)(jnp.mean(x, axis=(1, 2)))


class VGG16(nn.Module):
    width: int = 64

    @nn.compact
    def __call__(self, x: Any, train: bool) -> Any:
        for item in VGG16_PLAN:
            if item == "M":
                x = nn.max_pool(x, (2, 2), (2, 2))
            else:
                x = nn.relu(_norm(train)(nn.Conv(self.width * int(item), (3, 3), padding=1)(x)))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(8 * self.width)(nn.Dropout(0.5, deterministic=not train)(x)))
        return nn.Dense(NUM_CLASSES)(nn.Dropout(0.5, deterministic=not train)(x))


NETWORKS = {"resnet50": ResNet50, "vgg16": VGG16}
DESCRIPTIONS = {"resnet50": "Flax linen, the PyTorch CIFAR-10 variant layer for layer (3x3 stem, no max-pool)",
                "vgg16": "Flax linen, the PyTorch CIFAR-10 variant layer for layer (batch norm, 512-512-10 "
                         "classifier at width 64, dropout)"}
