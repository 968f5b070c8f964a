"""``resurgo gc`` reads every ``step_<digits>`` checkpoint that ``resurgo ls`` lists, whatever its
padding, while the manager reads only its own ``step_000000123`` names; and the README's first
quick start, run as written, leaves checkpoints that ``gc`` prunes to exactly the newest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.manager.catalog import COMMITTED, CORRUPT, TEMPORARY, checkpoint_name, scan, step_in_name, step_of

from doc_snippets import TRAINING_PRELUDE, snippets

runner = CliRunner()


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(8, 4, generator=g), "step": step}


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _gc(root: Path, *args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["gc", str(root), "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_step_in_name_reads_any_padding_and_nothing_else():
    assert [step_in_name(n) for n in ("step_0", "step_300", "step_00000300", "step_000000300", "step_0300")] == \
        [0, 300, 300, 300, 300]
    not_steps = ["step_", "step_-1", "step_+1", "step_1 ", " step_1", "step_1\n", "step_1.0", "step_1a", "Step_1",
                 "step__1", "step_\u0661\u0662", "steps_1", ".step_1.resurgo-tmp-abc"]
    assert [step_in_name(n) for n in not_steps] == [None] * len(not_steps)
    # the manager's own parser is unchanged: one name per step
    assert step_of("step_000000300") == 300 and step_of("step_300") is None and step_of("step_00000300") is None


def test_the_readme_quick_start_as_written_then_gc_keeps_exactly_the_newest(tmp_path, monkeypatch):
    readme = [s for s in snippets() if s.file.name == "README.md"]
    first = readme[0]
    assert first.context == "kill-resume" and 'resurgo.save(state, f"ckpt/step_' in first.code, first.code
    monkeypatch.chdir(tmp_path)
    exec(compile(TRAINING_PRELUDE + first.code, first.name, "exec"), {"__name__": "__doc_snippet__"})
    ckpt = tmp_path / "ckpt"
    saved = [checkpoint_name(s) for s in (100, 200, 300)]  # 320 steps, a save every 100
    assert _names(ckpt) == saved

    listed = runner.invoke(app, ["ls", str(ckpt), "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(c["path"], c["status"], c["step"]) for c in json.loads(listed.stdout)["checkpoints"]] == \
        [(n, COMMITTED, s) for n, s in zip(saved, (100, 200, 300))]

    result = runner.invoke(app, ["gc", str(ckpt), "--keep-last", "1"])
    assert result.exit_code == 0, result.output
    assert "deleted 2 of 3" in result.stdout
    assert _names(ckpt) == [checkpoint_name(300)]
    assert resurgo.load_dict(ckpt / checkpoint_name(300))["step"] == 300  # what is kept still loads


@pytest.mark.parametrize("width", [None, 8, 9, 12])
def test_gc_prunes_step_names_of_any_padding(tmp_path, width):
    for s in (100, 200, 300):
        name = f"step_{s}" if width is None else f"step_{s:0{width}d}"
        resurgo.save(_state(s), tmp_path / name)
    before = _names(tmp_path)
    code, plan = _gc(tmp_path, "--keep-last", "1", "--dry-run")
    assert code == 0
    assert [(i["path"], i["step"], i["status"], i["action"]) for i in plan["items"]] == \
        [(before[0], 100, COMMITTED, "delete"), (before[1], 200, COMMITTED, "delete"), (before[2], 300, COMMITTED, "keep")]
    assert _names(tmp_path) == before  # a dry run
    code, _ = _gc(tmp_path, "--keep-last", "1")
    assert code == 0 and _names(tmp_path) == [before[2]]


def test_gc_on_a_root_of_mixed_names_leaves_what_is_no_step_alone(tmp_path):
    resurgo.save(_state(1), tmp_path / "step_1")
    resurgo.save(_state(2), tmp_path / "step_00000002")
    resurgo.save(_state(3), tmp_path / checkpoint_name(3))
    for other in ("step_4a", "steps_5", "step_\u0666", "final"):  # checkpoints to ls, but no step names
        resurgo.save(_state(9), tmp_path / other)
    (tmp_path / ".step_7.resurgo-tmp-abcdefabcdef" / "data").mkdir(parents=True)  # an interrupted save of step_7
    (tmp_path / ".final.resurgo-tmp-abcdefabcdef" / "data").mkdir(parents=True)  # of no step: not gc's

    code, plan = _gc(tmp_path, "--keep-last", "1", "--stale-after", "0")
    assert code == 0
    assert [(i["path"], i["step"], i["status"], i["action"]) for i in plan["items"]] == [
        ("step_1", 1, COMMITTED, "delete"), ("step_00000002", 2, COMMITTED, "delete"),
        (checkpoint_name(3), 3, COMMITTED, "keep"), (".step_7.resurgo-tmp-abcdefabcdef", 7, TEMPORARY, "delete")]
    assert _names(tmp_path) == sorted([".final.resurgo-tmp-abcdefabcdef", "final", checkpoint_name(3), "step_4a",
                                       "step_\u0666", "steps_5"])


def test_a_step_name_without_a_recorded_step_is_that_step_and_a_contradicting_one_is_corrupt(tmp_path):
    resurgo.save({"w": torch.ones(3)}, tmp_path / "step_10")  # nothing records a step: the name's is its step
    resurgo.save(_state(30), tmp_path / "step_20")  # the manifest says 30, the name 20
    resurgo.save(_state(40), tmp_path / "step_40")
    assert resurgo.read_manifest(tmp_path / "step_10").step is None
    code, plan = _gc(tmp_path, "--keep-last", "1")
    assert code == 3  # a damaged checkpoint was found (and kept)
    items = {i["path"]: (i["step"], i["status"], i["action"]) for i in plan["items"]}
    assert items == {"step_10": (10, COMMITTED, "delete"), "step_20": (20, CORRUPT, "keep"),
                     "step_40": (40, COMMITTED, "keep")}
    corrupt = next(i for i in plan["items"] if i["path"] == "step_20")
    assert "gc never removes it" in corrupt["reason"]
    assert _names(tmp_path) == ["step_20", "step_40"]
    # the manager reads its own names only: none of these is one of its checkpoints
    assert scan(tmp_path) == [] and [e.step for e in scan(tmp_path, any_padding=True)] == [20, 40]


def test_two_checkpoints_of_one_step_are_both_kept_and_count_for_no_rule(tmp_path):
    for name, s in [("step_3", 3), ("step_5", 5), (checkpoint_name(5), 5), ("step_7", 7), ("step_9", 9)]:
        resurgo.save(_state(s), tmp_path / name)
    code, plan = _gc(tmp_path, "--keep-last", "2")
    assert code == 0
    items = {i["path"]: i["action"] for i in plan["items"]}
    # keep_last 2 counts steps 3, 7 and 9: step 5 has two checkpoints, kept whatever the rules say
    assert items == {"step_3": "delete", "step_5": "keep", checkpoint_name(5): "keep", "step_7": "keep",
                     "step_9": "keep"}
    reasons = {i["path"]: i["reason"] for i in plan["items"]}
    assert reasons["step_5"].startswith(f"step 5 is also the step of {checkpoint_name(5)}: gc keeps both")
    assert reasons[checkpoint_name(5)].startswith("step 5 is also the step of step_5: gc keeps both")
    assert _names(tmp_path) == sorted(["step_5", checkpoint_name(5), "step_7", "step_9"])
