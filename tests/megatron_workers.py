"""A Megatron-Core ``torch_dist`` checkpoint written by megatron.core.dist_checkpointing.save on 4
gloo ranks (2 tensor- x 2 pipeline-parallel), and Megatron's own consolidated view of it.

Usage: python megatron_workers.py ROOT PORT. Needs megatron-core on the path (make test-megatron
installs it in .megatron-site/). Megatron-Core builds its GPT model on CPU here, but cannot run a
forward pass: its attention takes a buffer from ``torch.cuda.current_device()``
(megatron/core/utils.py, GlobalMemoryBuffer), and this torch has no CUDA. (Its torch_dist writer
calls ``torch.cuda.synchronize()`` and reduces a flag on ``torch.cuda.current_device()``: made a
no-op and the CPU here.) So the model is a real
GPTModel of 4 layers over 2 tensor- and 2 pipeline-parallel ranks (its real sharded state dict: the
layer axis prepended and split over the stages, the partition axes fragmented over the tensor-parallel
ranks, a gated fc1 through Megatron's SwiGLU factory),
its weights filled with random values; beside it, as Megatron-LM's training loop adds them: the RNG
state as a ShardedObject of each rank, a distributed-optimizer-like state (flat fp32 main params
and Adam moments, the flat buffer split over the ranks), and common values (args, iteration).

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
FLAT = 512


def main(root: Path, port: int, rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
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
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()
    g = torch.Generator().manual_seed(77 + rank)
    buffers = {"param": flat, "exp_avg": torch.randn(flat.shape, generator=g),
               "exp_avg_sq": torch.rand(flat.shape, generator=g)}
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32)"
    # one buffer per stage and tensor-parallel rank (its first FLAT elements, the same length on every
    # rank: a regular grid), a stage axis prepended
    state["optimizer"] = {name: ShardedTensor.from_rank_offsets(f"{key}.{name}", t[:FLAT].clone(), (0, pp, 2),
                                                                (1, tp, 2), prepend_axis_num=1, replica_id=0)
                          for name, t in buffers.items()}
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
                "opt_param_scheduler": common["opt_param_scheduler"]}, root / "reference.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    root, port = Path(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        main(root, port, int(sys.argv[3]))
    else:
        import subprocess

        procs = [subprocess.Popen([sys.executable, __file__, str(root), str(port), str(r)]) for r in range(WORLD)]
        codes = [p.wait(timeout=600) for p in procs]
        if max(codes):
            sys.exit(max(codes))
        reference(root, port + 1)
