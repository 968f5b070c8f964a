"""Incremental checkpoints: a save with a base references the bytes it shares with it.

Format (references, extents, version 3), every reader resolving references, self-contained
copies, and the errors: a missing referenced file, a base outside the root.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.cli.inspect import inspect_summary
from resurgo.errors import CorruptCheckpointError, ManifestError, UnsupportedValueError
from resurgo.format.manifest import parse_manifest
from resurgo.pipeline.copy import copy_checkpoint
from resurgo.pipeline.verify import verify_checkpoint
from tests.helpers import sealed_manifest

ROWS, WIDTH = 4096, 128  # a 2 MiB float32 embedding: 4 KiB blocks of 8 rows


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(ROWS, WIDTH, generator=g),
        "frozen": torch.randn(512, 1024, generator=g),  # 2 MiB, never changes
        "bias": torch.randn(16, generator=g),
        "step": 0,
    }


def data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "data").iterdir())


def assert_same(loaded: dict, state: dict) -> None:
    for key in ("emb", "frozen", "bias"):
        assert torch.equal(loaded[key].view(torch.int32), state[key].view(torch.int32)), key


def test_unchanged_bytes_are_referenced_not_written(tmp_path: Path):
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    rows = torch.tensor([5, 900, 3000])
    state["emb"][rows] += 1.0
    state["step"] = 1
    report = resurgo.save(state, tmp_path / "b", base=tmp_path / "a")

    m = resurgo.read_manifest(tmp_path / "b")
    assert m.version == 3
    assert set(m.references) == {f"a/{name}" for name in resurgo.read_manifest(tmp_path / "a").files}
    # 3 rows dirty 3 blocks of 4 KiB; "bias" (one block) and "frozen" are reused whole.
    assert m.owned_bytes == 3 * 4096
    assert sum(m.referenced_bytes.values()) == m.tensor_bytes - 3 * 4096
    assert data_bytes(tmp_path / "b") < 3 * 4096 + 4096  # the changed blocks and a header
    assert report.bytes_written == data_bytes(tmp_path / "b") + len((tmp_path / "b" / "manifest.json").read_bytes())
    emb = m.tensors["emb"].chunks[0]
    assert emb.file is None and emb.extents is not None and len(emb.extents) == 6  # blocks 0, 112, 750 written; 3 runs between reused
    assert m.tensors["frozen"].chunks[0].extents[0].file.startswith("a/")

    assert_same(resurgo.load_dict(tmp_path / "b"), state)
    assert verify_checkpoint(tmp_path / "b").ok
    fresh = make_state(seed=1)
    resurgo.load(fresh, tmp_path / "b")
    assert_same(fresh, state)


def test_scattered_changed_blocks_are_written_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from resurgo.storage.direct_io import DirectWriteHandle

    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["emb"][torch.arange(0, ROWS, 64)] += 1.0  # 64 blocks of 4 KiB, one in every 8
    writes: list[tuple[str, int]] = []
    original = DirectWriteHandle.write
    monkeypatch.setattr(DirectWriteHandle, "write", lambda self, data: (writes.append((self.path.name, len(data))), original(self, data))[1])
    resurgo.save(state, tmp_path / "b", base=tmp_path / "a")
    monkeypatch.undo()
    assert resurgo.read_manifest(tmp_path / "b").owned_bytes == 64 * 4096
    data = [n for name, n in writes if name.endswith(".safetensors")]
    assert data[1:] == [64 * 4096]  # after the header, the 64 changed blocks in one write, not 64
    assert_same(resurgo.load_dict(tmp_path / "b"), state)


def test_a_reference_names_the_file_that_holds_the_bytes(tmp_path: Path):
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    for i, name in enumerate(["b", "c", "d"]):
        state["emb"][10 * i] += 1.0
        resurgo.save(state, tmp_path / name, base=tmp_path / "abc"[i])
    m = resurgo.read_manifest(tmp_path / "d")
    for ref in m.references:
        owner, rel = ref.split("/", 1)
        assert rel in resurgo.read_manifest(tmp_path / owner).files, ref  # never another reference
    assert {r.split("/")[0] for r in m.references} == {"a", "b", "c"}
    assert_same(resurgo.load_dict(tmp_path / "d"), state)


def test_a_full_save_stays_version_2(tmp_path: Path):
    resurgo.save(make_state(), tmp_path / "a", as_base=True)
    m = resurgo.read_manifest(tmp_path / "a")
    assert m.version == 2 and not m.references
    assert "references" not in json.loads((tmp_path / "a" / "manifest.json").read_bytes())
    # Everything changed: nothing to reference, a self-contained version 2 checkpoint.
    resurgo.save(make_state(seed=3), tmp_path / "b", base=tmp_path / "a")
    assert resurgo.read_manifest(tmp_path / "b").version == 2


FROZEN_BLOCK = 8 * 4096  # "frozen" (512 x 1024 float32) has 64 blocks of 8 rows
SAMPLED = [0, 4, 8, 12, 16, 21, 25, 29, 33, 37, 42, 46, 50, 54, 58, 63]  # block i * 63 // 15


def _save_with_frozen_blocks_changed(tmp_path: Path, blocks: list[int], asynchronous: bool = False):
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    for b in blocks:
        state["frozen"][b * 8, 0] += 1.0  # one element dirties its block of 8 rows
    save = resurgo.async_save if asynchronous else resurgo.save
    result = save(state, tmp_path / "b", base=tmp_path / "a")
    if asynchronous:
        result.wait()
    assert_same(resurgo.load_dict(tmp_path / "b"), state)
    assert verify_checkpoint(tmp_path / "b").ok
    m = resurgo.read_manifest(tmp_path / "b")
    return m, m.tensors["frozen"].chunks[0]


@pytest.mark.parametrize("changed, owned, whole", [(32, 32 * FROZEN_BLOCK, False), (33, 64 * FROZEN_BLOCK, True)])
def test_a_chunk_more_than_half_changed_is_written_whole(tmp_path: Path, changed: int, owned: int, whole: bool):
    # The first blocks change: half of the sample differs, so every block is compared.
    m, frozen = _save_with_frozen_blocks_changed(tmp_path, list(range(changed)))
    assert m.owned_bytes == owned  # "emb" and "bias" are unchanged, reused whole
    if whole:  # more than half: written whole, referencing nothing
        assert frozen.extents is None and frozen.file is not None
        assert frozen.byte_range[1] - frozen.byte_range[0] == 2 << 20
    else:  # exactly half: the changed half written, the other half referenced
        assert [e.byte_range[1] - e.byte_range[0] for e in frozen.extents] == [1 << 20, 1 << 20]
        assert frozen.extents[1].file.startswith("a/data/")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_chunk_whose_sampled_blocks_all_differ_is_written_whole(tmp_path: Path, asynchronous: bool):
    # Only 16 of 64 blocks changed, but all 16 sampled ones: written whole without comparing the rest.
    m, frozen = _save_with_frozen_blocks_changed(tmp_path, SAMPLED, asynchronous)
    assert m.owned_bytes == 2 << 20 and frozen.extents is None
    # One sampled block unchanged: compared block by block, only the 15 changed blocks written.
    m, frozen = _save_with_frozen_blocks_changed(tmp_path / "x", SAMPLED[1:], asynchronous)
    assert m.owned_bytes == 15 * FROZEN_BLOCK and len(frozen.extents) == 30  # blocks 0-3 reused, then 15 written

    from resurgo.plan.reuse_plan import sample_blocks

    assert sample_blocks(64) == SAMPLED and sample_blocks(5) == [0, 1, 2, 3, 4]


def test_sampled_blocks_are_not_hashed_again_as_the_chunk_is_written(tmp_path: Path, monkeypatch):
    # Everything changed: the 16 sampled blocks' digests are kept, the writer hashes the other 48
    # (slices of 2 blocks: sampled blocks in later slices too), and every digest is the block's.
    from resurgo.format import checksum
    from resurgo.pipeline import writer

    monkeypatch.setattr(writer, "SLICE_BYTES", 2 * FROZEN_BLOCK)
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["frozen"] += 1.0
    kept, hashed = set(), []
    real, xxhash = checksum.block_digests_reusing, checksum.xxhash

    class Counting:  # the xxhash the writer's hashing sees: counts the blocks it hashes
        @staticmethod
        def xxh3_128_hexdigest(buf):
            hashed.append(len(buf))
            return xxhash.xxh3_128_hexdigest(buf)

    def spy(buf, block_bytes, known, first_block=0):
        kept.update(i for i in known if first_block <= i < first_block + len(buf) // block_bytes)
        checksum.xxhash = Counting
        try:
            return real(buf, block_bytes, known, first_block)
        finally:
            checksum.xxhash = xxhash

    monkeypatch.setattr(checksum, "block_digests_reusing", spy)
    resurgo.save(state, tmp_path / "b", base=tmp_path / "a")
    monkeypatch.undo()
    resurgo.save(state, tmp_path / "c", as_base=True)
    frozen = resurgo.read_manifest(tmp_path / "b").tensors["frozen"].chunks[0]
    assert frozen.extents is None and sorted(kept) == SAMPLED and hashed == [FROZEN_BLOCK] * 48
    assert frozen.checksums == resurgo.read_manifest(tmp_path / "c").tensors["frozen"].chunks[0].checksums
    assert verify_checkpoint(tmp_path / "b").ok


def test_a_base_is_parsed_once_for_the_saves_that_share_it(tmp_path: Path, monkeypatch):
    from resurgo.pipeline import save as save_mod

    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    resurgo.save(state, tmp_path / "x", as_base=True)  # now the last one written is not "a"
    parsed = []
    real = save_mod.parse_manifest
    monkeypatch.setattr(save_mod, "parse_manifest", lambda raw, where: parsed.append(where) or real(raw, where))
    for name in ("b", "c"):
        state["emb"][0] += 1.0
        resurgo.save(state, tmp_path / name, base=tmp_path / "a")
    resurgo.save(state, tmp_path / "d", base=tmp_path / "c")  # the last one written: not parsed
    assert parsed == [str(tmp_path / "a" / "manifest.json")]
    (tmp_path / "a" / "manifest.json").write_bytes((tmp_path / "x" / "manifest.json").read_bytes())
    resurgo.save(state, tmp_path / "e", base=tmp_path / "a")  # other bytes: parsed again
    assert len(parsed) == 2
    assert resurgo.read_manifest(tmp_path / "e").owned_bytes == 4096
    assert_same(resurgo.load_dict(tmp_path / "e"), state)


def test_async_save_with_base(tmp_path: Path):
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["emb"][7] -= 2.0
    resurgo.async_save(state, tmp_path / "b", base=tmp_path / "a").wait()
    assert resurgo.read_manifest(tmp_path / "b").owned_bytes == 4096
    assert_same(resurgo.load_dict(tmp_path / "b"), state)


def test_missing_referenced_file_is_corrupt_naming_both(tmp_path: Path):
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["emb"][0] += 1
    resurgo.save(state, tmp_path / "b", base=tmp_path / "a")
    for f in (tmp_path / "a" / "data").iterdir():
        f.unlink()
    with pytest.raises(CorruptCheckpointError) as e:
        resurgo.load_dict(tmp_path / "b")
    assert str(tmp_path / "b") in str(e.value) and "of checkpoint 'a'" in str(e.value)
    assert "data/rank00000-000.safetensors" in str(e.value)
    report = verify_checkpoint(tmp_path / "b")
    assert not report.ok and "of checkpoint 'a'" in report.problems[0]


def test_flipped_referenced_byte_is_caught(tmp_path: Path):
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["bias"] += 1
    resurgo.save(state, tmp_path / "b", base=tmp_path / "a")
    m = resurgo.read_manifest(tmp_path / "b")
    file, start, _ = m.tensors["frozen"].chunks[0].spans[0]
    path = tmp_path / file
    raw = bytearray(path.read_bytes())
    raw[start + 40_000] ^= 1  # in block 1: blocks of 8 rows of 4 KiB
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="block 1 "):
        resurgo.load_dict(tmp_path / "b")
    assert any("block 1 does not match" in p for p in verify_checkpoint(tmp_path / "b").problems)


def test_base_outside_the_root_is_refused(tmp_path: Path):
    (tmp_path / "one").mkdir()
    resurgo.save(make_state(), tmp_path / "one" / "a", as_base=True)
    with pytest.raises(UnsupportedValueError, match="not in the same root"):
        resurgo.save(make_state(), tmp_path / "two" / "b", base=tmp_path / "one" / "a")
    with pytest.raises(UnsupportedValueError, match="its own base"):
        resurgo.save(make_state(), tmp_path / "one" / "a", base=tmp_path / "one" / "a", overwrite=True)
    assert not (tmp_path / "two").exists() or not any((tmp_path / "two").iterdir())
    assert verify_checkpoint(tmp_path / "one" / "a").ok


def test_references_need_version_3(tmp_path: Path):
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["emb"][0] += 1
    resurgo.save(state, tmp_path / "b", base=tmp_path / "a")
    doc = json.loads((tmp_path / "b" / "manifest.json").read_bytes())
    doc.pop("manifest_checksum")
    doc["version"] = 2
    with pytest.raises(ManifestError, match="needs format version 3"):
        parse_manifest(sealed_manifest(doc))
    doc["version"] = 3
    doc["references"] = {"../x/data/rank00000-000.safetensors": next(iter(doc["references"].values()))}
    with pytest.raises(ManifestError, match="is not of the form <checkpoint>/data"):
        parse_manifest(sealed_manifest(doc))


def test_copy_is_self_contained(tmp_path: Path):
    state = make_state()
    resurgo.save(state, tmp_path / "run" / "a", as_base=True)
    state["emb"][100] += 1
    resurgo.save(state, tmp_path / "run" / "b", base=tmp_path / "run" / "a")
    copy_checkpoint(tmp_path / "run" / "b", tmp_path / "elsewhere" / "b")
    m = resurgo.read_manifest(tmp_path / "elsewhere" / "b")
    assert not m.references and m.owned_bytes == m.tensor_bytes
    assert_same(resurgo.load_dict(tmp_path / "elsewhere" / "b"), state)
    assert verify_checkpoint(tmp_path / "elsewhere" / "b").ok


def test_convert_diff_and_inspect_read_through_references(tmp_path: Path):
    from resurgo.conversion import convert
    from resurgo.diff import diff_checkpoints
    from safetensors.torch import load_file

    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["emb"][1] += 1
    resurgo.save(state, tmp_path / "b", base=tmp_path / "a")
    resurgo.save(state, tmp_path / "full")
    assert diff_checkpoints(tmp_path / "b", tmp_path / "full").identical
    convert(tmp_path / "b", tmp_path / "out.safetensors", to="safetensors")
    out = load_file(tmp_path / "out.safetensors")
    assert torch.equal(out["emb"], state["emb"]) and torch.equal(out["frozen"], state["frozen"])

    s = inspect_summary(tmp_path / "b", with_chunks=True)
    assert s["totals"]["owned_tensor_bytes"] == 4096
    assert s["totals"]["referenced_tensor_bytes"] == s["totals"]["tensor_bytes"] - 4096
    assert set(s["references"]) == set(resurgo.read_manifest(tmp_path / "b").references)
    assert "extents" in s["tensors"]["emb"]["chunks"][0]


def test_resharded_load_from_an_incremental_checkpoint(tmp_path: Path):
    """Loading parts of a tensor (another layout) reads across extents."""
    state = make_state()
    resurgo.save(state, tmp_path / "a", as_base=True)
    state["emb"][2000:2100] *= 2  # blocks in the middle: extents before and after
    resurgo.save(state, tmp_path / "b", base=tmp_path / "a")
    from resurgo.layout.box import ChunkBox
    from resurgo.plan.load_plan import Target, plan_reads

    m = resurgo.read_manifest(tmp_path / "b")
    cols = Target("emb", ChunkBox((1000, 32), (2000, 64)), 2000 * 64 * 4)
    ops = plan_reads([cols], {"emb": m.tensors["emb"]})
    assert {op.file.split("/")[0] for op in ops} == {"a", "data"}  # reads the base's file and its own
    for offsets, shape in [((0, 32), (ROWS, 64)), ((1000, 0), (1500, WIDTH)), ((2050, 100), (3, 28))]:
        part = torch.empty(shape)
        resurgo.load({"emb": resurgo.Shard(part, (ROWS, WIDTH), offsets)}, tmp_path / "b", strict=False)
        (r, c), (h, w) = offsets, shape
        assert torch.equal(part, state["emb"][r: r + h, c: c + w])


def test_incremental_blocks_hold_eight_rows():
    from resurgo.format.checksum import incremental_block_bytes_for as blocks

    assert blocks(200_000 * 128 * 4, 128 * 4) == 4096  # an embedding row of 512 bytes: 8 rows
    assert blocks(4096 * 4096 * 2, 4096 * 2) == 64 << 10  # a bfloat16 linear layer: 8 rows of 8 KiB
    assert blocks(10 << 20, 4) == 4096  # 1-D: at least 4 KiB
    assert blocks(1 << 30, 512) == 16 << 10  # at most 65536 blocks
    assert blocks(1 << 19, 4) == 64 << 10  # under 1 MiB: one block for most
    assert blocks(64 << 20, 4 << 20) == 1 << 20  # at most 1 MiB


def test_object_store_references_and_manager_retention(mem_url: str):
    """URLs: the root is the prefix; references resolve through the sibling prefix."""
    state = make_state()
    resurgo.save(state, f"{mem_url}/a", as_base=True)
    state["emb"][9] += 1
    resurgo.save(state, f"{mem_url}/b", base=f"{mem_url}/a")
    m = resurgo.read_manifest(f"{mem_url}/b")
    assert m.owned_bytes == 4096 and all(r.startswith("a/data/") for r in m.references)
    assert_same(resurgo.load_dict(f"{mem_url}/b"), state)
    assert verify_checkpoint(f"{mem_url}/b").ok
    with pytest.raises(UnsupportedValueError, match="not in the same root"):
        resurgo.save(state, f"{mem_url}/other/c", base=f"{mem_url}/a")
    from resurgo.manager.catalog import scan

    with resurgo.CheckpointManager(f"{mem_url}/run", keep_last=1, incremental=True, async_save=False) as mgr:
        for step in (1, 2, 3):
            state["emb"][step * 8] += 1
            mgr.save(state, step)
        mgr.wait()
    assert [(e.step, e.status) for e in scan(f"{mem_url}/run")] == [(1, "committed"), (2, "committed"), (3, "committed")]
    assert_same(resurgo.load_dict(f"{mem_url}/run/step_000000003"), state)
