"""Smoke test of benchmarks/bench_save_load.py on a tiny state.

Checks the plumbing, not the speed: every mechanism produces rows with positive numbers, every
load was verified bitwise, and the byte counts in the JSON are the sizes of the files on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_save_load.py"
MECHANISMS = ["raw", "torch", "safetensors", "dcp", "resurgo"]
TARGETS = 8


def _resurgo_available() -> bool:
    try:
        import resurgo

        resurgo.save, resurgo.load  # noqa: B018
    except (ImportError, AttributeError):
        return False
    return True


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out, work = tmp / "out" / "save_load.json", tmp / "work"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--size-mib", "8", "--repeats", "1", "--out", str(out),
         "--workdir", str(work), "--keep"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"benchmark exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text()), work, proc.stdout


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_every_mechanism_has_positive_rows(bench):
    doc, _, stdout = bench
    assert doc["schema"] == "resurgo-bench-save-load/1"
    assert set(doc["mechanisms"]) == set(MECHANISMS)
    expected_ok = MECHANISMS if _resurgo_available() else MECHANISMS[:-1]
    for name in expected_ok:
        r = doc["mechanisms"][name]
        assert r["status"] == "ok", (name, r.get("reason"))
        for key in ("save_s", "load_cold_s", "load_warm_s"):
            assert len(r[key]) == 1 and all(map(_positive, r[key])), (name, key, r[key])
            assert _positive(r["median"][key]), (name, key)
        assert all(map(_positive, r["throughput_GBps"].values())), (name, r["throughput_GBps"])
        assert r["verified"] == {"cold": True, "warm": True}, name
        assert _positive(r["bytes_on_disk"])
        assert r["ratios"]["save_vs_raw"] is not None and r["ratios"]["save_vs_raw"] > 0
        assert r["ratios"]["load_cold_speedup_vs_torch"] > 0
        assert r["ratios"]["load_warm_speedup_vs_dcp"] > 0
        assert name in stdout  # a table row
    raw = doc["mechanisms"]["raw"]
    assert raw["ratios"]["save_vs_raw"] == pytest.approx(1.0)
    assert doc["mechanisms"]["torch"]["ratios"]["load_cold_speedup_vs_torch"] == pytest.approx(1.0)
    if not _resurgo_available():
        r = doc["mechanisms"]["resurgo"]
        assert r["status"] == "skipped" and "not importable" in r["reason"]


def test_byte_counts_are_the_files_on_disk(bench):
    doc, work, _ = bench
    tensor_bytes = doc["state"]["tensor_bytes"]
    assert 7 * 2**20 < tensor_bytes <= 8 * 2**20
    for name, r in doc["mechanisms"].items():
        if r["status"] != "ok":
            continue
        root = work / name
        on_disk = {
            str(p.relative_to(root)): p.stat().st_size
            for p in root.rglob("*") if p.is_file()
        }
        recorded = {f["path"]: f["bytes"] for f in r["files"]}
        assert recorded == on_disk, name
        assert r["bytes_on_disk"] == sum(on_disk.values()), name
        assert r["overhead_bytes"] == r["bytes_on_disk"] - tensor_bytes, name
        assert r["bytes_on_disk"] >= tensor_bytes, name
    assert doc["mechanisms"]["raw"]["bytes_on_disk"] == tensor_bytes
    r = doc["mechanisms"]["resurgo"]
    if r["status"] == "ok":
        # resurgo's own report counts every byte of every file
        assert r["save_reports"][-1]["bytes_written"] == r["bytes_on_disk"]


def test_targets_are_reported(bench):
    doc, _, stdout = bench
    assert len(doc["targets"]) == TARGETS
    for t in doc["targets"]:
        assert t["status"] in {"PASS", "FAIL", "SKIP"}
        assert t["status"] in stdout
        if _resurgo_available():
            assert t["status"] != "SKIP", t
    assert os.path.basename(doc["config"]["workdir"]) == "work"
