"""A version 4 rank index checked against its core, in memory: which rank writes a chunk, the
index's format marker, the one check of a place, and the size of an index file on disk."""

from __future__ import annotations

import json

import pytest

from resurgo.errors import CorruptCheckpointError, ManifestError
from resurgo.format import checksum
from resurgo.format.index import INDEX_FORMAT, INDEX_TENSOR, ChunkWriters, RankIndex, data_file_name, index_file_name, parse_index
from resurgo.format.manifest import (INDEXED_VERSION, BoxPlace, ChunkEntry, FileEntry, FlatPlace, GridEntry, Manifest,
                                     PieceEntry, RankFiles, TensorEntry, check_chunk, validate_manifest)
from resurgo.format.safetensors_file import HeaderEntry, build_header
from resurgo.layout.box import ChunkBox, FlatRange
from resurgo.pipeline.manifest_read import read_index
from resurgo.storage.local import CheckpointDir

WORLD = 3
FLAT = 3000  # elements of the irregular tensor, cut in PIECES flat ranges of uneven sizes
PIECES = 400
BLOCK = 1 << 20  # one checksum per chunk


def _cuts() -> list[tuple[int, int, int]]:
    """(start, stop, rank) of the irregular tensor's pieces: uneven, writers not by any rule."""
    bounds = sorted({(i * 7919) % FLAT for i in range(1, PIECES)} | {0, FLAT})
    return [(a, b, (a * 31 // 7) % WORLD) for a, b in zip(bounds, bounds[1:])]


def _tensors() -> dict[str, TensorEntry]:
    pieces = [PieceEntry(flat=FlatPlace(start=a, stop=b), rank=r) for a, b, r in _cuts()]
    return {"g": TensorEntry(kind="torch", dtype="float32", shape=[9, 4], grid=GridEntry(parts=[3, 1], offset=0, strides=[1, 0])),
            "p": TensorEntry(kind="torch", dtype="float32", shape=[FLAT], pieces=pieces)}


def _index(rank: int, extra: dict[str, list[tuple]] | None = None) -> RankIndex:
    """Rank ``rank``'s index: its cell of ``g`` and its pieces of ``p`` (plus ``extra`` places)."""
    places: dict[str, list] = {"g": [ChunkBox((3 * rank, 0), (3, 4))],
                               "p": [FlatRange(a, b) for a, b, r in _cuts() if r == rank]}
    for key, more in (extra or {}).items():
        places[key] += more
    file, offset, chunks = data_file_name(rank, 0), 64, {}
    for key, ps in places.items():
        out = []
        for p in ps:
            nbytes = p.numel * 4
            where = {"box": BoxPlace(offsets=list(p.offsets), shape=list(p.shape))} if isinstance(p, ChunkBox) \
                else {"flat": FlatPlace(start=p.start, stop=p.stop)}
            out.append(ChunkEntry(**where, file=file, byte_range=[offset, offset + nbytes], block_bytes=BLOCK,
                                  checksums=[f"{offset:032x}"]))
            offset += nbytes
        chunks[key] = out
    return RankIndex(format=INDEX_FORMAT, version=INDEXED_VERSION, rank=rank, chunks=chunks,
                     files={file: FileEntry(bytes=offset, header_bytes=64, header_checksum="0" * 32)})


def _core(raws: list[bytes], tensors: dict[str, TensorEntry] | None = None) -> Manifest:
    tensors = tensors or _tensors()
    tree = {"type": "dict", "items": [[k, {"type": "tensor", "key": k}] for k in tensors]}
    return Manifest(format="resurgo.checkpoint", version=INDEXED_VERSION, created_at="2026-01-01T00:00:00.000+00:00",
                    library={"resurgo": "0"}, world={"size": WORLD}, checksum_algorithm="xxh3-128", pickled=False,
                    files={}, tensors=tensors, tree=tree, file_tag="",
                    ranks=RankFiles(files=[1] * WORLD, index_bytes=[len(r) for r in raws],
                                    index_checksums=[checksum.digest(r) for r in raws]))


def _encoded(doc: object) -> bytes:
    """An index file holding any JSON document (a forged one, too)."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    header, _ = build_header([HeaderEntry(INDEX_TENSOR, "uint8", (len(body),), len(body))], {"resurgo": "index"})
    return header + body


# -- which rank writes a chunk ----------------------------------------------------------------------
def test_chunk_writers_name_the_rank_of_every_listed_piece_and_of_every_grid_cell():
    raws = [_index(r).encode() for r in range(WORLD)]
    core = _core(raws)
    pieces = ChunkWriters(core.tensors["p"])
    assert [pieces.of(FlatRange(a, b)) for a, b, _ in _cuts()] == [r for _, _, r in _cuts()]
    a, b, _ = _cuts()[5]
    assert pieces.of(FlatRange(a, b + 1)) is None  # not a piece
    assert pieces.of(ChunkBox((a,), (b - a,))) is None  # the same elements, as a box: not the listed place
    grid = ChunkWriters(core.tensors["g"])
    assert [grid.of(ChunkBox((3 * c, 0), (3, 4))) for c in range(3)] == [0, 1, 2]
    assert grid.of(ChunkBox((3, 0), (2, 4))) is None and grid.of(FlatRange(0, 12)) is None
    for rank, raw in enumerate(raws):  # every index of 400 uneven pieces checks against the core
        assert sum(len(c) for c in parse_index(raw, core, rank, "ix").chunks.values()) == 1 + sum(
            1 for _, _, r in _cuts() if r == rank)


def test_chunk_writers_take_the_first_listed_of_pieces_sharing_a_place():
    t = TensorEntry(kind="torch", dtype="float32", shape=[4], pieces=[
        PieceEntry(flat=FlatPlace(start=0, stop=4), rank=2), PieceEntry(flat=FlatPlace(start=4, stop=4), rank=1),
        PieceEntry(flat=FlatPlace(start=4, stop=4), rank=0)])
    assert ChunkWriters(t).of(FlatRange(4, 4)) == 1 and ChunkWriters(t).of(FlatRange(0, 4)) == 2


def test_an_index_holding_a_piece_of_another_rank_is_refused():
    a, b, owner = next(c for c in _cuts() if c[2] != 0)
    raws = [_index(0, {"p": [FlatRange(a, b)]}).encode()] + [_index(r).encode() for r in range(1, WORLD)]
    with pytest.raises(ManifestError, match=rf"ix0: holds a chunk of 'p' at FlatRange\(start={a}, stop={b}\), "
                                            r"which the manifest does not place on rank 0"):
        parse_index(raws[0], _core(raws), 0, "ix0")


# -- the format marker ----------------------------------------------------------------------------
@pytest.mark.parametrize("marker", ["resurgo.checkpoint", None, 4])
def test_an_index_of_another_format_is_corruption_naming_the_file(marker):
    doc = _index(1).model_dump(exclude_none=True)
    if marker is None:
        del doc["format"]
    else:
        doc["format"] = marker
    raws = [_index(0).encode(), _encoded(doc), _index(2).encode()]
    with pytest.raises(CorruptCheckpointError, match=rf"^data/rank00001-index\.safetensors: is not a resurgo index: "
                                                     rf"its 'format' is '{marker}', an index's is 'resurgo.index'$"):
        parse_index(raws[1], _core(raws), 1, index_file_name(1))


def test_an_index_whose_json_is_not_an_object_is_corruption_naming_the_file():
    raws = [_index(0).encode(), _encoded([INDEX_FORMAT]), _index(2).encode()]  # type: ignore[arg-type]
    with pytest.raises(CorruptCheckpointError, match=r"^ix1: is not a resurgo index: its 'format' is 'None'"):
        parse_index(raws[1], _core(raws), 1, "ix1")


# -- one check of a place ---------------------------------------------------------------------------
@pytest.mark.parametrize("place, message", [
    (ChunkBox((0,), (3,)), "box rank differs from the tensor's rank 2"),
    (ChunkBox((7, 0), (3, 4)), r"place ChunkBox\(offsets=\(7, 0\), shape=\(3, 4\)\) lies outside the tensor's shape \[9, 4\]"),
])
def test_a_bad_place_fails_alike_as_a_chunk_and_as_a_piece(place, message):
    def fail(msg: str) -> None:
        raise ManifestError(msg)

    box = BoxPlace(offsets=list(place.offsets), shape=list(place.shape))
    t = TensorEntry(kind="torch", dtype="float32", shape=[9, 4], chunks=[])
    chunk = ChunkEntry(box=box, file="data/a.safetensors", byte_range=[8, 8 + place.numel * 4], block_bytes=BLOCK,
                       checksums=["0" * 32])
    with pytest.raises(ManifestError, match=rf"^tensor 'g' chunk 0 in 'data/a.safetensors': {message}$"):
        check_chunk("g", t, 0, chunk, {"data/a.safetensors": FileEntry(bytes=1 << 10, header_bytes=8,
                                                                         header_checksum="0" * 32)}, {}, 2, fail)
    tensors = {"g": TensorEntry(kind="torch", dtype="float32", shape=[9, 4], pieces=[PieceEntry(box=box, rank=0)])}
    with pytest.raises(ManifestError, match=rf"^core: tensor 'g' piece 0: {message}$"):
        validate_manifest(_core([b"x" * 8] * WORLD, tensors), "core")


# -- the size of an index file --------------------------------------------------------------------
def test_an_index_file_of_another_size_names_the_file_and_both_sizes(tmp_path):
    raws = [_index(r).encode() for r in range(WORLD)]
    core = _core(raws)
    (tmp_path / "data").mkdir()
    for rank, raw in enumerate(raws):
        (tmp_path / index_file_name(rank)).write_bytes(raw + (b" " if rank == 2 else b""))
    ckpt = CheckpointDir(tmp_path)
    index, size = read_index(ckpt, core, 1)
    assert size == len(raws[1]) and index.rank == 1
    with pytest.raises(CorruptCheckpointError, match=rf"^{tmp_path / index_file_name(2)}: rank 2's index has "
                                                     rf"{len(raws[2]) + 1} bytes, the manifest records {len(raws[2])} "
                                                     r"\(truncated or altered\)$"):
        read_index(ckpt, core, 2)
