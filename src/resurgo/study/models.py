"""The study's two networks, CIFAR-10 variants as in the founding paper: ResNet-50 and VGG-16.

This module owns their definitions (no torchvision dependency). Both take ``width``, the number
of channels of the first stage (64 in the published networks); the study's quick mode divides it
to fit a 2-core CPU while keeping every layer, so the state has the same structure (number of
tensors, BatchNorm buffers, optimizer slots) as the full-width network, only smaller tensors.

CIFAR-10 variants: 3x3 stem without max-pooling for ResNet (32x32 inputs would vanish otherwise),
batch-normalised VGG-16 with a small classifier head that keeps the classic dropout, so training
draws random numbers in the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from resurgo.errors import StudyError

__all__ = ["ResNet50", "VGG16", "MODELS", "build_model", "FULL_WIDTH"]

FULL_WIDTH = 64  # channels of the first stage in the published networks
NUM_CLASSES = 10


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, in_ch: int, mid_ch: int, stride: int) -> None:
        super().__init__()
        out_ch = mid_ch * self.expansion
        self.conv1 = nn.Conv2d(in_ch, mid_ch, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid_ch)
        self.conv2 = nn.Conv2d(mid_ch, mid_ch, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid_ch)
        self.conv3 = nn.Conv2d(mid_ch, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50 for 32x32 inputs: stages of 3, 4, 6, 3 bottleneck blocks (23.5 M parameters at
    width 64)."""

    blocks_per_stage = (3, 4, 6, 3)

    def __init__(self, width: int = FULL_WIDTH, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        layers: list[nn.Module] = []
        in_ch = width
        for stage, n_blocks in enumerate(self.blocks_per_stage):
            mid = width * 2 ** stage
            for i in range(n_blocks):
                layers.append(Bottleneck(in_ch, mid, stride=2 if (i == 0 and stage > 0) else 1))
                in_ch = mid * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


# 13 convolutions ('M' = 2x2 max-pooling), as multiples of the width: 64 128 256 512 512 at 64.
_VGG16_PLAN: tuple[int | str, ...] = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")


class VGG16(nn.Module):
    """VGG-16 with batch normalisation for 32x32 inputs; classifier 512-512-10 with dropout
    (15.0 M parameters at width 64)."""

    def __init__(self, width: int = FULL_WIDTH, num_classes: int = NUM_CLASSES, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for item in _VGG16_PLAN:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            assert isinstance(item, int)
            out_ch = width * item
            layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.BatchNorm2d(out_ch), nn.ReLU()]
            in_ch = out_ch
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(in_ch, in_ch), nn.ReLU(),
                                        nn.Dropout(dropout), nn.Linear(in_ch, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


MODELS: dict[str, Callable[[int], nn.Module]] = {"resnet50": ResNet50, "vgg16": VGG16}
LABELS = {"resnet50": "ResNet-50", "vgg16": "VGG-16"}


def build_model(name: str, width: int) -> nn.Module:
    """A fresh network by its study name (``resnet50`` or ``vgg16``)."""
    try:
        return MODELS[name](width)
    except KeyError:
        raise StudyError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}") from None
