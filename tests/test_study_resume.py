"""Resumable study runs (resurgo.study.resume): a run stopped after a unit of measurement and
started again measures only the units its journal lacks, and ends with the complete results; a
different configuration is refused, naming what differs; ``restart`` measures everything again."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from resurgo.api import load_dict
from resurgo.errors import StudyError
from resurgo.study.experiments import StudyConfig, count_units, run_study
from resurgo.study.frameworks import could_not_run, merge_framework
from resurgo.study.reference import check_report, require_reference_structure
from resurgo.study.report import render_markdown
from resurgo.study.resume import JOURNAL, config_differences
from resurgo.study.workers import driver
from test_study_frameworks import CONFIG as TOY_CONFIG
from test_study_frameworks import Toy

TINY = StudyConfig(models=("vgg16",), mechanisms=("torch_save", "resurgo"), width=4, batch_size=2, samples=16,
                   warmup_steps=1, cost_steps=2, checkpoint_every=1, cost_repeats=2, scale_worlds=(1,),
                   scale_models=("vgg16",), scale_steps=2, scale_every=1,
                   det_steps=4, det_restart=2, preset="tiny")
# the units of measurement, in the order they run: the pairs in rotated order, determinism, scale
UNITS = ["vgg16: cost, torch_save, pair 1", "vgg16: cost, resurgo, pair 1", "vgg16: cost, resurgo, pair 2",
         "vgg16: cost, torch_save, pair 2", "vgg16: determinism", "vgg16: scale, 1 ranks"]


class Stop(Exception):
    """Stands for the process being killed: raised as a unit starts."""


def _labels(stop_at: int | None = None) -> tuple[list[str], object]:
    seen: list[str] = []

    def on_progress(done: int, total: int, label: str) -> None:
        if label != "done":
            seen.append(label)
        if stop_at is not None and len(seen) > stop_at:
            raise Stop(label)

    return seen, on_progress


def _records(out: Path) -> dict:
    """Each recorded unit: its result and the bytes its checkpoints took."""
    state = load_dict(out / JOURNAL, collective=False)
    return {u["key"]: json.loads(u["result"]) for u in state["units"]}


def _journal(out: Path) -> dict:
    return {key: record["result"] for key, record in _records(out).items()}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """A tiny study stopped as its fourth unit starts, then run again: its output directory, its
    journal after the stop, the progress labels and steps of the second run, and its results."""
    out = tmp_path_factory.mktemp("resumed")
    _, on_progress = _labels(stop_at=3)  # stopped as the fourth progress step starts
    with pytest.raises(Stop):
        run_study(TINY, out, on_progress)
    recorded = _journal(out)
    assert not (out / "results.json").exists()
    second, on_progress = _labels()
    steps: list[tuple[int, int]] = []
    results = run_study(TINY, out, lambda d, t, label: (steps.append((d, t)), on_progress(d, t, label)))
    return {"out": out, "recorded": recorded, "second": second, "steps": steps, "results": results}


def test_a_stopped_study_resumes_after_its_last_completed_unit(resumed: dict):
    tmp_path, recorded, second, steps, results = (resumed[k] for k in ("out", "recorded", "second", "steps", "results"))
    assert list(recorded) == UNITS[:3]  # each completed unit was committed as it completed
    # the first three units are not measured again: only the fourth pair and determinism start
    assert second == ["vgg16: cost, torch_save (2/2)", "vgg16: determinism, uninterrupted run",
                      "vgg16: determinism, restart with torch_save", "vgg16: determinism, restart with resurgo",
                      "vgg16: scale, 1 rank"]
    assert steps[0] == (3, count_units(TINY)) and steps[-1] == (8, 8)  # progress counts the replayed steps
    assert list(_journal(tmp_path)) == UNITS
    # the results are complete, and hold the recorded measurements as they were measured
    by_mech = {r["mechanism"]: r for r in results["cost"]}
    assert by_mech["resurgo"]["runs"] == [recorded[UNITS[1]]["run"], recorded[UNITS[2]]["run"]]
    assert by_mech["torch_save"]["runs"][0] == recorded[UNITS[0]]["run"]
    assert [r["pairs"] for r in results["cost"]] == [2, 2] and len(results["formats"]) == 2
    assert list(results["determinism"]["vgg16"]["restarts"]) == ["torch_save", "resurgo"]
    assert [r["mechanism"] for r in results["scale"]] == ["torch_save", "resurgo"]
    assert results["journal"]["units_replayed"] == 3 and results["journal"]["units_measured"] == 3
    assert results["journal"]["sessions"] == 2

    # a third run replays everything, measures nothing, and gives the same results
    third, on_progress = _labels()
    again = run_study(TINY, tmp_path, on_progress)
    assert third == [] and again["cost"] == results["cost"] and again["determinism"] == results["determinism"]
    # the bytes written count the replayed units as the run that measured them counted them
    disk = {key: record["disk"]["written"] for key, record in _records(tmp_path).items()}
    cost = sum(d.get("cost", 0) for d in disk.values())
    assert cost > 0 and all(disk[u].get("cost", 0) > 0 for u in UNITS[:4])
    assert results["disk"]["written"]["cost"] == cost == again["disk"]["written"]["cost"]
    assert again["disk"] == results["disk"] and results["disk"]["total"] == sum(results["disk"]["written"].values())


def test_another_configuration_is_refused_and_restart_measures_again(tmp_path: Path):
    _, on_progress = _labels(stop_at=1)
    with pytest.raises(Stop):
        run_study(TINY, tmp_path, on_progress)
    other = replace(TINY, cost_steps=3, mechanisms=("resurgo",))
    with pytest.raises(StudyError, match=r"study-journal: this study was started with another configuration "
                                         r"\(mechanisms: recorded \[\"torch_save\", \"resurgo\"\], now \[\"resurgo\"\]; "
                                         r"cost_steps: recorded 2, now 3\); .*--restart"):
        run_study(other, tmp_path)
    seen, on_progress = _labels(stop_at=0)
    with pytest.raises(Stop):  # restart: the first unit starts again, though it was recorded
        run_study(TINY, tmp_path, on_progress, restart=True)
    assert seen == ["vgg16: cost, torch_save (1/2)"] and not (tmp_path / JOURNAL).exists()


def test_a_damaged_journal_is_named(tmp_path: Path):
    (tmp_path / JOURNAL).mkdir()
    (tmp_path / JOURNAL / "manifest.json").write_text("{")
    with pytest.raises(StudyError, match=r"study-journal: the study's journal cannot be read .*--restart"):
        run_study(TINY, tmp_path)


def test_config_differences_name_each_field():
    assert config_differences({"a": 1, "b": [1]}, {"a": 1, "b": [1]}) == []
    assert config_differences({"a": 1, "gone": 2}, {"a": 2, "new": 3}) == [
        "a: recorded 1, now 2", "new: recorded (absent), now 3", "gone: recorded 2, now (absent)"]


class _SameNet(Toy):
    """A framework in miniature whose network has PyTorch's parameter count (or ``delta`` more)."""

    def __init__(self, parameters: int) -> None:
        super().__init__(keeps_rng=False)
        self.count = parameters

    def parameters(self, job: dict) -> int:
        return self.count


def _reference_results(resumed: dict, tmp_path: Path) -> dict:
    """The tiny study's results with the three other frameworks beside PyTorch."""
    results = copy.deepcopy(resumed["results"])
    params = results["models"]["vgg16"]["parameters"]
    for name in ("tensorflow", "jax", "chainer"):
        worker = driver.run(_SameNet(params + (params // 2000 if name == "jax" else 0)),  # 0.05% more: allowed
                            {**TOY_CONFIG, "models": ["vgg16"]}, tmp_path / name, progress=lambda label: None)
        merge_framework(results, name, worker)
    return results


def test_the_reference_structure_check_passes_a_complete_report(resumed: dict, tmp_path: Path):
    report = render_markdown(_reference_results(resumed, tmp_path))
    assert check_report(report) == []
    path = tmp_path / "report.md"
    path.write_text(report)
    require_reference_structure(path)
    # the machine section: read from this machine
    machine = report[report.index("## Machine"):]
    assert f"| cores | {os.cpu_count()} |" in machine and "| date | 20" in machine and "torch " in machine


def test_the_reference_structure_check_names_each_broken_rule(resumed: dict, tmp_path: Path):
    results = _reference_results(resumed, tmp_path)
    good = render_markdown(results)
    params = results["models"]["vgg16"]["parameters"]

    def problems(doctored: dict | str) -> list[str]:
        return check_report(doctored if isinstance(doctored, str) else render_markdown(doctored))

    missing = copy.deepcopy(results)
    missing["frameworks"]["chainer"] = could_not_run("chainer", "pip failed")
    assert problems(missing) == ["framework Chainer: did not run (could not run: pip failed)",
                                 "Chainer VGG-16: no parameter count shown ('-')"]
    gone = copy.deepcopy(results)
    del gone["frameworks"]["jax"]
    assert "framework JAX/Orbax: no row in the frameworks table" in problems(gone)
    bigger = copy.deepcopy(results)
    bigger["frameworks"]["tensorflow"]["models"]["vgg16"]["parameters"] = params + params // 500  # 0.2% more
    assert problems(bigger) == [f"VGG-16: TensorFlow has {params + params // 500:,} parameters, PyTorch {params:,}: "
                                "more than 0.1% apart"]
    first = results["cost"][0]
    shown = f"| {first['overhead_pct']:+.1f} [{first['overhead_low_pct']:+.1f}, {first['overhead_high_pct']:+.1f}]"
    bare = good.replace(shown, f"| {first['overhead_pct']:+.1f}", 1)  # the first overhead without its interval
    assert len(problems(bare)) == 1 and "shows no interval for its overhead" in problems(bare)[0]
    assert problems(good.replace("**Findings.**", "Findings:", 1)) == [
        "section '## 1. Cost of checkpointing' has no findings ('**Findings.**' paragraph)"]
    no_scale = copy.deepcopy(results)
    no_scale["scale"] = []
    assert problems(no_scale) == ["3. Scale: no table with an 'overhead %' column"]
    assert problems(good.replace("| CPU |", "| processor |")) == ["machine: no CPU"]
    assert problems(good[:good.index("## Machine")]) == [
        "no section '## Machine' (CPU, cores, memory, disk, library versions, date)"]
    with pytest.raises(StudyError, match=r"report.md: not a complete reference report: machine: no CPU"):
        (tmp_path / "report.md").write_text(good.replace("| CPU |", "| processor |"))
        require_reference_structure(tmp_path / "report.md")


def test_the_reference_preset_and_its_options(tmp_path: Path):
    from typer.testing import CliRunner

    from resurgo.cli import app
    from resurgo.cli.study import _study_config
    from resurgo.study.reference import reference_config

    cfg = reference_config()
    cfg.check()
    assert (cfg.width, cfg.batch_size, cfg.cost_repeats, cfg.scale_worlds) == (64, 2, 6, (1, 2, 4))
    assert cfg.frameworks == ("tensorflow", "jax", "chainer") and cfg.models == ("resnet50", "vgg16")
    assert _study_config(False, True, None, None, None, None, None, None, None, None, None) == cfg
    result = CliRunner().invoke(app, ["study", "--quick", "--reference", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--quick and --reference are two presets: choose one" in result.output
    assert list(tmp_path.iterdir()) == []
