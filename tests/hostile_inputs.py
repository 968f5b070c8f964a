"""Crafted version 4 checkpoints that cost far more than their size, for tests/test_hostile_costs.py
and benchmarks/bench_hostile_import.py: a core of a few hundred bytes whose grid declares any
number of cells, and a core declaring thousands of ranks of data files with only a few on disk.

Each function writes ``<path>/manifest.json``, the rank indexes and the ``data/`` folder, and
returns the manifest's size in bytes."""

from __future__ import annotations

from pathlib import Path

from resurgo.format import checksum
from resurgo.format.index import INDEX_FORMAT, RankIndex, data_file_name, index_file_name
from resurgo.format.manifest import INDEXED_VERSION, GridEntry, Manifest, RankFiles, TensorEntry

__all__ = ["core", "empty_index", "craft_grid", "craft_many_files"]


def core(world: int, files_per_rank: int, tensor: TensorEntry, indexes: list[bytes]) -> Manifest:
    """A version 4 core of one tensor ``g`` over ``world`` ranks, whose rank indexes are ``indexes``."""
    return Manifest(format="resurgo.checkpoint", version=INDEXED_VERSION, created_at="2026-01-01T00:00:00.000+00:00",
                    library={"resurgo": "0"}, world={"size": world}, checksum_algorithm="xxh3-128", pickled=False,
                    files={}, tensors={"g": tensor}, tree={"type": "dict", "items": [["g", {"type": "tensor", "key": "g"}]]},
                    file_tag="", ranks=RankFiles(files=[files_per_rank] * world, index_bytes=[len(ix) for ix in indexes],
                                                 index_checksums=[checksum.digest(ix) for ix in indexes]))


def empty_index(rank: int) -> bytes:
    """A rank index holding no file and no chunk."""
    return RankIndex(format=INDEX_FORMAT, version=INDEXED_VERSION, rank=rank, files={}, chunks={}).encode()


def craft_grid(path: Path, cells: int, index: bytes | None = None, stored_index: bytes | None = None) -> int:
    """A one-rank checkpoint whose core declares a uint8 tensor of ``cells`` elements cut in ``cells``
    cells, all written by rank 0; its index ``index`` (default: an empty one, which holds none of
    them), and ``stored_index`` on disk where that differs from the one the core records."""
    index = empty_index(0) if index is None else index
    tensor = TensorEntry(kind="torch", dtype="uint8", shape=[cells], grid=GridEntry(parts=[cells], offset=0, strides=[0]))
    (path / "data").mkdir(parents=True)
    (path / index_file_name(0)).write_bytes(index if stored_index is None else stored_index)
    raw = core(1, 0, tensor, [index]).to_json_bytes()
    (path / "manifest.json").write_bytes(raw)
    return len(raw)


def craft_many_files(path: Path, world: int = 4000, files_per_rank: int = 1000) -> int:
    """A committed-looking checkpoint whose core declares ``world`` ranks of ``files_per_rank`` data
    files each; only ranks 0 and 1 have their index and first data file on disk."""
    indexes = [empty_index(r) for r in range(world)]
    tensor = TensorEntry(kind="torch", dtype="uint8", shape=[world], grid=GridEntry(parts=[world], offset=0, strides=[1]))
    (path / "data").mkdir(parents=True)
    for r in (0, 1):
        (path / index_file_name(r)).write_bytes(indexes[r])
        (path / data_file_name(r, 0)).write_bytes(b"x")
    raw = core(world, files_per_rank, tensor, indexes).to_json_bytes()
    (path / "manifest.json").write_bytes(raw)
    return len(raw)
