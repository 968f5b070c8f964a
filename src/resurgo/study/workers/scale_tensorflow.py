"""TensorFlow in the scale experiment: ``tf.distribute.MultiWorkerMirroredStrategy``, one process
per worker, the cluster read from ``TF_CONFIG`` (loopback addresses set by the launcher).

Imports the standard library, numpy and tensorflow only. The job is ``tensorflow_worker``'s,
built inside the strategy's scope (its variables are mirrored; their initial values are worker
0's) with a seed per worker, so that each worker draws its own batches from its own ``tf.data``
pipeline. A step runs the same loss on each worker's batch under ``strategy.run``, scaled to the
global batch (``tf.nn.compute_average_loss``); the optimizer all-reduces the gradients. Saving
follows TensorFlow's multi-worker guide: every worker saves (the save reads mirrored variables
collectively), the chief into the checkpoint directory, the others into temporary directories
that are removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import tensorflow as tf

import tensorflow_worker as base

MECHANISM, LABEL = base.MECHANISM, base.LABEL


def versions() -> dict[str, str]:
    return base.versions()


class Dist:
    def __init__(self) -> None:
        task = json.loads(os.environ["TF_CONFIG"])
        self.rank = int(task["task"]["index"])
        self.world = len(task["cluster"]["worker"])
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def barrier(self) -> None:
        # a collective all-reduce of one value: every worker returns once all have reached it
        self.strategy.reduce(tf.distribute.ReduceOp.SUM,
                             self.strategy.run(lambda: tf.constant(1.0)), axis=None).numpy()


def start() -> Dist:
    base.setup(int(os.environ.get("TF_NUM_INTRAOP_THREADS", "1")))  # before the strategy starts TensorFlow
    return Dist()


class _Job:
    """The framework's job and a step that trains it data-parallel."""

    def __init__(self, job: Any, dist: Dist, global_batch: int) -> None:
        missing = [a for a in ("net", "optimizer", "iterator", "checkpoint", "step") if not hasattr(job, a)]
        if missing:
            raise AttributeError(f"tensorflow_worker.Job lacks {missing}: the scale run needs its network, "
                                 "optimizer, iterator, checkpoint and step")
        self.job, self.strategy = job, dist.strategy
        net, optimizer, strategy = job.net, job.optimizer, dist.strategy

        def replica_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = net(x, training=True)
                per_example = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            grads = tape.gradient(loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))
            return loss

        @tf.function
        def step(x: Any, y: Any) -> Any:
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x, y)), axis=None)

        self.step = step


def build(model: str, config: dict, dist: Dist) -> _Job:
    with dist.strategy.scope():
        job = base.build(model, {**config, "seed": config["seed"] + dist.rank})
    return _Job(job, dist, config["batch_size"] * dist.world)


def train(job: _Job, steps: int, on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(job.job.iterator)
        losses.append(float(job.step(x, y)))
        job.job.step.assign_add(1)
        if on_step is not None:
            on_step(int(job.job.step.numpy()))
    return losses


class Checkpointer:
    """A CheckpointManager on every worker: the chief's in ``directory``, the others' in
    temporary directories beside it, removed on close."""

    def __init__(self, directory: Path, dist: Dist) -> None:
        directory = Path(directory)
        self.temporary = dist.rank != 0
        self.directory = directory if not self.temporary else directory.parent / f"{directory.name}-worker{dist.rank}"
        self.manager: Any = None

    def save(self, job: _Job, step: int) -> None:
        if self.manager is None:
            os.makedirs(self.directory, exist_ok=True)
            self.manager = tf.train.CheckpointManager(job.job.checkpoint, str(self.directory), max_to_keep=3)
        self.manager.save(checkpoint_number=step)

    def wait(self) -> None:
        pass

    def close(self) -> None:
        if self.temporary:
            shutil.rmtree(self.directory, ignore_errors=True)
