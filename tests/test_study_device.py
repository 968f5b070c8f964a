"""Where the study's PyTorch jobs train (``--device``): the option's checks, the GPU of each scale
rank, the deterministic kernels a GPU run uses, and (on a CUDA machine) a tiny study on the GPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from resurgo.cli import app
from resurgo.errors import StudyError
from resurgo.study.experiments import StudyConfig, deterministic_kernels, rank_device, run_study
from resurgo.study.report import render_markdown
from resurgo.study.training import JobSpec, build_training, train_steps
from resurgo.study.data import make_dataset

TINY = StudyConfig(models=("vgg16",), mechanisms=("torch_save", "resurgo"), width=4, batch_size=2, samples=16,
                   warmup_steps=1, cost_steps=2, checkpoint_every=1, cost_repeats=2, scale_worlds=(1,),
                   scale_models=("vgg16",), scale_steps=2, scale_every=1, det_steps=4, det_restart=2, preset="tiny")


def test_an_unknown_device_or_a_missing_gpu_is_refused(monkeypatch, tmp_path: Path):
    with pytest.raises(StudyError, match=r"unknown device 'tpu'; expected cpu or cuda"):
        replace(TINY, device="tpu").check()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StudyError, match=r"--device cuda: this torch sees no CUDA device"):
        replace(TINY, device="cuda").check()
    result = CliRunner().invoke(app, ["study", "--quick", "--device", "cuda", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "--device cuda: this torch sees no CUDA device" in result.output
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_scale_ranks_share_out_the_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device("cuda", r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert rank_device("cpu", 3) == "cpu"


def test_a_gpu_run_uses_deterministic_kernels_and_restores_the_flags():
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.are_deterministic_algorithms_enabled())
    assert before == (False, False, False)  # the suite's default (conftest restores them after each test)
    with deterministic_kernels("cpu"):
        assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels("cuda"):  # sets flags only: no GPU needed
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled()) == before


def test_the_job_trains_where_its_spec_says():
    job = build_training(JobSpec("vgg16", 4, 2, 0, "cpu"), make_dataset(8, None))
    assert {p.device.type for p in job.model.parameters()} == {"cpu"}
    assert len(train_steps(job, 2)) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_tiny_study_on_the_gpu(tmp_path: Path):
    results = run_study(replace(TINY, device="cuda"), tmp_path)
    assert results["config"]["device"] == "cuda" and results["environment"]["gpu"]
    restarts = results["determinism"]["vgg16"]["restarts"]
    assert restarts["resurgo"]["identical"] and restarts["resurgo"]["restored_step"] == TINY.det_restart
    assert [r["mechanism"] for r in results["scale"]] == ["torch_save", "resurgo"]
    assert "PyTorch on " + results["environment"]["gpu"] in render_markdown(results)
