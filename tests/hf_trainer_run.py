"""A tiny Hugging Face Trainer run for the transformers integration tests (imported by
tests/test_transformers.py, and run as a script by its SIGKILL test).

    python tests/hf_trainer_run.py OUTPUT_DIR [--hang-at STEP]

trains with ResurgoTrainer (resuming from OUTPUT_DIR's latest checkpoint if there is one),
printing ``STEP n`` after each step; with ``--hang-at``, it stops there and waits to be killed.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from resurgo.integrations.transformers import ResurgoTrainerMixin

STEPS = 12  # 16 samples / batch 4: 4 steps per epoch, 3 epochs


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}

    def indices_of(self, batch: torch.Tensor) -> tuple[int, ...]:
        """The sample index of each row of a batch (the rows are distinct, so each matches once)."""
        matches = (batch[:, None, :] == self.x[None, :, :]).all(-1).nonzero()
        assert matches[:, 0].tolist() == list(range(len(batch))), "a batch row matches no sample, or several"
        return tuple(matches[:, 1].tolist())


class Recording:
    """Keeps every training loss (the Trainer's logs round them) and the sample indices of its batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:  # not the evaluation's (which asks for the outputs too)
            self.losses.append(result.detach().clone())
            self.batch_indices.append(self.train_dataset.indices_of(inputs["input_ids"]))
        return result


class PlainTrainer(Recording, Trainer):
    pass


class ResurgoRecording(Recording, ResurgoTrainerMixin, Trainer):
    pass


class Steps(TrainerCallback):
    """Stops training after step ``stop`` (a preempted job's end), or prints each step."""

    def __init__(self, stop: int | None = None, hang_at: int | None = None, echo: bool = False) -> None:
        self.stop, self.hang_at, self.echo = stop, hang_at, echo

    def on_step_end(self, args, state, control, **kwargs):
        if self.echo:
            print(f"STEP {state.global_step}", flush=True)
        if state.global_step == self.hang_at:
            time.sleep(600)
        if state.global_step == self.stop:
            control.should_training_stop = True


class Trace(TrainerCallback):
    """After each optimizer step: (state.epoch, state.global_step, the sample indices the step
    trained on, the scheduler's last learning rates, a digest of torch's CPU RNG state (which
    dropout and the sampler draw from), the grad scaler's state or None), appended to ``steps``."""

    def __init__(self, batch_indices: list, steps: list) -> None:
        self.batch_indices, self.steps = batch_indices, steps

    def on_step_end(self, args, state, control, lr_scheduler=None, optimizer=None, **kwargs):
        rng = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
        scaler = getattr(optimizer, "scaler", None)  # Accelerate's optimizer steps through the Accelerator's
        self.steps.append((state.epoch, state.global_step, self.batch_indices[-1], tuple(lr_scheduler.get_last_lr()),
                           rng, None if scaler is None else scaler.state_dict()))


def make_trainer(output_dir, *, resurgo: bool = True, save_steps: int = 3, stop: int | None = None,
                 callbacks: tuple = (), eval_dataset=None, scaler: bool = False, lora: bool = False,
                 **kwargs) -> Trainer:
    """Seeded as a fresh job is: the model is rebuilt from the config (no downloads); dropout and
    the shuffled sampler draw from the RNG every step. ``scaler``: the steps go through a grad
    scaler whose scale doubles every 2 steps (set on the Accelerator before training, as
    Accelerate does for fp16 on a GPU: with ``fp16=True`` on CPU it makes none). ``lora``: the model
    is a PEFT LoRA model over it (rank 4 on the attention, dropout 0.1, B not zero at the start)."""
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1,
                                                 init_lora_weights=False))
    args = TrainingArguments(output_dir, max_steps=STEPS, per_device_train_batch_size=4, save_strategy="steps",
                             save_steps=save_steps, learning_rate=1e-2, use_cpu=True, report_to="none", seed=0,
                             disable_tqdm=True, logging_strategy="no", **kwargs)
    cls = ResurgoRecording if resurgo else PlainTrainer
    batch_indices: list = []
    trace: list = []  # filled by Trace, before Steps can stop the run
    trainer = cls(model=model, args=args, train_dataset=Tokens(), eval_dataset=eval_dataset,
                  callbacks=[Trace(batch_indices, trace), Steps(stop), *callbacks])
    if scaler:  # before train() prepares the optimizer, which then steps through it
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    trainer.losses, trainer.batch_indices, trainer.trace = [], batch_indices, trace
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--hang-at", type=int)
    opts = parser.parse_args()
    trainer = make_trainer(opts.output_dir, save_steps=2, callbacks=(Steps(hang_at=opts.hang_at, echo=True),))
    trainer.train()
    sys.exit(0)


def two_processes(rank: int, world: int, root: str) -> dict:
    """On each of 2 ranks (DDP over gloo): the uninterrupted run, and the same run stopped at step
    6 and resumed from its latest checkpoint."""
    import os
    from pathlib import Path

    os.environ["LOCAL_RANK"] = str(rank)
    whole = make_trainer(Path(root, "whole"), save_steps=STEPS + 1)
    whole.train()
    first = make_trainer(Path(root, "ckpt"), save_steps=3, stop=6)
    first.train()
    resumed = make_trainer(Path(root, "ckpt"), save_steps=3)
    resumed.train(resume_from_checkpoint=True)
    params = lambda t: {k: v.detach().clone() for k, v in t.model.state_dict().items()}  # noqa: E731
    return {"whole": (whole.losses, params(whole)), "resumed": (first.losses + resumed.losses, params(resumed)),
            "whole_trace": whole.trace, "resumed_trace": first.trace + resumed.trace,
            "checkpoints": sorted(os.listdir(Path(root, "ckpt")))}
