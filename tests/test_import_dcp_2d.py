"""`resurgo import --from dcp` of a 2-D mesh save: FSDP2 over tensor parallelism on 4 gloo ranks
(2x2 DeviceMesh), with uneven FSDP2 shards. The import equals DCP's own consolidation
(dcp_to_torch_save) bit for bit, and loads into other layouts: one process (full tensors and row
shards) and, marked slow, FSDP2 on 3 ranks (model and Adam state).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_harness import run_ranks
from resurgo.interop.dcp import spec_from_dcp
from test_import_dcp import check_import


@pytest.fixture(scope="module")
def mesh_2d_save(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dcp-2d")
    run_ranks(4, "dcp_2d_workers:fsdp2_over_tp", str(root / "dcp"))
    return root / "dcp"


def test_fsdp2_over_tp_save_imports_bit_for_bit(mesh_2d_save, tmp_path):
    src = mesh_2d_save
    assert sorted(p.name for p in src.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    spec = spec_from_dcp(src)
    boxes = {t.key: sorted((p.box.offsets, p.box.shape) for p in t.pieces) for t in spec.tensors}
    # column-parallel 8x5: tp halves of 4 rows, each split 2 and 2 by dp; four row blocks
    assert boxes["model.0.weight"] == [([0, 0], [2, 5]), ([2, 0], [2, 5]), ([4, 0], [2, 5]), ([6, 0], [2, 5])]
    # row-parallel 3x8: tp halves of 4 columns, each split 2 and 1 rows by dp (uneven)
    assert boxes["model.2.weight"] == [([0, 0], [2, 4]), ([0, 4], [2, 4]), ([2, 0], [1, 4]), ([2, 4], [1, 4])]
    assert boxes["optim.state.2.weight.exp_avg"] == boxes["model.2.weight"]
    assert boxes["model.2.bias"] == [([0], [2]), ([2], [1])]  # replicated over tp: saved once per dp shard
    got = check_import(src, tmp_path)  # every tensor equals dcp_to_torch_save's, in full and as row shards
    assert got["extra.step"] == 7 and got["extra.tags"] == ["a", "b"]


@pytest.mark.slow  # ~50 s on 2 cores: three more spawned interpreters (the import itself is tested above)
def test_fsdp2_over_tp_import_loads_into_fsdp2_on_3_ranks(mesh_2d_save, tmp_path):
    check_import(mesh_2d_save, tmp_path)
    results = run_ranks(3, "dcp_2d_workers:load_into_fsdp2", str(tmp_path / "imported"), str(tmp_path / "consolidated.pt"))
    assert results[0]["missing"] == [] and len(results[0]["keys"]) == 4 * 4  # 4 parameters: weight, exp_avg, exp_avg_sq, step
    # FSDP2 on 3 ranks splits the 8 rows of layer 0 as 3, 3, 2 and the 3 rows of layer 2 as 1, 1, 1
    assert [r["shards"]["model.0.weight"] for r in results] == [[3, 5], [3, 5], [2, 5]]
    assert [r["shards"]["model.2.weight"] for r in results] == [[1, 8], [1, 8], [1, 8]]
