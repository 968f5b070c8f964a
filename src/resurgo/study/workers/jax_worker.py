"""JAX for the study's driver: Orbax ``CheckpointManager`` (asynchronous, as its users get it by
default) saving a Flax ``TrainState`` with ``ocp.args.StandardSave``, as Flax's examples write it.

Imports the standard library, numpy, jax, flax, optax and orbax only (this runs in the jax
environment). The networks are the study's ResNet-50 and VGG-16 (``jax_nets``: PyTorch's CIFAR-10
definitions, layer for layer); Flax ships no stock ResNet-50 or VGG-16 to compare with. Data:
synthetic CIFAR-10-shaped images, shuffled and augmented (random crop + flip) with numpy's global
RNG; dropout keys are folded from the step, as Flax's examples do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state

from jax_nets import DESCRIPTIONS, NETWORKS

MECHANISM = "orbax_async"
LABEL = "JAX Orbax CheckpointManager (async)"
FORMAT = "OCDBT/Zarr (TensorStore) + JSON metadata"
STORES = {"weights": True, "optimizer": True, "rng": False, "data_position": False}
EXECUTES_CODE = "no"
EXECUTES_CODE_NOTE = "Orbax restores arrays from TensorStore and JSON metadata into a given structure; no pickle"
FSYNC = False
LR, MOMENTUM, WEIGHT_DECAY, PAD = 0.01, 0.9, 5e-4, 4


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "flax": flax.__version__, "orbax-checkpoint": ocp.__version__,
            "optax": optax.__version__, "numpy": np.__version__}


def setup(threads: int) -> None:
    """Threads are set by the environment the study passes (XLA_FLAGS)."""


def describe(model: str) -> str:
    return DESCRIPTIONS[model]


def stock(model: str) -> Optional[dict[str, Any]]:
    """None: neither Flax nor JAX ships a ResNet-50 or VGG-16."""
    return None


class TrainState(train_state.TrainState):
    batch_stats: Any


@jax.jit
def _train_step(state: TrainState, x: Any, y: Any, dropout_key: Any) -> tuple[TrainState, Any]:
    key = jax.random.fold_in(dropout_key, state.step)

    def loss_fn(params: Any) -> Any:
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x, train=True,
                                         mutable=["batch_stats"], rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return state, loss


def _augment(x: Any) -> Any:
    dy, dx = np.random.randint(0, 2 * PAD + 1, size=2)
    x = np.pad(x, ((PAD, PAD), (PAD, PAD), (0, 0)))[dy:dy + 32, dx:dx + 32]
    return x[:, ::-1] if np.random.rand() < 0.5 else x


class Job:
    def __init__(self, model: str, config: dict) -> None:
        seed = config["seed"]
        np.random.seed(seed)
        rng = np.random.RandomState(seed)
        self.images = rng.standard_normal((config["samples"], 32, 32, 3)).astype(np.float32)
        self.labels = rng.randint(0, 10, config["samples"]).astype(np.int32)
        self.batch_size = config["batch_size"]
        net = NETWORKS[model](config["width"])
        init_key, self.dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        variables = net.init(init_key, jnp.zeros((1, 32, 32, 3)), train=False)
        tx = optax.chain(optax.add_decayed_weights(WEIGHT_DECAY), optax.sgd(LR, momentum=MOMENTUM))
        self.state = TrainState.create(apply_fn=net.apply, params=variables["params"],
                                       batch_stats=variables["batch_stats"], tx=tx)
        # a strongly typed step, as restored: a weakly typed one would make jit compile again after a restore
        self.state = self.state.replace(step=jnp.asarray(0, jnp.int32))
        self.batches: Any = iter(())

    def next_batch(self) -> tuple[Any, Any]:
        for _ in range(2):
            try:
                return next(self.batches)
            except StopIteration:  # a new epoch: reshuffle
                self.batches = self._epoch()
        raise RuntimeError("no batch")

    def _epoch(self) -> Any:
        order = np.random.permutation(len(self.labels))
        for i in range(0, len(order) - self.batch_size + 1, self.batch_size):
            idx = order[i:i + self.batch_size]
            yield np.stack([_augment(self.images[j]) for j in idx]), self.labels[idx]


def build(model: str, config: dict) -> Job:
    return Job(model, config)


def train(job: Job, steps: int, on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = job.next_batch()
        job.state, loss = _train_step(job.state, x, y, job.dropout_key)
        losses.append(float(loss))
        if on_step is not None:
            on_step(int(job.state.step))
    return losses


def set_step(job: Job, step: int) -> None:
    job.state = job.state.replace(step=jnp.asarray(step, jnp.int32))


def parameters(job: Job) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(job.state.params)))


def _bytes(tree: Any) -> int:
    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)))


def state_bytes(job: Job) -> tuple[int, int]:
    """Bytes of the parameters and BatchNorm statistics, and of the optimizer state and step."""
    return _bytes((job.state.params, job.state.batch_stats)), _bytes((job.state.opt_state, job.state.step))


def disturb_rng() -> None:
    np.random.seed(987654321)
    np.random.rand(1000)


class Checkpointer:
    """An Orbax CheckpointManager in ``directory`` with its defaults (asynchronous saves)."""

    def __init__(self, directory: Path) -> None:
        self.manager = ocp.CheckpointManager(Path(directory).absolute(),
                                             options=ocp.CheckpointManagerOptions(max_to_keep=3))

    def save(self, job: Job, step: int) -> None:
        self.manager.save(step, args=ocp.args.StandardSave(job.state))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def load(self, job: Job) -> Optional[int]:
        step = self.manager.latest_step()
        job.state = self.manager.restore(step, args=ocp.args.StandardRestore(job.state))
        return int(job.state.step)

    def close(self) -> None:
        self.manager.close()
