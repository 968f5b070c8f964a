"""TensorFlow for the study's driver: ``tf.train.Checkpoint`` + ``tf.train.CheckpointManager``,
as TensorFlow's checkpoint guide writes it (the checkpoint tracks the step, the optimizer, the
network and the ``tf.data`` iterator), training the study's ResNet-50 and VGG-16
(``tensorflow_nets``: PyTorch's CIFAR-10 definitions in ``tf.keras`` layers).

Imports the standard library, numpy and tensorflow only (this runs in the tensorflow
environment). Data: synthetic CIFAR-10-shaped images in a ``tf.data`` pipeline (shuffle, random
crop + flip with stateless ops seeded from ``Dataset.random``, as the augmentation guide does, so
the iterator can be checkpointed); a ``tf.function`` training step; SGD with momentum and weight
decay. Keras's dropout layers draw their masks from a ``SeedGenerator`` whose state variable is no
trackable of the network: the checkpoint neither saves nor restores it, so a restart of VGG-16
draws other masks. Keras's own ImageNet networks (``keras.applications``, ``weights=None``,
32x32x3 input, 10 classes) are built only to count their parameters, for the report's extra row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from tensorflow_nets import DESCRIPTIONS, NETWORKS

MECHANISM = "tf_checkpoint_manager"
LABEL = "TensorFlow tf.train.CheckpointManager"
FORMAT = "TensorFlow checkpoint (.index + .data shards, protobuf)"
STORES = {"weights": True, "optimizer": True, "rng": False, "data_position": True}
EXECUTES_CODE = "no"
EXECUTES_CODE_NOTE = ("tf.train.Checkpoint.restore reads tensors and a protobuf object graph into existing "
                      "objects; it builds nothing from the file")
FSYNC = False
LR, MOMENTUM, WEIGHT_DECAY, PAD = 0.01, 0.9, 5e-4, 4


def versions() -> dict[str, str]:
    return {"tensorflow": tf.__version__, "keras": tf.keras.__version__, "numpy": np.__version__}


def setup(threads: int) -> None:
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def describe(model: str) -> str:
    return DESCRIPTIONS[model]


def stock(model: str) -> Optional[dict[str, Any]]:
    """Keras's own network of that name (``keras.applications``, ``weights=None``, 32x32x3, 10
    classes): its definition and trainable parameter count (built, not trained)."""
    if model == "resnet50":
        net = tf.keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        definition = "keras.applications.ResNet50 (ImageNet stem: 7x7 conv, max-pool), 10 classes"
    else:
        net = tf.keras.applications.VGG16(weights=None, input_shape=(32, 32, 3), classes=10)
        definition = "keras.applications.VGG16 (no batch norm, classifier 4096-4096-10, no dropout)"
    count = int(sum(np.prod(v.shape) for v in net.trainable_variables))
    tf.keras.backend.clear_session()
    return {"definition": definition, "parameters": count}


def _augment(pair: Any, seed: Any) -> Any:
    x, y = pair
    x = tf.image.resize_with_crop_or_pad(x, 32 + 2 * PAD, 32 + 2 * PAD)
    x = tf.image.stateless_random_crop(x, (32, 32, 3), seed=seed)
    return tf.image.stateless_random_flip_left_right(x, seed=seed), y


class Job:
    def __init__(self, model: str, config: dict) -> None:
        seed = config["seed"]
        tf.keras.utils.set_random_seed(seed)  # python, numpy and tensorflow
        rng = np.random.RandomState(seed)
        images = rng.standard_normal((config["samples"], 32, 32, 3)).astype(np.float32)
        labels = rng.randint(0, 10, config["samples"]).astype(np.int32)
        self.net = NETWORKS[model](config["width"])
        self.optimizer = tf.keras.optimizers.SGD(LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        self.optimizer.build(self.net.trainable_variables)  # its slots exist before a restore fills them
        pairs = tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(config["samples"], seed=seed)
        seeds = tf.data.Dataset.random(seed=seed).batch(2)
        data = tf.data.Dataset.zip((pairs, seeds)).map(_augment).batch(config["batch_size"], drop_remainder=True)
        self.iterator = iter(data.repeat())
        self.step = tf.Variable(0, dtype=tf.int64)
        self.checkpoint = tf.train.Checkpoint(step=self.step, optimizer=self.optimizer, net=self.net,
                                              iterator=self.iterator)
        net, optimizer = self.net, self.optimizer

        @tf.function
        def train_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = net(x, training=True)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
            grads = tape.gradient(loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))
            return loss

        self.train_step = train_step


def build(model: str, config: dict) -> Job:
    return Job(model, config)


def train(job: Job, steps: int, on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(job.iterator)
        losses.append(float(job.train_step(x, y)))
        job.step.assign_add(1)
        if on_step is not None:
            on_step(int(job.step))
    return losses


def set_step(job: Job, step: int) -> None:
    job.step.assign(step)


def parameters(job: Job) -> int:
    return int(sum(np.prod(v.shape) for v in job.net.trainable_variables))


def _bytes(variables: Any) -> int:
    return int(sum(np.asarray(v).nbytes for v in variables))


def state_bytes(job: Job) -> tuple[int, int]:
    """Bytes of the network's variables that the checkpoint holds (weights and BatchNorm statistics;
    not the dropout seed generators' state) and of the optimizer's."""
    stored = [v for v in job.net.variables if "seed_generator" not in v.path]
    return _bytes(stored), _bytes(job.optimizer.variables)


def disturb_rng() -> None:
    tf.keras.utils.set_random_seed(987654321)
    np.random.rand(1000)


class Checkpointer:
    """A CheckpointManager over the job's checkpoint in ``directory``, keeping the last three."""

    def __init__(self, directory: Path) -> None:
        self.directory = str(directory)
        self.manager: Any = None

    def _manager(self, job: Job) -> Any:
        if self.manager is None:
            os.makedirs(self.directory, exist_ok=True)
            self.manager = tf.train.CheckpointManager(job.checkpoint, self.directory, max_to_keep=3)
        return self.manager

    def save(self, job: Job, step: int) -> None:
        self._manager(job).save(checkpoint_number=step)

    def wait(self) -> None:
        pass

    def load(self, job: Job) -> Optional[int]:
        job.checkpoint.restore(self._manager(job).latest_checkpoint).assert_consumed()
        return int(job.step)

    def close(self) -> None:
        pass
