"""Chainer in the scale experiment: ChainerMN data-parallel training over MPI, one process per
rank started by ``mpiexec -n N`` (PyPI's ``mpich`` and ``mpi4py`` in the chainer environment).

Imports the standard library, numpy, chainer and chainermn (with mpi4py) only. The job is
``chainer_worker``'s, built with a seed per rank (each rank draws its own batches); its optimizer
is wrapped by ``chainermn.create_multi_node_optimizer``, which broadcasts rank 0's parameters on
the first update and averages the gradients over the ranks on every update after. Rank 0 alone
saves (``serializers.save_npz`` of the model and the optimizer), as ChainerMN's examples save
their snapshots from rank 0; the others go on training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import chainermn

import chainer_worker as base

MECHANISM, LABEL = base.MECHANISM, base.LABEL


def versions() -> dict[str, str]:
    from mpi4py import MPI

    return {**base.versions(), "mpi4py": __import__("mpi4py").__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip()}


class Dist:
    def __init__(self) -> None:
        self.comm = chainermn.create_communicator("naive")  # CPU: numpy arrays over MPI
        self.rank, self.world = self.comm.rank, self.comm.size

    def barrier(self) -> None:
        self.comm.mpi_comm.Barrier()


def start() -> Dist:
    return Dist()


def build(model: str, config: dict, dist: Dist) -> Any:
    base.setup(config.get("threads", 1))
    job = base.build(model, {**config, "seed": config["seed"] + dist.rank})
    job.optimizer = chainermn.create_multi_node_optimizer(job.optimizer, dist.comm)
    return job


def train(job: Any, steps: int, on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    return base.train(job, steps, on_step)


class Checkpointer:
    """The framework's Checkpointer on rank 0; nothing on the other ranks."""

    def __init__(self, directory: Path, dist: Dist) -> None:
        self.inner = base.Checkpointer(directory) if dist.rank == 0 else None

    def save(self, job: Any, step: int) -> None:
        if self.inner is not None:
            self.inner.save(job, step)

    def wait(self) -> None:
        if self.inner is not None:
            self.inner.wait()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
