"""Resumable study runs (resurgo.study.resume): a run stopped after a unit of measurement and
started again measures only the units its journal lacks, and ends with the complete results; a
different configuration is refused, naming what differs; ``restart`` measures everything again."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from resurgo.api import load_dict
from resurgo.errors import StudyError
from resurgo.study.experiments import StudyConfig, count_units, run_study
from resurgo.study.resume import JOURNAL, config_differences

TINY = StudyConfig(models=("vgg16",), mechanisms=("torch_save", "resurgo"), width=4, batch_size=2, samples=16,
                   warmup_steps=1, cost_steps=2, checkpoint_every=1, cost_repeats=2, scale_worlds=(),
                   det_steps=4, det_restart=2, preset="tiny")
# the units of measurement, in the order they run: the pairs in rotated order, then determinism
UNITS = ["vgg16: cost, torch_save, pair 1", "vgg16: cost, resurgo, pair 1", "vgg16: cost, resurgo, pair 2",
         "vgg16: cost, torch_save, pair 2", "vgg16: determinism"]


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


def _journal(out: Path) -> dict:
    state = load_dict(out / JOURNAL, collective=False)
    return {u["key"]: json.loads(u["result"]) for u in state["units"]}


def test_a_stopped_study_resumes_after_its_last_completed_unit(tmp_path: Path):
    first, on_progress = _labels(stop_at=3)  # stopped as the fourth progress step starts
    with pytest.raises(Stop):
        run_study(TINY, tmp_path, on_progress)
    recorded = _journal(tmp_path)
    assert list(recorded) == UNITS[:3]  # each completed unit was committed as it completed
    assert not (tmp_path / "results.json").exists()

    second, on_progress = _labels()
    steps: list[tuple[int, int]] = []
    results = run_study(TINY, tmp_path, lambda d, t, label: (steps.append((d, t)), on_progress(d, t, label)))
    # the first three units are not measured again: only the fourth pair and determinism start
    assert second == ["vgg16: cost, torch_save (2/2)", "vgg16: determinism, uninterrupted run",
                      "vgg16: determinism, restart with torch_save", "vgg16: determinism, restart with resurgo"]
    assert steps[0] == (3, count_units(TINY)) and steps[-1] == (7, 7)  # progress counts the replayed steps
    assert list(_journal(tmp_path)) == UNITS
    # the results are complete, and hold the recorded measurements as they were measured
    by_mech = {r["mechanism"]: r for r in results["cost"]}
    assert by_mech["resurgo"]["runs"] == [recorded[UNITS[1]]["run"], recorded[UNITS[2]]["run"]]
    assert by_mech["torch_save"]["runs"][0] == recorded[UNITS[0]]["run"]
    assert [r["pairs"] for r in results["cost"]] == [2, 2] and len(results["formats"]) == 2
    assert list(results["determinism"]["vgg16"]["restarts"]) == ["torch_save", "resurgo"]
    assert results["journal"]["units_replayed"] == 3 and results["journal"]["units_measured"] == 2
    assert results["journal"]["sessions"] == 2

    # a third run replays everything, measures nothing, and gives the same results
    third, on_progress = _labels()
    again = run_study(TINY, tmp_path, on_progress)
    assert third == [] and again["cost"] == results["cost"] and again["determinism"] == results["determinism"]


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
