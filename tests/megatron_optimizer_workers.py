"""A real Megatron-Core training run on 8 gloo ranks (2 tensor- x 2 pipeline- x 2 data-parallel): a
small GPT (SwiGLU, tied embeddings) trained 3 steps with Megatron's own DistributedDataParallel,
pipeline schedule (1F1B, p2p over gloo), gradient finalization and DistributedOptimizer (Adam), its
checkpoint saved in the bucket-space ``dp_reshardable`` format (Megatron-LM's default for
``torch_dist``), in the legacy layout, and what the optimizer held.

Usage: python megatron_optimizer_workers.py ROOT PORT. Needs megatron-core on the path (make
test-megatron installs it in .megatron-site/).

Megatron-Core is built for CUDA; on this CPU-only torch it trains with stand-ins set before its
modules run (:func:`on_cpu`): ``torch.cuda``'s ``current_device`` and ``synchronize`` (the CPU;
nothing to wait for), tensor factories asked for ``device='cuda'`` make CPU tensors,
``Tensor.type()`` reports a CPU float tensor as ``torch.cuda.FloatTensor`` (the optimizer accepts
only CUDA parameter types by that name), and the model-parallel RNG tracker forks the CPU
generator's state instead of CUDA's. Everything else is Megatron's own: the parameter and gradient
buffers and their buckets (small buckets, ``overlap_grad_reduce``, so each stage has several; the
tied word embeddings in their own bucket on the first and last stage), the forward and backward
passes, the reduce-scatter of gradients, Adam's steps on the DP shards, and the savers.

After the checkpoint the job trains 4 more steps on tests/megatron_continue.py's batches and
writes their losses to ROOT/continued.json: Megatron's own continuation.

Writes ROOT/dp/iter_0000003 (the model and the optimizer in ``dp_reshardable``, common.pt with args and
iteration), ROOT/full/iter_0000003 (the same optimizer saved by Megatron in ``fully_reshardable``),
ROOT/legacy (the legacy layout: ``mp_rank_XX_YYY/model_optim_rng.pt`` and the optimizer's
``distrib_optim.pt``) and ROOT/reference.pt: per parameter key and state (``param``, ``exp_avg``, ``exp_avg_sq``), the
optimizer's state gathered from its DP shards on each rank, placed by the model's own sharded
state dict and loaded whole by ``dist_checkpointing.load``, with the model's weights; and the
``fully_reshardable`` checkpoint as ``dist_checkpointing.load`` gives it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
ITERATION = 3
TP, PP, DP = 2, 2, 2
WORLD = TP * PP * DP
# the model and batches of tests/megatron_continue.py: a batch of BATCH rows of SEQ tokens per step,
# MORE steps after the checkpoint
VOCAB, BATCH, SEQ, MORE = 32, 6, 6, 4


def on_cpu() -> None:
    """The stand-ins for CUDA named in the module docstring."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    tensor_type = torch.Tensor.type

    def cuda_type(self, *a, **k):
        name = tensor_type(self, *a, **k)
        return name.replace("torch.", "torch.cuda.", 1) if not a and not k and ".cuda." not in name else name

    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *a, **k: self

    def cpu_factory(fn):
        @functools.wraps(fn)
        def make(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return make

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "zeros_like", "empty_like"):
        setattr(torch, name, cpu_factory(getattr(torch, name)))
    # the model-parallel RNG tracker forks CUDA generator states: the CPU generator's
    torch.cuda.get_rng_state = torch.get_rng_state
    torch.cuda.set_rng_state = torch.set_rng_state
    torch.cuda.manual_seed = torch.manual_seed
    import megatron.core.tensor_parallel.random as model_parallel_random

    model_parallel_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    model_parallel_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()


def main(root: Path, port: int, rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    on_cpu()
    from dataclasses import replace

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=4, pipeline_model_parallel_size=PP, tensor_model_parallel_size=TP,
                            pipeline_dtype=torch.float32, hidden_size=8, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=12, use_cpu_initialization=True, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=True, hidden_dropout=0.0,
                            attention_dropout=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=16, pre_process=pp == 0,
                     post_process=pp == PP - 1, share_embeddings_and_output_weights=True)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=200), model)
    # no gradient clipping: the plain-torch continuation (megatron_continue.py) does not clip
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                                                 use_distributed_optimizer=True), [ddp])
    names = {p: n for n, p in model.named_parameters()}
    cfg.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    def forward_step(batches, module):
        rows = next(batches)  # predict each token from the ones before it
        tokens, labels = rows[:, :-1], rows[:, 1:]
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        causal = torch.ones(1, 1, tokens.shape[1], tokens.shape[1]).triu(1).bool()
        out = module(tokens, positions, causal, labels=labels)
        return out, lambda losses: (losses.float().mean(), {"loss": losses.float().mean().detach()})

    def train(step: int, seed: int) -> float:
        """One step on the global batch of ``seed``, its rows split over the DP ranks (the same
        rows on every tensor- and pipeline-parallel rank of a DP rank): the mean loss."""
        ddp.zero_grad_buffer()
        opt.zero_grad()
        rows = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
        mine = rows[dp * (BATCH // DP):(dp + 1) * (BATCH // DP)]
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter([mine]), model=[ddp],
                                  num_microbatches=1, seq_length=SEQ - 1, micro_batch_size=BATCH // DP,
                                  forward_only=False)
        assert opt.step()[0]
        loss = losses[0]["loss"] if losses else torch.zeros(())
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        return loss.item() / DP

    for step in range(ITERATION):
        train(step, 900 + step)
    common = {"args": argparse.Namespace(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP,
                                         num_layers=4, swiglu=True, params_dtype=torch.float32,
                                         use_distributed_optimizer=True, ckpt_format="torch_dist"),
              "iteration": ITERATION, "checkpoint_version": 3.0}
    for kind, sub in (("dp_reshardable", "dp"), ("fully_reshardable", "full")):
        state = {"model": model.sharded_state_dict()}
        state["optimizer"] = opt.sharded_state_dict(state["model"], metadata={"distrib_optim_sharding_type": kind})
        folder = root / sub / f"iter_{ITERATION:07d}"
        if rank == 0:
            folder.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save({**state, **common}, str(folder))
        if rank == 0:
            (root / sub / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    # The legacy layout (--ckpt-format torch) of the same run: per model-parallel rank the model and
    # the optimizer's param groups in model_optim_rng.pt, its state gathered on DP rank 0 into
    # distrib_optim.pt (as Megatron-LM's save_checkpoint writes them).
    legacy = root / "legacy" / f"iter_{ITERATION:07d}" / f"mp_rank_{tp:02d}_{pp:03d}"
    if dp == 0:
        legacy.mkdir(parents=True)
    dist.barrier()
    opt.save_parameter_state(str(legacy / "distrib_optim.pt"))
    if dp == 0:
        torch.save({**common, "model": model.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict()},
                   legacy / "model_optim_rng.pt")
    if rank == 0:
        (root / "legacy" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()

    # What the optimizer holds: each parameter's state gathered from its DP shards, placed in the
    # global tensors by the model's own sharded state dict (as fully_reshardable places it).
    (dopt,) = getattr(opt, "chained_optimizers", [opt])
    held = {}
    for p, name in names.items():
        if p in dopt.model_param_gbuf_map:  # the parameters with a part in this DP rank's shard
            gbuf, dtype, bucket = dopt.model_param_gbuf_map[p]
            r = dopt.gbuf_ranges[gbuf][dtype][bucket]["param_map"][p]["param"]
            states = dopt._get_main_param_and_optimizer_states(p)
            held[name] = (r.start, r.end, {k: states[k].detach().clone() for k in ("param", "exp_avg", "exp_avg_sq")})
    shards: list = [None] * DP
    dist.all_gather_object(shards, held, group=parallel_state.get_data_parallel_group())
    tensors, _ = extract_sharded_tensors_and_factories(model.sharded_state_dict())
    truth = {}
    for sh in nested_values(tensors):
        name = names[sh.data]
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            whole = torch.full((sh.data.numel(),), float("nan"))
            for part in shards:
                if name in part:
                    start, end, states = part[name]
                    whole[start:end] = states[kind]
            assert not whole.isnan().any(), (name, kind)
            data = whole.reshape(sh.data.shape)
            update = dict(key=f"optimizer.state.{kind}.{sh.key}", data=data, dtype=data.dtype, replica_id=sh.replica_id)
            if isinstance(sh, ShardedTensorFactory):
                update.pop("dtype")
            truth[len(truth)] = replace(sh, **update)
    folder = root / "truth"
    if rank == 0:
        folder.mkdir()
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "optimizer": truth}, str(folder))
    # Megatron's own continuation of the saved job: MORE steps on megatron_continue.py's batches
    continued = [train(step, 500 + step) for step in range(MORE)]
    if rank == WORLD - 1:  # a last-stage rank: it computed the losses
        (root / "continued.json").write_text(json.dumps({"losses": continued}))
    dist.barrier()
    dist.destroy_process_group()


def reference(root: Path, port: int) -> None:
    """dist_checkpointing.load's view on one rank of the optimizer's state and of ``fully_reshardable``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    views = {}
    for name, folder in (("truth", root / "truth"), ("full", root / "full" / f"iter_{ITERATION:07d}")):
        views[name] = dist_checkpointing.load(load_sharded_metadata(str(folder)), str(folder))
    torch.save(views, root / "reference.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from megatron_workers import launch

    launch(__file__, main, reference, WORLD)
