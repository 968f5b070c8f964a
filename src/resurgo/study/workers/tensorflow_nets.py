"""The study's ResNet-50 and VGG-16 in Keras (``tf.keras`` layers), layer for layer as
``resurgo.study.models`` defines them for PyTorch: the CIFAR-10 variants, with ``width``
channels in the first stage (64: the published networks).

Imports tensorflow only (this runs in the tensorflow environment). PyTorch's choices kept: a 3x3
stem without max-pooling, bottleneck stages 3-4-6-3 with a projection shortcut where the shape
changes, no bias before a batch norm, a dense 10-class head on the global average; batch-normalised
VGG-16 (its convolutions keep their bias) with a (8 x width)-(8 x width)-10 classifier and dropout
0.5. Batch norm as PyTorch's defaults: epsilon 1e-5, running statistics moved by 0.1 a step
(Keras's ``momentum=0.9``). A 3x3 convolution of stride 2 pads one pixel on every side first, as
PyTorch's ``padding=1`` does (Keras's ``"same"`` would pad only the bottom and right). Parameters
start from Keras's default initialisers. Trainable parameters equal PyTorch's ``parameters()``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["resnet50", "vgg16", "NETWORKS", "DESCRIPTIONS"]

layers = tf.keras.layers
NUM_CLASSES = 10
VGG16_PLAN = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")


def _norm(x: Any) -> Any:
    return layers.BatchNormalization(momentum=0.9, epsilon=1e-5)(x)


def _conv(x: Any, channels: int, size: int, stride: int = 1, bias: bool = False) -> Any:
    if size == 3:  # PyTorch's padding=1 on every side, whatever the stride
        x = layers.ZeroPadding2D(1)(x)
    return layers.Conv2D(channels, size, stride, padding="valid", use_bias=bias)(x)


def _bottleneck(x: Any, mid: int, stride: int) -> Any:
    out_ch = mid * 4
    out = layers.ReLU()(_norm(_conv(x, mid, 1)))
    out = layers.ReLU()(_norm(_conv(out, mid, 3, stride)))
    out = _norm(_conv(out, out_ch, 1))
    shortcut = x
    if stride != 1 or x.shape[-1] != out_ch:
        shortcut = _norm(_conv(x, out_ch, 1, stride))
    return layers.ReLU()(layers.Add()([out, shortcut]))


def resnet50(width: int = 64) -> Any:
    """ResNet-50 for 32x32x3 inputs; logits of 10 classes."""
    inputs = tf.keras.Input((32, 32, 3))
    x = layers.ReLU()(_norm(_conv(inputs, width, 3)))
    for stage, blocks in enumerate((3, 4, 6, 3)):
        for i in range(blocks):
            x = _bottleneck(x, width * 2 ** stage, 2 if (i == 0 and stage > 0) else 1)
    outputs = layers.Dense(NUM_CLASSES)(layers.GlobalAveragePooling2D()(x))
    return tf.keras.Model(inputs, outputs, name="resnet50")


def vgg16(width: int = 64) -> Any:
    """VGG-16 with batch norm for 32x32x3 inputs; logits of 10 classes."""
    inputs = x = tf.keras.Input((32, 32, 3))
    for item in VGG16_PLAN:
        if item == "M":
            x = layers.MaxPooling2D(2)(x)
        else:
            x = layers.ReLU()(_norm(_conv(x, width * int(item), 3, bias=True)))
    x = layers.Flatten()(x)
    x = layers.ReLU()(layers.Dense(8 * width)(layers.Dropout(0.5)(x)))
    outputs = layers.Dense(NUM_CLASSES)(layers.Dropout(0.5)(x))
    return tf.keras.Model(inputs, outputs, name="vgg16")


NETWORKS = {"resnet50": resnet50, "vgg16": vgg16}
DESCRIPTIONS = {"resnet50": "tf.keras layers, the PyTorch CIFAR-10 variant layer for layer (3x3 stem, no max-pool)",
                "vgg16": "tf.keras layers, the PyTorch CIFAR-10 variant layer for layer (batch norm, "
                         "512-512-10 classifier at width 64, dropout)"}
