"""PEFT adapters with the real ``peft`` package: saved adapter-only (weights, their optimizer state,
the base model's content digest) by TrainState, ResurgoTrainer and ResurgoAccelerator; resumed bit
for bit, step by step; refused onto another base; converted to and imported from the folder
``PeftModel.from_pretrained`` reads. And the Trainer's own deletion at the end of training, which
does not run under ResurgoTrainer. Tiny models built from their configs, nothing downloaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import resurgo  # noqa: E402
import resurgo.integrations.transformers as hf_integration  # noqa: E402
from hf_trainer_run import STEPS, Tokens, make_trainer  # noqa: E402
from resurgo.errors import BaseModelMismatchError, KeyMismatchError, NotACheckpointError, UnsupportedValueError  # noqa: E402
from resurgo.format import adapter as fmt  # noqa: E402
from resurgo.integrations.peft import AdapterOnly, base_model_digest  # noqa: E402
from resurgo.pipeline.verify import verify_checkpoint  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def tiny_base(seed: int = 0, hidden: int = 32, vocab: int = 64) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=hidden, n_head=2, vocab_size=vocab, n_positions=16,
                                      bos_token_id=0, eos_token_id=0))


def lora(base: torch.nn.Module, r: int = 4, targets: tuple = ("c_attn",), **kwargs):
    """LoRA with dropout (every training step draws from the RNG) and B not zero at the start."""
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=0.1,
                             init_lora_weights=False, **kwargs)
    return peft.get_peft_model(base, config)


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def optimizer_state(opt) -> dict:
    return {k: {f: v.clone() for f, v in s.items()} for k, s in opt.state_dict()["state"].items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same(a[k], b[k])
        else:
            assert bitwise_equal(a[k], b[k]), k


TOKENS = torch.randint(0, 64, (4, 2, 12), generator=torch.Generator().manual_seed(3))


class Job:
    """A LoRA fine-tuning loop over a tiny GPT-2; ``record`` keeps each step's loss, trainable
    parameters and optimizer state."""

    def __init__(self, seed: int = 0) -> None:
        self.model = lora(tiny_base(seed), modules_to_save=["ln_f"])
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        self.state = resurgo.TrainState(model=AdapterOnly(self.model), optimizer=self.opt, step=0)
        self.record: list = []

    def train(self, steps: int) -> None:
        self.model.train()
        for _ in range(steps):
            batch = TOKENS[self.state.step % len(TOKENS)]
            loss = self.model(input_ids=batch, labels=batch).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            self.state.step += 1
            self.record.append((loss.detach(), trainable(self.model), optimizer_state(self.opt)))


def test_train_state_resume_is_bit_identical_step_by_step_and_saves_no_base_weight(tmp_path):
    whole = Job()
    whole.train(6)

    first = Job()
    first.train(3)
    report = resurgo.save(first.state, tmp_path / "ckpt")
    manifest = resurgo.read_manifest(tmp_path / "ckpt")
    weights = sorted(k for k in manifest.tensors if k.startswith("model."))
    prefix = "model.adapters.default.weights.base_model.model.transformer."
    assert weights == sorted(prefix + k for k in ("h.0.attn.c_attn.lora_A.weight", "h.0.attn.c_attn.lora_B.weight",
                                                  "h.1.attn.c_attn.lora_A.weight", "h.1.attn.c_attn.lora_B.weight",
                                                  "ln_f.weight", "ln_f.bias"))
    saved = resurgo.load_dict(tmp_path / "ckpt")["model"]
    assert saved["base_model_digest"] == base_model_digest(tiny_base()) == base_model_digest(first.model)
    assert json.loads(saved["adapters"]["default"]["config"])["inference_mode"] is True
    assert report.tensor_bytes < sum(t.nbytes for t in tiny_base().state_dict().values()) / 4

    torch.manual_seed(1234)  # another RNG state, and other adapter weights, until the load
    resumed = Job()
    for p in resumed.model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p)
    resurgo.load(resumed.state, tmp_path / "ckpt")
    assert resumed.state.step == 3
    assert_same(trainable(resumed.model), whole.record[2][1])
    resumed.train(3)
    for step, ((loss_a, params_a, opt_a), (loss_b, params_b, opt_b)) in enumerate(
            zip(whole.record[3:], resumed.record), start=4):
        assert bitwise_equal(loss_a, loss_b), step
        assert_same(params_a, params_b)
        assert_same(opt_a, opt_b)
    assert len(resumed.record) == 3


def test_another_base_model_is_refused_naming_both_digests_and_nothing_changes(tmp_path):
    job = Job()
    job.train(1)
    resurgo.save(job.state, tmp_path / "ckpt")
    other = Job(seed=1)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    saved, current = base_model_digest(job.model), base_model_digest(other.model)
    assert saved != current
    with pytest.raises(BaseModelMismatchError) as e:
        resurgo.load(other.state, tmp_path / "ckpt")
    assert saved in str(e.value) and current in str(e.value) and "base model they were trained on" in str(e.value)
    assert str(tmp_path / "ckpt") in str(e.value)
    assert_same({k: v for k, v in other.model.state_dict().items()}, before)
    assert other.opt.state_dict()["state"] == {} and other.state.step == 0

    # One base weight changed in place is another base too (the digest is not of a stale cache).
    with torch.no_grad():
        job.model.base_model.model.transformer.wte.weight[0, 0] += 1
    with pytest.raises(BaseModelMismatchError):
        resurgo.load(job.state, tmp_path / "ckpt")


def test_what_an_adapter_only_save_would_lose_is_refused(tmp_path):
    with pytest.raises(UnsupportedValueError, match="not a peft.PeftModel"):
        AdapterOnly(tiny_base())
    model = lora(tiny_base())
    model.base_model.model.transformer.h[0].mlp.c_fc.weight.requires_grad_(True)  # trainable, but in no adapter
    with pytest.raises(UnsupportedValueError, match=r"h.0.mlp.c_fc.weight.*trainable but belong to no adapter.*modules_to_save"):
        resurgo.save({"model": AdapterOnly(model)}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_bytes_written_per_save_are_within_1_2x_of_the_adapter(tmp_path):
    model = lora(tiny_base(hidden=256, vocab=512), r=16, targets=("c_attn", "c_proj"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    batch = torch.randint(0, 512, (2, 16))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    adapter = sum(p.nbytes for p in params)
    moments = sum(v.nbytes for s in opt.state.values() for v in s.values())
    base = sum(t.nbytes for t in tiny_base(hidden=256, vocab=512).state_dict().values())
    assert adapter * 20 < base  # a save of the whole model would be many times larger

    weights_only = resurgo.save(resurgo.TrainState(model=AdapterOnly(model), rng=False), tmp_path / "a")
    assert adapter <= weights_only.bytes_written <= 1.2 * adapter, (weights_only.bytes_written, adapter)
    with_optimizer = resurgo.save(resurgo.TrainState(model=AdapterOnly(model), optimizer=opt), tmp_path / "b")
    assert adapter + moments <= with_optimizer.bytes_written <= 1.2 * (adapter + moments)


def _outputs(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch).logits


def test_convert_to_peft_loads_in_peft_bitwise_and_import_from_peft_reads_it_back(tmp_path):
    from typer.testing import CliRunner

    from resurgo.cli.app import app

    job = Job()
    job.train(2)
    resurgo.save(job.state, tmp_path / "ckpt")
    run = CliRunner().invoke(app, ["convert", str(tmp_path / "ckpt"), str(tmp_path / "adapter"), "--to", "peft"])
    assert run.exit_code == 0, run.output
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]

    # The folder PEFT writes itself, byte for byte in its config and bit for bit in its weights.
    job.model.save_pretrained(tmp_path / "by_peft")
    assert (tmp_path / "adapter/adapter_config.json").read_bytes() == (tmp_path / "by_peft/adapter_config.json").read_bytes()
    from safetensors.torch import load_file

    ours, theirs = load_file(tmp_path / "adapter/adapter_model.safetensors"), load_file(tmp_path / "by_peft/adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and all(bitwise_equal(ours[k], theirs[k]) for k in ours)

    batch = TOKENS[0]
    loaded = peft.PeftModel.from_pretrained(tiny_base(), tmp_path / "adapter")
    assert bitwise_equal(_outputs(loaded, batch), _outputs(job.model, batch))

    # Imported, from PEFT's folder and from the converted one (which keeps the base's digest).
    for source, digest in (("by_peft", None), ("adapter", base_model_digest(job.model))):
        run = CliRunner().invoke(app, ["import", str(tmp_path / source), str(tmp_path / f"imported_{source}"),
                                       "--from", "peft"])
        assert run.exit_code == 0, run.output
        assert verify_checkpoint(tmp_path / f"imported_{source}").ok
        fresh = lora(tiny_base(), modules_to_save=["ln_f"])
        resurgo.load({"model": AdapterOnly(fresh)}, tmp_path / f"imported_{source}")
        assert bitwise_equal(_outputs(fresh, batch), _outputs(job.model, batch))
        assert resurgo.load_dict(tmp_path / f"imported_{source}")["model"]["base_model_digest"] == digest
    with pytest.raises(BaseModelMismatchError):
        resurgo.load({"model": AdapterOnly(lora(tiny_base(seed=1), modules_to_save=["ln_f"]))},
                     tmp_path / "imported_adapter")

    # What is not there is named.
    with pytest.raises(NotACheckpointError, match="not a PEFT adapter folder"):
        resurgo.import_checkpoint(tmp_path / "ckpt", tmp_path / "nope", source="peft")
    resurgo.save({"model": tiny_base().state_dict()}, tmp_path / "whole")
    with pytest.raises(KeyMismatchError, match="holds no adapters saved adapter-only"):
        resurgo.convert(tmp_path / "whole", tmp_path / "nope", to="peft")


def test_resurgo_trainer_saves_lora_adapters_only_and_resumes_bit_identically(tmp_path):
    whole = make_trainer(tmp_path / "whole", save_steps=STEPS + 1, lora=True)
    whole.train()
    import resurgo.integrations.peft as peft_integration

    hashed = []
    real_digest = peft_integration._digest
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peft_integration, "_digest", lambda tensors: hashed.append(len(tensors)) or real_digest(tensors))
        first = make_trainer(tmp_path / "run", save_steps=3, stop=6, lora=True)
        first.train()
    assert len(hashed) == 1  # two saves, the base model hashed once (its weights did not change)
    checkpoint = tmp_path / "run" / "checkpoint-6"
    manifest = resurgo.read_manifest(checkpoint)
    assert manifest.metadata[hf_integration.ADAPTERS_KEY] is True
    assert sorted({".".join(k.split("@")[0].split(".")[:2]) for k in manifest.tensors}) == [
        "model.adapters", "optimizer.state", "rng.numpy", "rng.python", "rng.torch"]
    assert resurgo.load_dict(checkpoint)["model"]["base_model_digest"] == base_model_digest(first.model)

    resumed = make_trainer(tmp_path / "run", save_steps=3, lora=True)
    resumed.train(resume_from_checkpoint=True)
    losses = first.losses + resumed.losses
    assert len(losses) == STEPS and all(bitwise_equal(a, b) for a, b in zip(whole.losses, losses))
    assert first.trace + resumed.trace == whole.trace  # same batches, learning rates and RNG state after each step
    assert_same(trainable(resumed.model), trainable(whole.model))
    assert_same(optimizer_state(resumed.optimizer), optimizer_state(whole.optimizer))
    assert_same(resumed.model.state_dict(), whole.model.state_dict())

    # The newest checkpoint, as PEFT's own folder: the same outputs from a fresh base.
    resurgo.convert(tmp_path / "run" / f"checkpoint-{STEPS}", tmp_path / "adapter", to="peft")
    loaded = peft.PeftModel.from_pretrained(tiny_trainer_base(), tmp_path / "adapter")
    batch = Tokens().x[:4]
    assert bitwise_equal(_outputs(loaded, batch), _outputs(resumed.model, batch))


@pytest.mark.slow  # two more Trainer runs: kept out of the default suite's time budget
def test_a_trainer_checkpoint_of_a_whole_peft_model_still_resumes(tmp_path):
    """As ResurgoTrainer saved a PEFT model before it saved adapters alone: into the whole model."""
    whole = make_trainer(tmp_path / "whole", save_steps=STEPS + 1, lora=True)
    whole.train()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_integration, "is_peft_model", lambda model: False)
        mp.setattr(hf_integration, "model_state", lambda model, held: model)
        old = make_trainer(tmp_path / "old", save_steps=3, stop=6, lora=True)
        old.train()
    assert "model.base_model.model.transformer.wte.weight" in resurgo.read_manifest(tmp_path / "old/checkpoint-6").tensors
    again = make_trainer(tmp_path / "old", save_steps=3, lora=True)
    again.train(resume_from_checkpoint=True)
    assert all(bitwise_equal(a, b) for a, b in zip(whole.losses, old.losses + again.losses))
    assert_same(again.model.state_dict(), whole.model.state_dict())


def tiny_trainer_base() -> GPT2LMHeadModel:
    """make_trainer's base model, as it builds it."""
    from transformers import set_seed

    set_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8))


def _best_run(path: Path, *, resurgo: bool, lora: bool = False):
    # The "best" is the highest eval loss, so that it is an early checkpoint, not the last one.
    trainer = make_trainer(path, resurgo=resurgo, save_steps=3, save_total_limit=1, eval_dataset=Tokens(),
                           eval_strategy="steps", eval_steps=3, load_best_model_at_end=True,
                           metric_for_best_model="loss", greater_is_better=True, lora=lora)
    trainer.train()
    return trainer


def test_save_total_limit_1_with_load_best_model_at_end_deletes_nothing_but_through_resurgo(tmp_path, monkeypatch):
    # The plain Trainer deletes the last checkpoint when training ends, keeping only the best.
    plain = _best_run(tmp_path / "plain", resurgo=False)
    best = Path(plain.state.best_model_checkpoint).name
    assert best != f"checkpoint-{STEPS}" and os.listdir(tmp_path / "plain") == [best]

    import transformers.trainer as trainer_module

    removed: list = []
    real_rmtree = shutil.rmtree
    monkeypatch.setattr(trainer_module.shutil, "rmtree", lambda p, *a, **k: (removed.append(p), real_rmtree(p, *a, **k)))
    trainer = _best_run(tmp_path / "resurgo", resurgo=True, lora=True)
    assert Path(trainer.state.best_model_checkpoint).name == best and trainer.args.save_total_limit == 1
    # The best and the newest (which a resume needs) are kept; the others went through resurgo's
    # retention, each once a newer checkpoint was committed; the Trainer deleted nothing.
    assert sorted(os.listdir(tmp_path / "resurgo")) == sorted({best, f"checkpoint-{STEPS}"})
    assert removed == []
    for name in os.listdir(tmp_path / "resurgo"):
        assert verify_checkpoint(tmp_path / "resurgo" / name).ok
    # load_best_model_at_end loaded the best checkpoint's adapters.
    saved = resurgo.load_dict(tmp_path / "resurgo" / best)["model"]["adapters"]["default"]["weights"]
    current = peft.get_peft_model_state_dict(trainer.model)
    assert saved.keys() == current.keys() and all(bitwise_equal(saved[k], current[k]) for k in saved)
    # And the newest resumes: nothing left to train.
    resumed = make_trainer(tmp_path / "resurgo", save_steps=3, save_total_limit=1, lora=True)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == STEPS and resumed.losses == []


def test_resurgo_accelerator_saves_lora_adapters_only_and_resumes_bit_identically(tmp_path):
    from accelerate.utils import ProjectConfiguration, set_seed

    from resurgo.integrations.accelerate import ResurgoAccelerator

    def run(project: Path, steps: range, *, resume: bool = False) -> list:
        set_seed(0)
        model = lora(tiny_base())
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        accelerator = ResurgoAccelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True))
        model, opt = accelerator.prepare(model, opt)
        if resume:
            accelerator.load_state()
        record = []
        model.train()
        for step in steps:
            batch = TOKENS[step % len(TOKENS)]
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            record.append((loss.detach(), trainable(model), optimizer_state(opt)))
        accelerator.save_state()
        return record

    whole = run(tmp_path / "whole", range(4))
    first = run(tmp_path / "run", range(2))
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_0"
    assert {k.split(".")[0] for k in resurgo.read_manifest(checkpoint).tensors} == {"models", "optimizers", "rng"}
    assert all(".adapters.default.weights." in k for k in resurgo.read_manifest(checkpoint).tensors
               if k.startswith("models."))
    resumed = run(tmp_path / "run", range(2, 4), resume=True)
    for (loss_a, params_a, opt_a), (loss_b, params_b, opt_b) in zip(whole, first + resumed):
        assert bitwise_equal(loss_a, loss_b)
        assert_same(params_a, params_b)
        assert_same(opt_a, opt_b)
    assert fmt.FORMAT == resurgo.load_dict(checkpoint)["models"][0]["adapter_format"]


def test_several_adapters_convert_as_peft_lays_them_out_and_import_back(tmp_path):
    from resurgo.errors import ForeignFilesError

    model = lora(tiny_base())
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights=False))
    resurgo.save({"model": AdapterOnly(model)}, tmp_path / "ckpt")
    resurgo.convert(tmp_path / "ckpt", tmp_path / "adapters", to="peft")
    model.save_pretrained(tmp_path / "by_peft", selected_adapters=["default", "second"])
    for rel in ("adapter_config.json", "second/adapter_config.json"):
        assert (tmp_path / "adapters" / rel).read_bytes() == (tmp_path / "by_peft" / rel).read_bytes(), rel
    assert sorted(str(p.relative_to(tmp_path / "adapters")) for p in (tmp_path / "adapters").rglob("*")) == [
        "adapter_config.json", "adapter_model.safetensors", "second", "second/adapter_config.json",
        "second/adapter_model.safetensors"]

    resurgo.import_checkpoint(tmp_path / "by_peft", tmp_path / "imported", source="peft")
    fresh = lora(tiny_base())
    fresh.add_adapter("second", peft.LoraConfig(r=2, target_modules=["c_fc"]))
    resurgo.load({"model": AdapterOnly(fresh)}, tmp_path / "imported")
    assert_same(fresh.state_dict(), model.state_dict())

    # An overwrite replaces what a conversion wrote, and nothing else.
    resurgo.convert(tmp_path / "ckpt", tmp_path / "adapters", to="peft", overwrite=True)
    (tmp_path / "adapters" / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFilesError):
        resurgo.convert(tmp_path / "ckpt", tmp_path / "adapters", to="peft", overwrite=True)
    assert (tmp_path / "adapters" / "notes.txt").read_text() == "mine"
