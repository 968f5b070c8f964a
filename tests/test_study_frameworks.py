"""The study's other frameworks (resurgo.study.frameworks, resurgo.study.workers): the worker
driver's JSON contract (run on a small pure-Python framework), the environment cache key and
reuse, the workers' imports, a worker that cannot run; and, under the ``frameworks`` marker,
each real framework in its own environment (made on first use from PyPI)."""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import pytest

from resurgo.errors import StudyError
from resurgo.study import frameworks as fwmod
from resurgo.study.experiments import quick_config
from resurgo.study.frameworks import (
    FRAMEWORKS, ensure_env, env_key, env_root, merge_framework, run_framework, worker_config,
)
from resurgo.study.workers import driver

WORKERS = Path(fwmod.__file__).parent / "workers"
CONFIG = {"models": ["toy"], "width": 64, "batch_size": 2, "samples": 8, "warmup_steps": 1, "cost_steps": 4, "cost_repeats": 3,
          "checkpoint_every": 2, "det_steps": 6, "det_restart": 3, "seed": 0, "threads": 1}


class Toy:
    """A framework in miniature: a job is four floats trained by steps that draw from a Random;
    a checkpoint is a JSON file of the floats, the step and (``keeps_rng``) the Random's state."""

    MECHANISM, LABEL, FORMAT, EXECUTES_CODE, EXECUTES_CODE_NOTE, FSYNC = "toy", "Toy save", "JSON", "no", "json", False

    def __init__(self, keeps_rng: bool) -> None:
        self.keeps_rng = keeps_rng
        self.STORES = {"weights": True, "optimizer": True, "rng": keeps_rng, "data_position": keeps_rng}
        self.shared = random.Random(0)  # the "global" RNG: a new job reseeds it, disturb_rng moves it
        self.compile_s = 0.0  # the first steps after a load compile again (as jit does), this long
        self.written: list[int] = []  # bytes of each checkpoint saved
        self.opened: list[tuple[Path, list[Path]]] = []  # each checkpointer's folder, and the files then on disk
        self.work: Optional[Path] = None

    def versions(self) -> dict:
        return {"toy": "1.0"}

    def setup(self, threads: int) -> None:
        pass

    def describe(self, model: str) -> str:
        return "four floats"

    def stock(self, model: str) -> dict:
        return {"definition": "five floats", "parameters": 5}

    def build(self, model: str, config: dict) -> dict:
        self.shared.seed(config["seed"])
        return {"w": [0.0] * 4, "step": 0}

    def train(self, job: dict, steps: int, on_step: Any = None) -> list[float]:
        losses = []
        time.sleep(self.compile_s)
        self.compile_s = 0.0
        for _ in range(steps):
            job["w"] = [w + self.shared.random() for w in job["w"]]
            job["step"] += 1
            losses.append(sum(job["w"]))
            if on_step is not None:
                on_step(job["step"])
        return losses

    def set_step(self, job: dict, step: int) -> None:
        job["step"] = step

    def parameters(self, job: dict) -> int:
        return len(job["w"])

    def state_bytes(self, job: dict) -> tuple[int, int]:
        return 32, 8

    def disturb_rng(self) -> None:
        self.shared.seed(12345)

    def Checkpointer(self, directory: Path) -> "ToyCheckpointer":  # noqa: N802 - the driver's name for it
        if self.work is not None:
            self.opened.append((Path(directory), [f for f in self.work.rglob("*") if f.is_file()]))
        return ToyCheckpointer(self, Path(directory))


class ToyCheckpointer:
    def __init__(self, toy: Toy, directory: Path) -> None:
        self.toy, self.directory = toy, directory

    def save(self, job: dict, step: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        state = self.toy.shared.getstate() if self.toy.keeps_rng else None
        text = json.dumps({"w": job["w"], "step": step, "rng": state})
        # one file, overwritten by each save, written under a temporary name first
        (self.directory / "ckpt.json.tmp").write_text(text)
        (self.directory / "ckpt.json.tmp").replace(self.directory / "ckpt.json")
        self.toy.written.append(len(text))

    def wait(self) -> None:
        pass

    def load(self, job: dict) -> Optional[int]:
        saved = json.loads((self.directory / "ckpt.json").read_text())
        self.toy.compile_s = 0.3
        job["w"] = saved["w"]
        if saved["rng"] is not None:
            self.toy.shared.setstate((saved["rng"][0], tuple(saved["rng"][1]), saved["rng"][2]))
            return saved["step"]
        return None

    def close(self) -> None:
        pass


def test_driver_writes_the_raw_timings_formats_and_restarts(tmp_path: Path):
    toy = Toy(keeps_rng=True)
    toy.work = tmp_path
    out = driver.run(toy, dict(CONFIG), tmp_path, progress=lambda label: None)
    # when a measurement opens a checkpointer, the only checkpoint on disk is the one it is to read
    # (the one saved alone, the determinism one): every earlier one was deleted once measured
    assert len(toy.opened) == 3 * 3 + 2
    assert [len(files) for _, files in toy.opened] == [0, 0, 1] * 3 + [0, 1]
    assert all(f.parent == directory for directory, files in toy.opened for f in files)
    assert list(out) == ["versions", "mechanism", "label", "models", "cost", "formats", "determinism", "disk",
                         "duration_s"]
    # every save counted, each cost run's two saves into the same file included: 3 x (2 + 1) + 1
    assert len(toy.written) == 10 and out["disk"]["total"] == sum(toy.written) > 0
    assert out["disk"]["written"] == {"cost": sum(toy.written[i] for i in (0, 1, 3, 4, 6, 7)),
                                      "formats": toy.written[2] + toy.written[5] + toy.written[8],
                                      "determinism": toy.written[9]}
    assert 0 < out["disk"]["peak"] <= max(toy.written)  # one checkpoint on disk at a time
    assert out["models"]["toy"] == {"parameters": 4, "model_state_bytes": 32, "optimizer_state_bytes": 8,
                                    "architecture": "four floats",
                                    "stock": {"definition": "five floats", "parameters": 5}}
    (cost,) = out["cost"]
    assert (cost["steps"], cost["every"], cost["checkpoints"]) == (4, 2, 2)
    assert len(cost["runs"]) == 3 and all(len(r["stall_s"]) == 2 and r["seconds"] > 0 < r["baseline_s"]
                                          for r in cost["runs"])
    # the compile after each repetition's load is in no timed run: not in the next pair's baseline
    assert max(r["baseline_s"] for r in cost["runs"]) < 0.3, cost["runs"]
    (fmt,) = out["formats"]
    assert fmt["file_names"] == ["ckpt.json"] and fmt["raw_tensor_bytes"] == 40  # weights + optimizer
    assert fmt["size_over_raw"] == fmt["bytes"] / 40 and len(fmt["save_s"]) == len(fmt["load_s"]) == 3
    det = out["determinism"]["toy"]
    restart = det["restarts"]["toy"]
    # the RNG was stored: the restart continues exactly; the step came from the checkpoint
    assert restart["restored_step"] == 3 and restart["identical"] and restart["max_abs_diff"] == 0.0
    assert restart["losses"] == det["reference"][3:] and len(det["reference"]) == 6
    assert not any(tmp_path.rglob("*.json"))  # every checkpoint removed once measured
    json.dumps(out, allow_nan=False)  # what the study process reads back


def test_driver_restart_without_the_rng_diverges_and_takes_the_step_from_the_name(tmp_path: Path):
    out = driver.run(Toy(keeps_rng=False), dict(CONFIG), tmp_path, progress=lambda label: None)
    restart = out["determinism"]["toy"]["restarts"]["toy"]
    assert restart["restored_step"] is None and not restart["identical"] and restart["max_abs_diff"] > 0


def test_driver_config_must_be_exactly_the_study_fields():
    with pytest.raises(ValueError, match=r"missing \['threads'\], unknown \['depth'\]"):
        driver.check_config({**{k: v for k, v in CONFIG.items() if k != "threads"}, "depth": 50})
    assert worker_config(quick_config()) == {
        "models": ["resnet50", "vgg16"], "width": 64, "batch_size": 2, "samples": 256, "warmup_steps": 1, "cost_steps": 4,
        "cost_repeats": 3, "checkpoint_every": 2, "det_steps": 6, "det_restart": 3, "seed": 0, "threads": 1}


def test_env_key_names_the_framework_and_changes_with_pins_and_python():
    tf = FRAMEWORKS["tensorflow"]
    key = env_key(tf, "3.11.7")
    assert key.startswith("tensorflow-") and len(key) == len("tensorflow-") + 12
    assert env_key(tf, "3.11.7") == key
    assert env_key(tf, "3.12.1") != key
    assert env_key(replace(tf, installs=(("tensorflow-cpu==2.20.0",),)), "3.11.7") != key


def test_env_root_precedence(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RESURGO_STUDY_ENVS", str(tmp_path / "from-env"))
    assert env_root(tmp_path / "given") == tmp_path / "given"
    assert env_root() == tmp_path / "from-env"
    monkeypatch.delenv("RESURGO_STUDY_ENVS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert env_root() == tmp_path / "cache" / "resurgo" / "study-envs"


def test_ensure_env_reuses_a_ready_env_and_reports_a_failed_install(tmp_path: Path, monkeypatch):
    ready = tmp_path / env_key(FRAMEWORKS["jax"])
    ready.mkdir()
    (ready / fwmod.READY).write_text("{}")

    def no_subprocess(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a ready environment is reused, not installed again")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert ensure_env("jax", tmp_path) == ready / "bin" / "python"

    def pip_fails(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        if "venv" in cmd:
            Path(cmd[-1]).mkdir(parents=True)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return subprocess.CompletedProcess(cmd, 1, "", "Collecting chainer==7.8.1\n  ModuleNotFoundError: No module "
                                           "named 'pkg_resources'\nnote: This error originates from a subprocess\n")

    monkeypatch.setattr(subprocess, "run", pip_fails)
    with pytest.raises(StudyError, match=r"Chainer environment .*chainer-[0-9a-f]{12}: `pip install --quiet "
                                         r"setuptools==69.5.1 .*` failed: ModuleNotFoundError: No module named "
                                         r"'pkg_resources'"):
        ensure_env("chainer", tmp_path)
    assert not (tmp_path / env_key(FRAMEWORKS["chainer"])).exists()  # no half-made environment is kept
    with pytest.raises(StudyError, match="unknown framework 'mxnet'; expected pytorch or one of tensorflow, jax, chainer"):
        ensure_env("mxnet", tmp_path)


def test_a_worker_whose_framework_is_missing_fails_with_the_import_error(tmp_path: Path, monkeypatch):
    # this Python has no chainer: the worker runs and fails as in an environment where the import breaks
    monkeypatch.setattr(fwmod, "ensure_env", lambda name, root=None, log=None: Path(sys.executable))
    cfg = quick_config(models=("vgg16",))
    with pytest.raises(StudyError, match=r"Chainer worker failed \(exit 1\): ModuleNotFoundError: No module named "
                                         r"'chainer'"):
        run_framework("chainer", cfg, tmp_path)


STDLIB = set(sys.stdlib_module_names) | {"__future__"}
FRAMEWORK_PACKAGES = {"driver": {"disk"}, "disk": set(),
                      "tensorflow_worker": {"numpy", "tensorflow", "tensorflow_nets"},
                      "jax_worker": {"numpy", "jax", "flax", "optax", "orbax", "jax_nets"},
                      "chainer_worker": {"numpy", "chainer", "chainer_nets"},
                      "tensorflow_nets": {"tensorflow"}, "jax_nets": {"flax", "jax"}, "chainer_nets": {"chainer"}}


@pytest.mark.parametrize("module", list(FRAMEWORK_PACKAGES))
def test_workers_import_only_the_standard_library_and_their_framework(module: str):
    tree = ast.parse((WORKERS / f"{module}.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - STDLIB == FRAMEWORK_PACKAGES[module], names - STDLIB
    assert not names & {"torch", "resurgo"}


def test_every_framework_has_a_worker_and_pinned_installs():
    for name, fw in FRAMEWORKS.items():
        assert (WORKERS / f"{name}_worker.py").is_file(), name
        pins = [a for step in fw.installs for a in step if not a.startswith("-")]
        assert pins and all("==" in a for a in pins), (name, pins)


# -- the real frameworks, each in its environment: pytest -m frameworks ---------------------------------
def _pytorch_parameters(model: str, width: int = 64) -> int:
    from resurgo.study.models import build_model

    return sum(p.numel() for p in build_model(model, width).parameters())


@pytest.mark.frameworks
@pytest.mark.timeout(1800)  # full-width VGG-16: minutes on shared cores
@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_framework_runs_in_its_environment(name: str, tmp_path: Path):
    cfg = quick_config(models=("vgg16",), samples=16, cost_steps=2, checkpoint_every=1, cost_repeats=2,
                       det_steps=4, det_restart=2)
    worker = run_framework(name, cfg, tmp_path)
    results: dict[str, Any] = {"cost": [], "formats": []}
    merge_framework(results, name, worker)
    (cost,) = results["cost"]
    assert cost["framework"] == name and cost["pairs"] == 2 and len(cost["stall_s"]) == 4
    assert cost["overhead_low_pct"] <= cost["overhead_pct"] <= cost["overhead_high_pct"]
    (fmt,) = results["formats"]
    info = worker["models"]["vgg16"]
    assert info["parameters"] == _pytorch_parameters("vgg16")  # the shared definition, at full width
    assert fmt["raw_tensor_bytes"] == info["model_state_bytes"] + info["optimizer_state_bytes"]
    restart = results["frameworks"][name]["determinism"]["vgg16"]["restarts"][worker["mechanism"]]
    # VGG-16 draws dropout masks: no framework's checkpoint holds the state they come from (TensorFlow's
    # guide checkpoints the tf.data iterator, but Keras's dropout SeedGenerator is no trackable of the
    # network, so tf.train.Checkpoint neither saves nor restores it)
    assert not restart["identical"] and restart["restored_step"] == (None if name == "chainer" else 2), restart
    print(json.dumps({"framework": name, "versions": worker["versions"], "parameters": info["parameters"],
                      "bytes": fmt["bytes"], "overhead_pct": cost["overhead_pct"],
                      "max_abs_diff": restart["max_abs_diff"]}))


# The stock networks' trainable parameters (built with weights=None / pretrained_model=None and a
# 10-class head): other architectures, shown as extra rows. Chainer's ResNet-50 (7x7 stem,
# max-pool) comes within 0.04% of PyTorch's count: a count alone does not tell two networks apart.
STOCK = {"tensorflow": {"resnet50": 23_555_082, "vgg16": 33_638_218},
         "chainer": {"resnet50": 23_528_586, "vgg16": 33_638_218}, "jax": {"resnet50": None, "vgg16": None}}
COUNT = """
import json, sys
sys.path.insert(0, sys.argv[1])
worker = __import__(sys.argv[2] + "_worker")
worker.setup(1)
models = ["resnet50", "vgg16"]
print(json.dumps({w: {m: {"parameters": worker.parameters(worker.build(m, {"width": w, "batch_size": 2, "samples": 4,
                                                                         "seed": 0})),
                          "stock": worker.stock(m) if w == 64 else None} for m in models} for w in (64, 4)}))
"""


@pytest.mark.frameworks
@pytest.mark.timeout(1800)  # building both networks twice: XLA compiles each init, slowly on shared cores
@pytest.mark.parametrize("name", list(FRAMEWORKS))
def test_each_framework_trains_pytorchs_networks(name: str):
    python = ensure_env(name)
    done = subprocess.run([str(python), "-c", COUNT, str(WORKERS), name], capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONNOUSERSITE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.splitlines()[-1])
    for width, models in counts.items():
        for model, got in models.items():
            # trainable parameters, counted as PyTorch's parameters(): equal, not merely within 0.1%
            assert got["parameters"] == _pytorch_parameters(model, int(width)), (width, model, got)
    assert {m: got["stock"] and got["stock"]["parameters"] for m, got in counts["64"].items()} == STOCK[name]
