"""JAX in the scale experiment: ``jax.distributed.initialize`` on loopback (the coordinator's
address, process id and count from the launcher's ``RESURGO_SCALE_*`` variables), CPU
collectives over gloo, one process per rank with one CPU device each.

Imports the standard library, numpy, jax and orbax only. The job is ``jax_worker``'s, built with
a seed per process; its train state is then made one global array per leaf, replicated over a
one-axis mesh of every process's device, from process 0's values (so every process starts from
the same weights). A step is ``jax_worker``'s jitted step on the global batch, sharded over the
mesh: each process supplies its own local batch, and XLA all-reduces the gradients. Saving is
``jax_worker``'s Orbax CheckpointManager (asynchronous), called by every process, as Orbax's
multi-process save requires: the primary process writes the metadata, each replica's data is
written once, and the processes agree through the distributed runtime's barriers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jax_worker as base

MECHANISM, LABEL = base.MECHANISM, base.LABEL


def versions() -> dict[str, str]:
    return base.versions()


class Dist:
    def __init__(self) -> None:
        self.rank = int(os.environ["RESURGO_SCALE_RANK"])
        self.world = int(os.environ["RESURGO_SCALE_WORLD"])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=os.environ["RESURGO_SCALE_COORDINATOR"],
                                   num_processes=self.world, process_id=self.rank)
        self.mesh = Mesh(np.array(jax.devices()), ("data",))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch = NamedSharding(self.mesh, PartitionSpec("data"))

    def barrier(self) -> None:
        multihost_utils.sync_global_devices("resurgo-scale")

    def replicate(self, tree: Any) -> Any:
        """Process 0's values of ``tree``, as global arrays replicated on every process's device."""
        tree = multihost_utils.broadcast_one_to_all(tree)

        def one(x: Any) -> Any:
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, self.replicated, lambda idx: x[idx])

        return jax.tree_util.tree_map(one, tree)


def start() -> Dist:
    return Dist()


class _Job:
    def __init__(self, job: Any, dist: Dist) -> None:
        self.job, self.dist = job, dist


def build(model: str, config: dict, dist: Dist) -> _Job:
    job = base.build(model, {**config, "seed": config["seed"] + dist.rank})
    job.state = dist.replicate(job.state)
    job.dropout_key = dist.replicate(job.dropout_key)
    return _Job(job, dist)


def train(job: _Job, steps: int, on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    losses = []
    inner, dist = job.job, job.dist
    for _ in range(steps):
        x, y = inner.next_batch()
        x = jax.make_array_from_process_local_data(dist.batch, np.asarray(x))
        y = jax.make_array_from_process_local_data(dist.batch, np.asarray(y))
        inner.state, loss = base._train_step(inner.state, x, y, inner.dropout_key)
        losses.append(float(loss))
        if on_step is not None:
            on_step(int(inner.state.step))
    return losses


class Checkpointer:
    """``jax_worker``'s Orbax checkpointer, on every process (one directory for all)."""

    def __init__(self, directory: Path, dist: Dist) -> None:
        self.inner = base.Checkpointer(directory)

    def save(self, job: _Job, step: int) -> None:
        self.inner.save(job.job, step)

    def wait(self) -> None:
        self.inner.wait()

    def close(self) -> None:
        self.inner.close()
