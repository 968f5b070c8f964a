"""Smoke test of benchmarks/bench_planning.py at tiny sizes, in this process (no real ranks): every
figure of its table is there, the cached path sends a summary smaller than the declarations, and
what lies beyond the measured worlds is extrapolated and marked so. Checks the plumbing, not the speed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_planning_runs_and_marks_extrapolations(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_planning", REPO / "benchmarks" / "bench_planning.py")
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    out = tmp_path / "planning.json"
    doc = bench.main(["--ranks", "1", "2", "4", "--tensors", "6", "--repeats", "1", "--max-planned", "2",
                      "--dcp-ranks", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    one, two, four = doc["rows"]
    fields = {f for _, f, _ in bench.COLUMNS}
    assert all(fields <= set(row) for row in doc["rows"])
    assert one["extrapolated"] == two["extrapolated"] == []
    assert four["extrapolated"] == ["plan_seconds", "broadcast_bytes_uncached", "plan_seconds_per_rank"]
    assert four["broadcast_bytes_uncached"] == 3 * two["broadcast_bytes_uncached"] - 2 * one["broadcast_bytes_uncached"]  # sizes: affine
    assert four["plan_seconds"] == 2 * two["plan_seconds"]  # times: proportional
    assert four["plan_seconds_per_rank"] == two["plan_seconds_per_rank"] == two["plan_seconds"] / 2
    # The core describes each tensor once: a rank more adds its index's size and digest and its RNG value.
    assert 0 < four["manifest_bytes"] - two["manifest_bytes"] < 2 * 120
    for row in doc["rows"]:
        assert 0 < row["gathered_bytes_per_rank_cached"] <= 1024 < row["gathered_bytes_per_rank_uncached"]
        assert row["cached_plan_seconds"] > 0 and row["load_metadata_bytes"] > row["manifest_bytes"]
    table = capsys.readouterr().out
    assert "extrapolated" in table and f"{four['plan_seconds']:.3f}*" in table
