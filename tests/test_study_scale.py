"""The scale experiment beside PyTorch (resurgo.study.framework_scale, workers/scale_driver.py):
the launch's pure logic (ports, TF_CONFIG, coordinator, mpiexec), a group bounded in time and
ended whole, the slowest rank's merge, the "could not run" wording, the report's lines, and the
driver's paired runs on a toy framework; under the ``frameworks`` marker, each real framework on
1 and 2 processes in its environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from resurgo.errors import StudyError
from resurgo.study import framework_scale as fs
from resurgo.study import frameworks as fwmod
from resurgo.study.experiments import quick_config
from resurgo.study.frameworks import FRAMEWORKS, ensure_scale_env, env_key
from resurgo.study.report import _scale_section
from resurgo.study.stats import pair_timings
from resurgo.study.workers import scale_driver

CFG = quick_config(scale_worlds=(1, 2), cost_repeats=2)


def test_free_ports_are_distinct_and_bindable():
    ports = fs.free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_tf_config_names_every_worker_and_this_one():
    assert json.loads(fs.tf_config([1001, 1002], 1)) == {
        "cluster": {"worker": ["127.0.0.1:1001", "127.0.0.1:1002"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(StudyError, match=r"TF_CONFIG: worker index 2 is outside the cluster of 2 workers"):
        fs.tf_config([1001, 1002], 2)


def test_launch_commands_per_framework(tmp_path: Path):
    py = tmp_path / "env" / "bin" / "python"
    tf = fs.launch_commands("tensorflow", py, 3, tmp_path / "c.json", tmp_path / "out", ports=[11, 12, 13])
    assert [p.argv for p in tf] == [[str(py), str(fs.SCALE_DRIVER), "tensorflow", str(tmp_path / "c.json"),
                                     str(tmp_path / "out")]] * 3
    assert [json.loads(p.env["TF_CONFIG"])["task"]["index"] for p in tf] == [0, 1, 2]
    assert {json.dumps(json.loads(p.env["TF_CONFIG"])["cluster"]) for p in tf} == {
        json.dumps({"worker": ["127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"]})}
    assert [p.log.name for p in tf] == ["rank-0.log", "rank-1.log", "rank-2.log"]
    jax = fs.launch_commands("jax", py, 2, tmp_path / "c.json", tmp_path / "out", ports=[4242])
    assert [p.env for p in jax] == [
        {"RESURGO_SCALE_RANK": str(r), "RESURGO_SCALE_WORLD": "2", "RESURGO_SCALE_COORDINATOR": "127.0.0.1:4242"}
        for r in range(2)]
    (mpi,) = fs.launch_commands("chainer", py, 4, tmp_path / "c.json", tmp_path / "out")
    assert mpi.argv[:3] == [str(py.parent / "mpiexec"), "-n", "4"]
    assert mpi.argv[4:6] == [str(fs.SCALE_DRIVER), "chainer"]
    with pytest.raises(StudyError, match="no scale launch for framework 'mxnet'"):
        fs.launch_commands("mxnet", py, 1, tmp_path / "c.json", tmp_path / "out", ports=[1])
    cfg = fs.scale_config({"models": ["vgg16"], "seed": 0}, CFG, "vgg16")
    assert cfg == {"models": ["vgg16"], "seed": 0, "model": "vgg16", "scale_steps": 2, "scale_every": 2}


def _proc(tmp_path: Path, code: str, rank: int) -> fs.Process:
    return fs.Process([sys.executable, "-c", code], {"RESURGO_SCALE_RANK": str(rank)}, tmp_path / f"rank-{rank}.log")


def test_a_failing_process_ends_the_group_with_its_command_and_error_line(tmp_path: Path):
    pid_file = tmp_path / "pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    t0 = time.monotonic()
    with pytest.raises(StudyError, match=r"`.* -c import sys; sys.exit\('no peer'\)` \(rank 1\) exited with "
                                         r"status 1: no peer$"):
        fs.run_group([_proc(tmp_path, sleeper, 0), _proc(tmp_path, "import sys; sys.exit('no peer')", 1)],
                     dict(os.environ), timeout_s=60)
    assert time.monotonic() - t0 < 30  # ended at once, not at the deadline
    with pytest.raises(ProcessLookupError):  # the other process of the group was killed
        os.kill(int(pid_file.read_text()), 0)


def test_a_group_past_its_deadline_is_ended_and_says_so(tmp_path: Path):
    code = "import time; print('joining the job', flush=True); time.sleep(60)"
    with pytest.raises(StudyError, match=r"still running after 1 s \(rank 0, rank 1\); the group was ended\. "
                                         r"Last line of rank-0.log: joining the job"):
        fs.run_group([_proc(tmp_path, code, 0), _proc(tmp_path, code, 1)], dict(os.environ), timeout_s=1)
    fs.run_group([_proc(tmp_path, "pass", 0)], dict(os.environ), timeout_s=30)  # a group that succeeds returns


SIGTERMED = """
import os, sys, time
from pathlib import Path
from resurgo.cli.study import terminated_as_exit
from resurgo.dist.launch import run_ranks
from resurgo.study import framework_scale as fs

out, kind = Path(sys.argv[1]), sys.argv[2]
with terminated_as_exit():
    if kind == "group":
        sleeper = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
        fs.run_group([fs.Process([sys.executable, "-c", sleeper, str(out / f"pid{r}")], {}, out / f"log{r}")
                      for r in range(2)], dict(os.environ), timeout_s=600)
    else:
        run_ranks(2, "sleeping_rank:main", str(out), sys_path=[str(out)])
"""

SLEEPING_RANK = """
import os, time
from pathlib import Path


def main(rank, world, out):
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["group", "ranks"])
def test_sigterm_ends_the_study_with_every_process_it_started(kind: str, tmp_path: Path):
    """A study told to stop (SIGTERM, as a batch system or `kill` does) exits with 143 and leaves
    none of its framework processes or spawned ranks running: each would otherwise train on,
    orphaned, for minutes."""
    (tmp_path / "sleeping_rank.py").write_text(SLEEPING_RANK)
    study = subprocess.Popen([sys.executable, "-c", SIGTERMED, str(tmp_path), kind])
    pids = [tmp_path / "pid0", tmp_path / "pid1"]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in pids):
        assert time.monotonic() < deadline and study.poll() is None, "the processes never started"
        time.sleep(0.1)
    children = [int(p.read_text()) for p in pids]
    study.terminate()
    assert study.wait(timeout=60) == 143
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _rank(rank: int, world: int, pairs: list[dict]) -> dict[str, Any]:
    return {"framework": "jax", "rank": rank, "world": world, "model": "vgg16", "mechanism": "orbax_async",
            "label": "JAX Orbax", "how": "gloo", "versions": {}, "pairs": pairs, "duration_s": 1.0}


def _pair(base: float, secs: float, stalls: list[float]) -> dict[str, Any]:
    return {"baseline_s": base, "seconds": secs, "checkpoints": len(stalls), "stall_s": stalls}


def test_merge_takes_the_slowest_rank_of_each_pair(tmp_path: Path):
    ranks = [_rank(0, 2, [_pair(1.0, 3.0, [0.5]), _pair(2.0, 2.5, [0.1])]),
             _rank(1, 2, [_pair(1.5, 2.0, [0.0]), _pair(1.0, 2.6, [0.2])])]
    for r in ranks:
        (tmp_path / f"rank-{r['rank']}.json").write_text(json.dumps(r))
    row = fs.merge_ranks("jax", 2, tmp_path, CFG)
    assert row["runs"] == [_pair(1.5, 3.0, [0.5]), _pair(2.0, 2.6, [0.2])]
    assert (row["written_bytes"], row["run_bytes"]) == (0, 0)  # (these ranks counted nothing)
    ranks[0]["pairs"][0]["written_bytes"], ranks[0]["pairs"][1]["written_bytes"] = 300, 200
    (tmp_path / "rank-0.json").write_text(json.dumps(ranks[0]))
    row = fs.merge_ranks("jax", 2, tmp_path, CFG)
    assert (row["written_bytes"], row["run_bytes"]) == (500, 300)
    # the framework's disk ledger gets them: written per experiment, total, the most on disk at once
    def ledger() -> dict:
        return {"written": {"cost": 1000, "formats": 500, "determinism": 100}, "total": 1600, "peak": 250}

    results = {"scale": [], "frameworks": {"jax": {"label": "JAX/Orbax", "ran": True, "disk": ledger()}}}
    fs.add_framework_scale(results, "jax", {"rows": [row, {**row, "ranks": 1, "written_bytes": 40,
                                                           "run_bytes": 20}], "failures": {}})
    assert results["frameworks"]["jax"]["disk"] == {"written": {"cost": 1000, "formats": 500, "determinism": 100,
                                                                "scale": 540}, "total": 2140, "peak": 300}
    old_journal = {"label": "JAX/Orbax", "ran": True, "disk": ledger()}
    results = {"scale": [], "frameworks": {"jax": old_journal}}
    fs.add_framework_scale(results, "jax", {"rows": [{k: v for k, v in row.items() if not k.endswith("_bytes")}],
                                            "failures": {}})
    assert "scale" not in old_journal["disk"]["written"]  # rows of an older run: not counted, not 0
    assert (row["framework"], row["ranks"], row["global_batch"]) == ("jax", 2, 4)
    assert (row["pairs"], row["checkpoints"]) == (2, 1)
    assert row["stall_s"] == [0.5, 0.2] and row["extra_s"] == pytest.approx(1.05)
    (tmp_path / "rank-1.json").unlink()
    with pytest.raises(StudyError, match=r"rank-1.json: rank 1 of 2 wrote no result"):
        fs.merge_ranks("jax", 2, tmp_path, CFG)
    with pytest.raises(StudyError, match=r"the ranks measured different numbers of pairs: \[1, 2\]"):
        fs.slowest_pairs([ranks[0], _rank(1, 2, [_pair(1.0, 2.0, [0.1])])])
    with pytest.raises(StudyError, match="pair 0: the ranks saved different numbers of checkpoints"):
        fs.slowest_pairs([_rank(0, 2, [_pair(1.0, 2.0, [0.1])]), _rank(1, 2, [_pair(1.0, 2.0, [])])])


def test_status_says_what_ran_and_exactly_why_the_rest_did_not():
    rows = [{"ranks": 1, "how": "gloo"}, {"ranks": 2, "how": "gloo"}]
    assert fs.scale_status(rows, {}) == "ran on 1, 2 processes (gloo)"
    assert fs.scale_status(rows[:1], {4: "`mpiexec -n 4 x` (mpiexec) exited with status 1: boom"}) == (
        "ran on 1 process (gloo); could not run on 4 processes: `mpiexec -n 4 x` (mpiexec) exited with status 1: boom")
    assert fs.scale_status([], {}) == "not run: no process counts were given"


def test_a_framework_that_cannot_start_is_recorded_per_world_size(tmp_path: Path, monkeypatch):
    # this Python has no tensorflow: each group fails as in an environment where the import breaks
    monkeypatch.setattr(fwmod, "ensure_scale_env", lambda name, root=None, log=None: Path(sys.executable))
    results: dict[str, Any] = {"scale": [], "frameworks": {"tensorflow": {"label": "TensorFlow", "ran": True}}}
    fs.add_framework_scale(results, "tensorflow", json.loads(json.dumps(fs.measure_framework_scale("tensorflow", CFG,
                                                                                                   tmp_path))))
    entry = results["frameworks"]["tensorflow"]
    assert results["scale"] == [] and list(entry["scale_failures"]) == ["1", "2"]
    assert entry["scale"].startswith("could not run on 1 process: `") and entry["scale"].endswith(
        "(rank 0) exited with status 1: ModuleNotFoundError: No module named 'tensorflow'")
    assert "; could not run on 2 processes: `" in entry["scale"]
    assert not list(tmp_path.rglob("checkpoints"))
    # an environment whose scale installs fail: every world size says so, nothing is launched
    def no_env(name: str, root: Any = None, log: Any = None) -> Path:
        raise StudyError("Chainer environment /e: `pip install --quiet mpi4py==4.1.2 mpich==5.0.2` failed: ERROR: x")

    monkeypatch.setattr(fwmod, "ensure_scale_env", no_env)
    rows, failures = fs.run_framework_scale("chainer", CFG, tmp_path)
    assert rows == [] and set(failures) == {1, 2} and failures[2].endswith("failed: ERROR: x")


def test_scale_installs_are_added_once_and_a_failure_keeps_the_environment(tmp_path: Path, monkeypatch):
    env = tmp_path / env_key(FRAMEWORKS["chainer"])
    env.mkdir()
    (env / fwmod.READY).write_text("{}")
    calls: list[list[str]] = []

    def pip(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1 if len(calls) == 1 else 0, "", "ERROR: No matching distribution "
                                           "found for mpich==5.0.2\n")

    monkeypatch.setattr(subprocess, "run", pip)
    with pytest.raises(StudyError, match=r"Chainer environment .*: `pip install --quiet mpi4py==4.1.2 mpich==5.0.2` "
                                         r"failed: ERROR: No matching distribution found for mpich==5.0.2"):
        ensure_scale_env("chainer", tmp_path)
    assert (env / fwmod.READY).is_file()  # the other experiments keep their environment
    assert ensure_scale_env("chainer", tmp_path) == env / "bin" / "python"
    assert ensure_scale_env("chainer", tmp_path) == env / "bin" / "python"  # recorded: no second install
    assert len(calls) == 2 and calls[1][-2:] == ["mpi4py==4.1.2", "mpich==5.0.2"]
    jax = tmp_path / env_key(FRAMEWORKS["jax"])
    jax.mkdir()
    (jax / fwmod.READY).write_text("{}")
    assert ensure_scale_env("jax", tmp_path) == jax / "bin" / "python" and len(calls) == 2  # nothing to add


def _row(framework: str, ranks: int, wall: float) -> dict[str, Any]:
    pairs = [_pair(1.0, 1.5, [0.2]), _pair(1.1, 1.4, [0.3])]
    return {"framework": framework, "model": "vgg16", "ranks": ranks, "mechanism": "orbax_async",
            "label": "JAX Orbax CheckpointManager (async)", "how": "gloo", "global_batch": 2 * ranks,
            "wall_s": wall, **pair_timings(pairs)}


def test_report_shows_the_frameworks_rows_wall_times_and_failures():
    failure = "`mpiexec -n 2 python scale_driver.py chainer c o` (mpiexec) exited with status 1: boom"
    results = {"config": {**CFG.__dict__, "scale_worlds": [1, 2]}, "environment": {"cpu_count": 2},
               "scale": [_row("jax", 1, 31.4), _row("jax", 2, 52.6)],
               "frameworks": {"jax": {"label": "JAX/Orbax", "scale": fs.scale_status([_row("jax", 1, 0)], {})},
                              "chainer": {"label": "Chainer", "scale": fs.scale_status([], {2: failure})}}}
    text = "\n".join(_scale_section(results))
    assert text.count("| VGG-16 | 1 | 2 | JAX Orbax CheckpointManager (async) |") == 1
    assert "| VGG-16 | 2 | 4 | JAX Orbax CheckpointManager (async) |" in text
    assert "- JAX/Orbax: ran on 1 process (gloo). Wall time per group: 1 process 31 s, 2 processes 53 s." in text
    assert f"- Chainer: could not run on 2 processes: {failure}." in text


class ToyDist:
    rank, world, how = 0, 1, "alone"

    def __init__(self) -> None:
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1


class ToyScale:
    """A framework's scale module in miniature: a job counts steps; a checkpoint writes a file."""

    MECHANISM, LABEL = "toy", "Toy save"

    def __init__(self) -> None:
        self.saved: list[int] = []

    def versions(self) -> dict:
        return {"toy": "1.0"}

    def build(self, model: str, config: dict, dist: Any) -> dict:
        return {"step": 0}

    def train(self, job: dict, steps: int, on_step: Any = None) -> list[float]:
        for _ in range(steps):
            job["step"] += 1
            if on_step is not None:
                on_step(job["step"])
        return [0.0] * steps

    def Checkpointer(self, directory: Path, dist: Any) -> Any:  # noqa: N802 - the driver's name for it
        toy = self

        class Ckpt:
            def save(self, job: dict, step: int) -> None:  # keeps only its last checkpoint, of 10 bytes a step
                directory.mkdir(parents=True, exist_ok=True)
                for old in directory.iterdir():
                    old.unlink()
                (directory / f"{step}.bin").write_bytes(b"x" * 10 * step)
                toy.saved.append(step)

            def wait(self) -> None:
                pass

            def close(self) -> None:
                pass

        return Ckpt()


def test_driver_pairs_runs_in_step_and_removes_the_checkpoints(tmp_path: Path):
    config = {"model": "vgg16", "scale_steps": 4, "scale_every": 2, "warmup_steps": 1, "cost_repeats": 3,
              "batch_size": 2, "seed": 0}
    sc, dist = ToyScale(), ToyDist()
    pairs = scale_driver.paired_runs(sc, dist, config, tmp_path)
    assert len(pairs) == 3 and all(p["checkpoints"] == 2 and len(p["stall_s"]) == 2 for p in pairs)
    assert all(p["seconds"] > 0 and p["baseline_s"] > 0 for p in pairs)
    # warm-up 1, then per pair 4 steps without and 4 with a checkpoint every 2
    assert sc.saved == [7, 9, 15, 17, 23, 25] and dist.barriers == 3 * 3 + 1
    assert list(tmp_path.iterdir()) == []
    # every checkpoint's bytes, the ones the mechanism pruned itself included
    assert [p["written_bytes"] for p in pairs] == [160, 320, 480]
    dist.rank = 1  # another rank: rank 0 counts the shared directory
    assert [p["written_bytes"] for p in scale_driver.paired_runs(sc, dist, config, tmp_path)] == [0, 0, 0]
    with pytest.raises(ValueError, match=r"scale config: missing \['scale_every'\]"):
        scale_driver.check_scale_config({k: v for k, v in config.items() if k != "scale_every"})


def test_scale_modules_import_only_the_standard_library_and_their_framework():
    import ast

    from test_study_frameworks import STDLIB, WORKERS

    def _imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return names | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    expected = {"scale_driver": {"driver", "disk"}, "scale_tensorflow": {"tensorflow", "tensorflow_worker"},
                "scale_jax": {"jax", "numpy", "jax_worker"}, "scale_chainer": {"chainermn", "chainer_worker"}}
    for module, packages in expected.items():
        assert _imports(WORKERS / f"{module}.py") - STDLIB - {"mpi4py"} == packages, module
    assert {p.stem for p in WORKERS.glob("scale_*.py")} == set(expected)
    assert set(FRAMEWORKS) == {m.removeprefix("scale_") for m in expected if m != "scale_driver"}
    assert all("==" in pin for fw in FRAMEWORKS.values() for pin in fw.scale_installs)


# -- the real frameworks, each in its environment: pytest -m frameworks ---------------------------------
@pytest.mark.frameworks
@pytest.mark.timeout(1800)  # two groups of processes, each bounded by its own 600 s deadline
@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_framework_scales_to_two_processes(name: str, tmp_path: Path):
    cfg = replace(quick_config(), width=4, samples=16, warmup_steps=1, scale_steps=2, scale_every=1, cost_repeats=2,
                  scale_worlds=(1, 2), scale_models=("vgg16",))
    results: dict[str, Any] = {"scale": [], "frameworks": {name: {"label": FRAMEWORKS[name].label, "ran": True,
                                                                   "disk": {"written": {}, "total": 0, "peak": 0}}}}
    fs.add_framework_scale(results, name, fs.measure_framework_scale(name, cfg, tmp_path, timeout_s=600))
    entry = results["frameworks"][name]
    assert entry["scale_failures"] == {}, entry["scale"]
    assert [r["ranks"] for r in results["scale"]] == [1, 2]
    for row in results["scale"]:
        assert row["framework"] == name and row["pairs"] == 2 and row["checkpoints"] == 2
        assert len(row["stall_s"]) == 4 and all(s > 0 for s in row["stall_s"])
        assert row["global_batch"] == 2 * row["ranks"] and row["wall_s"] > 0
        # every checkpoint counted: 2 pairs of 2, each at least the network's float32 weights (59,742 at width 4)
        assert row["written_bytes"] >= 4 * 4 * 59_742 and row["run_bytes"] >= 2 * 4 * 59_742, row
    assert entry["scale"].startswith(f"ran on 1, 2 processes ({FRAMEWORKS[name].scale}")
    assert not list(tmp_path.rglob("checkpoints/*"))
    assert entry["disk"]["written"]["scale"] == sum(r["written_bytes"] for r in results["scale"])
    print(json.dumps({"framework": name, "wall_s": [r["wall_s"] for r in results["scale"]],
                      "stall_median_s": [r["stall"]["median"] for r in results["scale"]]}))
