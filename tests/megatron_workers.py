"""A Megatron-Core ``torch_dist`` checkpoint written by megatron.core.dist_checkpointing.save on 4
gloo ranks (2 tensor- x 2 pipeline-parallel), and Megatron's own consolidated view of it.

Usage: python megatron_workers.py ROOT PORT. Needs megatron-core on the path (make test-megatron
installs it in .megatron-site/). The model is built, not trained (tests/megatron_optimizer_workers.py
trains one, with stand-ins for CUDA); its torch_dist writer calls ``torch.cuda.synchronize()`` and
reduces a flag on ``torch.cuda.current_device()``: made a no-op and the CPU here. So the model is a real
GPTModel of 4 layers over 2 tensor- and 2 pipeline-parallel ranks (its real sharded state dict: the
layer axis prepended and split over the stages, the partition axes fragmented over the tensor-parallel
ranks, a gated fc1 through Megatron's SwiGLU factory),
its weights filled with random values; beside it, as Megatron-LM's training loop adds them: the RNG
state as a ShardedObject of each rank, the distributed optimizer's state in its ``fully_reshardable``
format (:func:`distributed_optimizer_state`), and common values (args, iteration).

Writes ROOT/mcore (``latest_checkpointed_iteration.txt`` and ``iter_0000005/``), ROOT/legacy (the
same model saved by each rank in the legacy layout, ``model_optim_rng.pt``) and
ROOT/reference.pt: what dist_checkpointing.load gives one rank loading every tensor whole
(load_sharded_metadata's tensors and objects, keys as Megatron names them) and
load_common_state_dict's plain part.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
ITERATION = 5
WORLD = 4  # 2 tensor- x 2 pipeline-parallel ranks


def main(root: Path, port: int, rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    # torch_dist's writer synchronizes CUDA before it copies the tensors out (filesystem_async.py,
    # preload_tensors) and reduces its failure flag on the current CUDA device (state_dict_saver.py),
    # unconditionally; with CPU tensors there is nothing to wait for, and gloo reduces on the CPU.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=4, pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                            pipeline_dtype=torch.float32, hidden_size=8, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=12, use_cpu_initialization=True, gated_linear_unit=True,
                            add_bias_linear=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=16, pre_process=pp == 0,
                     post_process=pp == 1)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            sharded = getattr(p, "tensor_model_parallel", False)
            # replicas (the other tensor-parallel rank's copy) equal; each stage its own values
            g = torch.Generator().manual_seed(1000 * i + 100 * pp + (tp if sharded else 0))
            p.copy_(torch.randn(p.shape, generator=g))
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = distributed_optimizer_state(state["model"], pp, tp)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}]
    state["rng_state"] = ShardedObject("rng_state", rng, (2, 2), (pp, tp), replica_id=0)
    state["args"] = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4,
                                       swiglu=True, params_dtype=torch.float32, ckpt_format="torch_dist")
    state["iteration"] = ITERATION
    state["checkpoint_version"] = 3.0
    state["opt_param_scheduler"] = {"max_lr": 1e-3, "num_steps": 20, "decay_style": "cosine"}
    folder = root / "mcore" / f"iter_{ITERATION:07d}"
    if rank == 0:
        folder.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(folder))
    # The same model in the legacy layout, as Megatron-LM's --ckpt-format torch saves it.
    legacy = root / "legacy" / f"iter_{ITERATION:07d}" / f"mp_rank_{tp:02d}_{pp:03d}"
    legacy.mkdir(parents=True)
    torch.save({"args": state["args"], "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint(), "rng_state": rng}, legacy / "model_optim_rng.pt")
    dist.barrier()
    if rank == 0:
        for kind in ("mcore", "legacy"):
            (root / kind / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    dist.destroy_process_group()


def distributed_optimizer_state(model_state: dict, pp: int, tp: int) -> dict:
    """What DistributedOptimizer.sharded_state_dict gives in its ``fully_reshardable`` format (the
    one megatron-core 0.16 saves in model space; ``fully_sharded_model_space`` is refused by its
    ShardedTensor validation in this version), built by hand following its
    ``sharded_param_state_fully_reshardable``: the DP-sharded flat buffers gathered and cut back
    into each parameter's shape, each state a copy of the parameter's ShardedTensor (or SwiGLU
    factory) under ``optimizer.state.<param|exp_avg|exp_avg_sq>.<key>`` with its replica_id; the
    non-parameter part (param groups with the step, the sharding type) goes to common.pt. The
    optimizer itself cannot be built here: it requires CUDA parameter types (distrib_optimizer.py
    refuses a 'torch.FloatTensor'). The states are functions of the weights (main param: the weight
    in fp32; exp_avg = 2 w + 1; exp_avg_sq = w * w), so that replicas agree and the test can
    recompute them from the imported weights."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_state)
    param_state = {}
    for i, sh in enumerate(nested_values(tensors)):
        w = sh.data.detach().float()
        states = {"param": w.clone(), "exp_avg": w * 2 + 1, "exp_avg_sq": w * w}
        param_state[i] = {}
        for name, t in states.items():
            update = dict(key=f"optimizer.state.{name}.{sh.key}", data=t, dtype=t.dtype, replica_id=sh.replica_id)
            if isinstance(sh, ShardedTensorFactory):
                update.pop("dtype")
            param_state[i][name] = replace(sh, **update)
    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd, "amsgrad": False, "step": 3,
               "wd_mult": float(wd > 0), "lr_mult": 1.0} for wd in (0.1, 0.0)]
    return {"optimizer": {"param_groups": groups}, "param_state": param_state,
            "param_state_sharding_type": "fully_reshardable"}


def reference(root: Path, port: int) -> None:
    """Megatron's consolidated view, on one rank: every tensor and object loaded whole."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    folder = str(root / "mcore" / f"iter_{ITERATION:07d}")
    loaded = dist_checkpointing.load(load_sharded_metadata(folder), folder)
    common = dist_checkpointing.load_common_state_dict(folder)
    torch.save({"sharded": loaded, "iteration": common["iteration"], "args": vars(common["args"]),
                "opt_param_scheduler": common["opt_param_scheduler"], "optimizer": common["optimizer"]},
               root / "reference.pt")
    dist.destroy_process_group()


def launch(script: str, main, reference, world: int) -> None:
    """``script ROOT PORT``: ``world`` ranks of ``main`` in processes of their own, then ``reference``;
    ``script ROOT PORT RANK``: one rank."""
    root, port = Path(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        main(root, port, int(sys.argv[3]))
        return
    import subprocess

    procs = [subprocess.Popen([sys.executable, script, str(root), str(port), str(r)]) for r in range(world)]
    codes = [p.wait(timeout=600) for p in procs]
    if max(codes):
        sys.exit(max(codes))
    reference(root, port + 1)


if __name__ == "__main__":
    launch(__file__, main, reference, WORLD)
