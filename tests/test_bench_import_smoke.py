"""Smoke test of benchmarks/bench_import.py on a checkpoint of a few MB.

Checks the plumbing, not the speed: the sources are written by the real libraries on 2 gloo ranks,
every tool has a row with positive numbers, the benchmark's own bit-for-bit check of resurgo's
output against the framework tool's passed, the ratios are printed, and nothing is left behind.
The DeepSpeed half needs deepspeed on the path (``make test-deepspeed``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_import.py"


def run_bench(tmp_path: Path, sources: str) -> tuple[dict, str]:
    out, work = tmp_path / "out" / "import.json", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(BENCH), "--params-m", "1", "--repeats", "2", "--sources", sources,
                           "--memory-budget-mib", "16", "--out", str(out), "--workdir", str(work)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, f"benchmark exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert not work.exists()  # the sources and outputs are deleted
    return json.loads(out.read_text()), proc.stdout


def check_source(doc: dict, stdout: str, name: str, tools: list[str], headline: str) -> None:
    entry = doc["sources"][name]
    assert entry["status"] == "ok" and entry["verified"] is True
    assert sorted(entry["runs"]) == sorted(tools)
    for tool in tools:
        assert len(entry["runs"][tool]) == 2
        for r in entry["runs"][tool]:
            assert 0 < r["raw_s"] <= r["durable_s"], (tool, r)
            assert r["peak_rss"] > 0 and r["output_bytes"] > 0 and isinstance(r["peak_anon"], int), (tool, r)
        m = entry["median"][tool]
        assert m["gb_per_s"] > 0
        assert f"{name:<16} {tool:<18}" in stdout
    assert entry["ratios"][f"{headline} durable_s"] > 0
    assert f"{headline} durable_s = " in stdout and "(headline: like for like, durable)" in stdout


def check_in_place(doc: dict, stdout: str, name: str, copying: str, in_place: str) -> None:
    """The import in place writes a small part of what the copying import writes, and says by how much."""
    runs = doc["sources"][name]["runs"]
    assert runs[in_place][0]["output_bytes"] * 10 < runs[copying][0]["output_bytes"]
    for key in ("durable_s", "output_bytes"):
        assert doc["sources"][name]["ratios"][f"{copying}/{in_place} {key}"] > 0
        assert f"{name}: {copying}/{in_place} {key} = " in stdout


@pytest.mark.bench
def test_dcp_rows(tmp_path):
    doc, stdout = run_bench(tmp_path, "dcp")
    assert doc["schema"] == "resurgo-bench-import/1" and doc["config"]["memory_budget"] == 16 << 20
    check_source(doc, stdout, "dcp", ["dcp_to_torch_save", "resurgo_dcp", "resurgo_dcp_in_place"],
                 "dcp_to_torch_save/resurgo_dcp")
    check_in_place(doc, stdout, "dcp", "resurgo_dcp", "resurgo_dcp_in_place")


@pytest.mark.deepspeed
def test_deepspeed_rows(tmp_path):
    doc, stdout = run_bench(tmp_path, "deepspeed")
    check_source(doc, stdout, "deepspeed_zero2", ["zero_to_fp32", "resurgo_weights", "resurgo_full",
                                                  "resurgo_full_in_place"], "zero_to_fp32/resurgo_weights")
    check_in_place(doc, stdout, "deepspeed_zero2", "resurgo_full", "resurgo_full_in_place")
    # the full import writes the weights and both Adam moments: about three times the weights
    runs = doc["sources"]["deepspeed_zero2"]["runs"]
    assert runs["resurgo_full"][0]["output_bytes"] > 2.5 * runs["resurgo_weights"][0]["output_bytes"]
