"""Fingerprint-only gathers on real processes (2 gloo ranks): a repeated layout gathers a summary
of bounded size per rank, and the checkpoints are those of full declarations, bit for bit; a
layout change on one rank alone replans; a bad value on one rank fails every rank; fingerprints
are equal across processes."""

from __future__ import annotations

import json
import os

import torch
from dist_harness import run_ranks

import resurgo
from plan_fingerprint_workers import fixed_digests


def _files(path) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            out[os.path.relpath(os.path.join(d, n), path)] = open(os.path.join(d, n), "rb").read()
    manifest = json.loads(out.pop("manifest.json"))
    for volatile in ("created_at", "manifest_checksum"):
        manifest.pop(volatile)
    return {**out, "manifest.json": json.dumps(manifest).encode()}


def test_repeated_saves_gather_summaries_and_write_what_declarations_write(tmp_path):
    results = run_ranks(2, "plan_fingerprint_workers:repeated_saves", str(tmp_path / "new"), str(tmp_path / "old"))
    layouts, plan_id, per_rank = fixed_digests()
    assert results[0]["fixed"] == results[1]["fixed"] == [layouts, plan_id, per_rank]  # three processes
    assert len(set(layouts)) == 3 and len(plan_id) == 32 and per_rank == ["q", "s"]
    for r in results:  # saves 1, 2, 3, 4 (new layout on rank 1), 5, 7
        gathered = r["gather"]
        assert gathered[0] > 4096 and gathered[3] > 4096  # declarations: no plan held, a new layout
        assert max(gathered[1], gathered[2], gathered[4], gathered[5]) <= 1024  # summaries
    assert results[0]["hits"] == [0, 1, 2, 2, 3, 4]  # the coordinator's reuses
    broadcast = results[0]["broadcast"]
    assert broadcast[1] < broadcast[0] // 2  # a reused plan is not sent again, only the merged tree
    assert results[0]["error"] == results[1]["error"]
    assert results[0]["error"].startswith("UnsupportedValueError: rank 1 failed") and "'bad'" in results[0]["error"]
    assert not (tmp_path / "new" / "c6").exists()
    for step in (1, 2, 3):
        assert _files(tmp_path / "new" / f"c{step}") == _files(tmp_path / "old" / f"c{step}")
    got = resurgo.load_dict(tmp_path / "new" / "c5")
    full = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4) * 5
    assert torch.equal(got["w"]["w7"], full + 7) and got["step"] == 5
    saved = got["rng"].saved
    assert [v["seed"] for v in saved] == [5, 105] and "t" not in saved[0] and torch.equal(saved[1]["t"], torch.full((3,), 1.0))
