"""Smoke test of benchmarks/bench_overhead.py on a tiny model: the calibration finds an N, every
mechanism has its pairs of windows with one checkpoint in each checkpointing window, and the JSON
holds the figures the closing note quotes. Checks the plumbing, not the speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.bench


def test_bench_overhead_runs_end_to_end(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_overhead.py"), "--params-m", "0.3",
         "--batch", "8", "--pairs", "2", "--warmup-steps", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    doc = json.loads(out.read_text())
    cal = doc["calibration"]
    assert cal["n_star"] >= 1 and cal["step_s"] > 0 and cal["dcp_save_s"] > 0
    assert doc["every"] == cal["n_star"]
    for name in ("dcp", "resurgo_async", "resurgo_async_guard"):
        res = doc["results"][name]
        assert "error" not in res, res
        assert len(res["pairs"]) == 2
        for pair in res["pairs"]:
            assert pair["ckpt"]["checkpoints"] == 1 and pair["plain"]["checkpoints"] == 0
            assert pair["ckpt"]["time_s"] > 0 and pair["plain"]["time_s"] > 0
        if name != "dcp":
            assert all(d > 0 for p in res["pairs"] for d in p["ckpt"]["durable_s"])
    assert [t["name"] for t in doc["targets"]] == [
        f"resurgo_async adds <= 1% at N={doc['every']}", f"resurgo_async_guard adds <= 1% at N={doc['every']}"]
    assert not list(tmp_path.glob("overhead-work-*"))  # its checkpoints are removed
