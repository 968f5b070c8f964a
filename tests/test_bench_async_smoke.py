"""Smoke test of benchmarks/bench_async.py on a tiny model.

Checks the plumbing, not the speed: every mechanism has a row with positive numbers, the
benchmark's own verification passed, and, checked here independently with each library's own
loader, every kept checkpoint holds exactly the state of the moment of the save (training changed
every tensor right after the call, so an asynchronous save that copied late would differ).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_async.py"
MECHANISMS = ["copy", "torch", "dcp", "dcp_async", "dcp_async_stager", "resurgo",
              "resurgo_async", "resurgo_async_guard"]
RESURGO_ASYNC = {"resurgo_async", "resurgo_async_guard"}
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.bench]


def _async_available() -> bool:
    try:
        import resurgo

        resurgo.async_save  # noqa: B018
    except (ImportError, AttributeError):
        return False
    return True


def _expected_ok() -> list[str]:
    return [m for m in MECHANISMS if m not in RESURGO_ASYNC or _async_available()]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench_async")
    out, work = tmp / "out" / "async.json", tmp / "work"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--params-m", "0.3", "--batch", "8", "--steps", "6",
         "--base-steps", "4", "--every", "2", "--repeats", "1", "--no-heat", "--keep",
         "--out", str(out), "--workdir", str(work)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"benchmark exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text()), work, proc.stdout


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_every_mechanism_has_positive_numbers(bench):
    doc, _, stdout = bench
    assert doc["schema"] == "resurgo-bench-async/1"
    assert list(doc["mechanisms"]) == MECHANISMS
    assert doc["config"]["checkpoints_per_window"] == 2
    for name in _expected_ok():
        r = doc["mechanisms"][name]
        assert r["status"] == "ok", (name, r.get("reason"), r.get("traceback"))
        assert r["verified"] is True, (name, r["verify_errors"])
        (run,) = r["runs"]
        assert len(run["mech"]["checkpoints"]) == 2, name
        assert len(run["mech"]["step_s"]) == 6 and len(run["base"]["step_s"]) == 4, name
        for c in run["mech"]["checkpoints"]:
            assert _positive(c["call_s"]) and c["stall_s"] >= c["call_s"], (name, c)
            assert c["guard_wait_s"] >= 0, (name, c)  # the probe ran on the next step
            if name != "copy":
                assert _positive(c["durable_s"]) and c["durable_s"] >= c["call_s"], (name, c)
        m = r["median"]
        for key in ("stall_s", "call_s", "first_stall_s", "step_s"):
            assert _positive(m[key]), (name, key, m[key])
        assert _positive(run["state_bytes"]) and _positive(run["train_peak_rss"]), name
        assert isinstance(m["peak_extra_rss"], int), name
        assert m["per_ckpt_cost_s"] is not None and m["overhead_at_every_pct"] is not None
        if name != "copy":
            assert _positive(m["durable_s"]), name
            assert _positive(run["mech"]["bytes_written"]), name
        assert name in stdout  # a table row
    copy = doc["mechanisms"]["copy"]
    assert copy["median"]["durable_s"] is None and copy["ratios"]["stall_vs_copy"] == pytest.approx(1.0)
    assert doc["mechanisms"]["dcp_async"]["ratios"]["stall_vs_dcp_async"] == pytest.approx(1.0)
    if not _async_available():
        for name in RESURGO_ASYNC:
            assert doc["mechanisms"][name]["status"] == "skipped"


def test_targets_are_reported(bench):
    doc, _, stdout = bench
    assert len(doc["targets"]) == 5
    # the training-time target is measured at its N by bench_overhead.py, not extrapolated here
    assert not any("training time" in t["name"] for t in doc["targets"])
    assert "make bench-overhead" in stdout
    for t in doc["targets"]:
        assert t["status"] in {"PASS", "FAIL", "SKIP"}, t
        assert t["status"] in stdout
        if _async_available() and "guard" not in t["name"]:
            assert t["status"] != "SKIP", t


def _flatten(obj, prefix=""):
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def _load(name: str, path: Path, reference: dict) -> tuple[dict, object]:
    """({dotted key: tensor}, step) read back with the mechanism's own library."""
    if name == "torch":
        d = torch.load(path / "checkpoint.pt", map_location="cpu", weights_only=True)
        return _flatten({"model": d["model"], "optimizer": d["optimizer"]}), d["step"]
    if name.startswith("dcp"):
        import torch.distributed.checkpoint as dcp

        # DCP saves get_state_dict's form: optimizer state under the parameter's name, not its
        # index; the MLP's parameters are its state_dict's entries, in order
        names = [k.removeprefix("model.") for k in reference if k.startswith("model.")]
        target: dict = {"model": {}, "optimizer": {"state": {}}, "step": -1}
        for key, t in reference.items():
            parts = key.split(".")
            if parts[0] == "model":
                target["model"][".".join(parts[1:])] = torch.zeros_like(t)
            else:  # optimizer.state.<param id>.<name>
                target["optimizer"]["state"].setdefault(names[int(parts[2])], {})[parts[3]] = torch.zeros_like(t)
        dcp.load(target, checkpoint_id=str(path), no_dist=True)
        step = target.pop("step")
        state = target["optimizer"]["state"]
        target["optimizer"]["state"] = {names.index(n): v for n, v in state.items()}
        return _flatten(target), step
    import resurgo

    d = resurgo.load_dict(str(path))
    return _flatten({"model": d["model"], "optimizer": d["optimizer"]}), d["step"]


@pytest.mark.parametrize("name", [m for m in MECHANISMS if m != "copy"])
def test_kept_checkpoint_is_the_state_at_the_call(bench, name):
    doc, work, _ = bench
    if doc["mechanisms"][name]["status"] == "skipped":
        pytest.skip(doc["mechanisms"][name]["reason"])
    ref = torch.load(work / name / "reference.pt", weights_only=True)
    reference, step = ref["tensors"], ref["step"]
    assert any(k.endswith("exp_avg_sq") for k in reference)  # optimizer state is in there
    loaded, loaded_step = _load(name, work / name / "first", reference)
    loaded = {k: v for k, v in loaded.items() if k.startswith(("model.", "optimizer.state."))}
    assert loaded_step == step == doc["mechanisms"][name]["runs"][0]["first_checkpoint"]["step"]
    assert set(loaded) == set(reference)
    for key, expected in reference.items():
        got = loaded[key]
        assert got.dtype == expected.dtype and got.shape == expected.shape, key
        assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), key
    # --keep also keeps the checkpointing window's two checkpoints
    assert len(list((work / name / "window").iterdir())) == 2


def test_step_time_cost_counts_the_call_the_slow_steps_after_it_and_the_final_wait():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_async
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    steps = [1.0] * 12 + [1.5, 1.2] + [1.0] * 10  # checkpoint after step 12: two slow steps
    mech = {"checkpoints": [{"window_step": 12, "call_s": 0.25}], "step_s": steps, "tail_wait_s": 0.05}
    assert bench_async.step_time_cost(mech) == pytest.approx(0.25 + 0.5 + 0.2 + 0.05)
    assert bench_async.step_time_cost({"checkpoints": [], "step_s": steps, "tail_wait_s": 0.0}) is None
