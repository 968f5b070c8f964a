"""A real torchtitan training job (llama3 debug model, 2 layers) on CPU, checkpointed by
resurgo's ``ResurgoCheckpointManager``; run by tests/test_torchtitan.py as its own process(es).

``python torchtitan_run.py JSON``: JSON holds ``assets`` (made by :func:`make_assets`), ``dump``
(torchtitan's dump folder), ``steps``, ``interval``, ``keep``, ``async_mode``, ``exclude`` and
``kill_after`` (SIGKILL this process right after the checkpoint of that step is committed) and
``load_then_exclude_dataloader`` (load once, record the refusal, then load without the data loader).
Rank 0 writes ``dump/record.json`` (per-step losses as float hex, a hash of the Python, NumPy
and torch RNG states) and
``dump/final.pt`` (full model and optimizer tensors) when training ends.

torchtitan 0.3 has no CPU path; these things are pointed at the CPU before it is imported, and
nothing else of it is changed: its device detection falls back to "cuda" when no accelerator is
present (torchtitan/tools/utils.py: ``_get_available_device_type() or "cuda"``), the language
models' attention backends (flex, varlen) have no CPU backward, so the layers use torchtitan's
own ScaledDotProductAttention, and it calls ``torch.distributed.set_timeout``, which torch 2.13
does not have yet. For FSDP on gloo, FSDP's PREMUL_SUM(1) reduction is made a SUM (the same sum;
gloo has no PREMUL_SUM).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import types

import numpy as np
import torch
import torch._utils
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.fsdp import FSDPModule


def _point_torchtitan_at_cpu() -> None:
    cpu = types.ModuleType("cpu_device")
    props = types.SimpleNamespace(total_memory=1 << 34, name="cpu")
    cpu.__dict__.update(set_device=lambda device: None, device_count=lambda: 1, current_device=lambda: 0,
                        get_device_name=lambda device=None: "cpu", get_device_properties=lambda device=None: props,
                        reset_peak_memory_stats=lambda device=None: None, empty_cache=lambda: None,
                        memory_stats=lambda device=None: {}, synchronize=lambda device=None: None)
    module_of = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: cpu if device_type == "cpu" else module_of(device_type)
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: c10d._set_pg_timeout(timeout, group)
    # torchtitan sets FSDP's gradient divide factor to 1, which FSDP reduces with PREMUL_SUM(1):
    # gloo has no PREMUL_SUM; a plain SUM is the same reduction.
    divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor):
        divide(self, factor)
        self.set_force_sum_reduction_for_comms(factor == 1.0)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def make_assets(root: str) -> None:
    """A word-level tokenizer of 203 tokens and 400 short documents of its words (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(200)]
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(os.path.join(root, "tokenizer"), exist_ok=True)
    tokenizer.save(os.path.join(root, "tokenizer", "tokenizer.json"))
    with open(os.path.join(root, "tokenizer", "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>"}, f)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    rnd = random.Random(0)
    with open(os.path.join(root, "data", "train.json"), "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rnd.choice(words) for _ in range(rnd.randint(5, 60)))}) + "\n")


def job_config(args: dict):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from resurgo.integrations.torchtitan import ResurgoCheckpointManager

    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.hf_assets_path = os.path.join(args["assets"], "tokenizer")
    config.dataloader.dataset_path = os.path.join(args["assets"], "data")
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 32, 2, args["steps"]
    config.training.mixed_precision_param = "float32"
    config.validator.enable = False
    # FSDP2 over DTensor (torchtitan's default "spmd_types" backend needs a newer torch for FSDP).
    config.parallelism.spmd_backend = "partial_dtensor"
    config.comm.trace_buf_size = 0
    config.debug.seed, config.debug.deterministic = 0, True
    config.dump_folder = args["dump"]
    # The one line a torchtitan user changes (was: CheckpointManager.Config(...)).
    config.checkpoint = ResurgoCheckpointManager.Config(
        enable=True, interval=args["interval"], keep_latest_k=args.get("keep", 0), last_save_model_only=False,
        async_mode=args.get("async_mode", "disabled"), exclude_from_loading=args.get("exclude", []))
    return config


def main(args: dict) -> None:
    _point_torchtitan_at_cpu()
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    random.seed(0)  # torchtitan seeds torch only; the job's Python and NumPy streams are seeded too
    np.random.seed(0)
    trainer = job_config(args).build()
    losses: dict[int, str] = {}
    log = trainer.metrics_processor.log

    def record_loss(step, global_avg_loss, *rest, **kwargs):
        losses[step] = float(global_avg_loss).hex()
        return log(step, global_avg_loss, *rest, **kwargs)

    trainer.metrics_processor.log = record_loss
    save = trainer.checkpointer.save

    def save_then_maybe_die(curr_step, last_step=False):
        saved = save(curr_step, last_step=last_step)
        if curr_step == args.get("kill_after"):
            trainer.checkpointer.maybe_wait_for_saving()
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    trainer.checkpointer.save = save_then_maybe_die
    refused = None
    if args.get("load_then_exclude_dataloader"):
        # The job restarted on another number of ranks: its first load is refused; then, as the
        # user would, it leaves the data loader's position out and loads again.
        from resurgo.errors import WorldSizeMismatchError

        try:
            trainer.checkpointer.load()
        except WorldSizeMismatchError as err:
            refused = str(err)
        trainer.checkpointer.config.exclude_from_loading.append("dataloader")
    trainer.train()
    trainer.checkpointer.maybe_wait_for_saving()
    model = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in trainer.checkpointer.states["model"].state_dict().items()}
    optim = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in trainer.optimizers.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({"model": model, "optimizer": optim}, os.path.join(args["dump"], "final.pt"))
        with open(os.path.join(args["dump"], "record.json"), "w") as f:
            rng = repr((random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state().tolist()))
            json.dump({"losses": losses, "rng": hashlib.sha256(rng.encode()).hexdigest(), "step": trainer.step,
                       "refused": refused}, f)
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
