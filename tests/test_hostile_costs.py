"""Manifests that cost far more than their size (crafted by ``hostile_inputs``) now cost an error in proportion to it:
a version 4 core of a few hundred bytes whose grid declares 10**6 or 2**40 cells all on rank 0
(``verify``, ``inspect`` and ``load_dict`` fail at once: cells are counted, never built beyond what
the indexes hold), and a core declaring 4,000 ranks x 1,000 data files that ``save(overwrite=True)``
and ``ls`` prove or check name by name instead of building 4 million names.

The bound asserted is the issue's, loosely: at most 5 s and 300 MB (peak of traced allocations),
where the inputs are a few hundred bytes to 200 KB."""

from __future__ import annotations

import itertools
import random
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import resurgo
from hostile_inputs import craft_grid, craft_many_files
from resurgo.cli import app
from resurgo.errors import CorruptCheckpointError
from resurgo.format.index import DeclaredNames, data_file_name, index_file_name
from resurgo.format.manifest import declared_files, parse_manifest
from resurgo.layout.grid import Grid
from resurgo.manager.catalog import size_problems_in
from resurgo.pipeline.verify import verify_checkpoint

runner = CliRunner()
SECONDS, PEAK = 5.0, 300 << 20


def _bounded(fn) -> tuple[object, float, int]:
    """(what ``fn`` returned or raised, seconds, peak traced bytes)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out: object = fn()
    except Exception as e:  # noqa: BLE001 - the caller asserts which
        out = e
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < SECONDS and peak < PEAK, (seconds, peak)
    return out, seconds, peak


@pytest.mark.parametrize("cells", [10**6, 2**40])
def test_a_grid_of_cells_no_index_holds_fails_at_once(tmp_path: Path, cells: int):
    size = craft_grid(tmp_path / "ck", cells)
    assert size < 1000
    for name, fn in [("load_dict", lambda: resurgo.load_dict(tmp_path / "ck")),
                     ("verify", lambda: verify_checkpoint(tmp_path / "ck")),
                     ("inspect", lambda: runner.invoke(app, ["inspect", str(tmp_path / "ck")]))]:
        out, _, _ = _bounded(fn)
        if name == "inspect":
            assert out.exit_code == 3 and f"places {cells} chunks of 'g'" in out.output, out.output  # type: ignore[union-attr]
        else:
            assert isinstance(out, CorruptCheckpointError), out
            assert f"places {cells} chunks of 'g'" in str(out) and "rank00000-index.safetensors" in str(out)


def test_grid_writers_are_computed_as_enumerating_the_cells_would_find_them():
    rng = random.Random(7)
    for _ in range(2000):
        ndim = rng.randint(0, 3)
        parts = tuple(rng.randint(1, 6) for _ in range(ndim))
        shape = tuple(rng.randint(0, 14) for _ in range(ndim))
        grid = Grid(parts, rng.randint(0, 30), tuple(rng.randint(-4, 4) for _ in range(ndim)))
        ranges = grid.cell_ranges(shape)
        assert grid.writers(ranges) == sorted({grid.writer(c) for c in itertools.product(*ranges)})
        assert grid.count(shape) == len(list(grid.cells(shape)))


def test_overwriting_a_core_of_millions_of_declared_files_builds_no_list_of_them(tmp_path: Path):
    size = craft_many_files(tmp_path / "ck")
    assert size < 300_000
    declared = declared_files((tmp_path / "ck" / "manifest.json").read_bytes())
    assert isinstance(declared, DeclaredNames) and len(declared) == 4000 * 1001
    assert data_file_name(3999, 999) in declared and index_file_name(3999) in declared
    assert data_file_name(4000, 0) not in declared and data_file_name(0, 1000) not in declared
    assert "data/rank0000-000.safetensors" not in declared and "data/rank00000-0000.safetensors" not in declared
    out, _, _ = _bounded(lambda: runner.invoke(app, ["ls", str(tmp_path)]))
    assert out.exit_code == 3 and "data/rank00000-001.safetensors: missing" in out.output, out.output  # type: ignore[union-attr]
    out, _, _ = _bounded(lambda: resurgo.save({"w": torch.ones(3)}, tmp_path / "ck", overwrite=True))
    assert not isinstance(out, Exception), out
    assert torch.equal(resurgo.load_dict(tmp_path / "ck")["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_the_missing_files_of_a_core_are_listed_up_to_a_few(tmp_path: Path):
    craft_many_files(tmp_path / "ck", world=4000, files_per_rank=1000)
    core = parse_manifest((tmp_path / "ck" / "manifest.json").read_bytes())
    stored = {name: 1 for name in [data_file_name(0, 0), data_file_name(1, 0)]}
    stored |= {index_file_name(0): core.ranks.index_bytes[0], index_file_name(1): 7}  # type: ignore[union-attr]
    (problems, _, _) = _bounded(lambda: size_problems_in(stored, core))
    assert problems[:2] == [f"{data_file_name(0, 1)}: missing", f"{data_file_name(0, 2)}: missing"]
    assert len(problems) == 22 and problems[20] == f"and {4004000 - 4 - 20} more of the 4004000 files the manifest lists are missing"
    assert problems[21] == f"{index_file_name(1)}: 7 bytes stored, the manifest says {core.ranks.index_bytes[1]}"  # type: ignore[union-attr]
