"""Incremental saves on 2 gloo ranks with a sharded state (row blocks, flat ranges, a replicated
tensor), loaded on 1 and 3 ranks: every byte as saved."""

from __future__ import annotations

from pathlib import Path

import torch

import resurgo
from tests.dist_harness import run_ranks
from tests.incremental_workers import full_state


def test_incremental_saves_on_two_ranks_load_on_any_layout(tmp_path: Path):
    written = run_ranks(2, "incremental_workers:save_versions", str(tmp_path), 2)
    full = resurgo.read_manifest(tmp_path / "v0").tensor_bytes
    for v in range(1, 3):
        m = resurgo.read_manifest(tmp_path / f"v{v}")
        # Each version changes one row (on one rank) and one element: two 4 KiB blocks written.
        assert m.version == 3 and m.owned_bytes == 2 * 4096, (v, m.owned_bytes)
        assert m.world["size"] == 2 and written[0][v - 1] < full // 20
        for ref in m.references:  # every reference names a file holding the bytes
            owner, rel = ref.split("/", 1)
            assert rel in resurgo.read_manifest(tmp_path / owner).files
    loaded, expect = resurgo.load_dict(tmp_path / "v2"), full_state(2)
    assert all(torch.equal(loaded[k].view(torch.int32), expect[k].view(torch.int32)) for k in expect)
    assert run_ranks(3, "incremental_workers:load_resharded", str(tmp_path / "v2"), 2) == [True] * 3
