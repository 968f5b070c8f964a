"""Smoke test of benchmarks/bench_load_atomic.py on a tiny state, against reading into place
(``--in-place``) and against a baseline source tree (``--baseline-src``, here this tree's own):
both workers load bit-exact, every repetition is timed cold and warm, and the JSON holds the
ratios the benchmarks README quotes. Checks the plumbing, not the speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_load_atomic.py"
pytestmark = pytest.mark.bench


@pytest.mark.parametrize("baseline", [["--in-place"], ["--baseline-src", str(REPO / "src")]])
def test_bench_load_atomic_runs_end_to_end(tmp_path, baseline):
    out = tmp_path / "load_atomic.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *baseline, "--size-mib", "8", "--repeats", "2", "--io-threads", "2",
         "--workdir", str(tmp_path), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"benchmark exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    doc = json.loads(out.read_text())
    assert doc["exact"] == {"this": True, "baseline": True}
    assert doc["tensor_bytes"] > 8 * 2**20 * 0.9
    for mode in ("cold", "warm"):
        for name in ("this", "baseline"):
            assert len(doc["times"][mode][name]) == 2 and all(t > 0 for t in doc["times"][mode][name])
        summary = doc["summary"][mode]
        assert summary["ratio_of_medians"] == pytest.approx(summary["this_median_s"] / summary["baseline_median_s"])
        assert summary["cpu_ratio_of_medians"] > 0
    assert Path(doc["modules"]["this"]).resolve().is_relative_to(REPO / "src")
    assert "loaded bit-exact" in proc.stdout
