"""The catalog classifies the entries of a directory and of a URL prefix with one function: the
same checkpoints read the same (status, step, size, detail) on both kinds of root."""

from __future__ import annotations

import os

import pytest
import torch

import resurgo
from resurgo.manager.catalog import (
    COMMITTED,
    CORRUPT,
    INCOMPLETE,
    checkpoint_name,
    classify,
    classify_listing,
    list_checkpoints,
    scan,
)
from resurgo.storage.fsspec_store import split_url
from resurgo.storage.open import join, open_root

DATA = "data/rank00000-000.safetensors"


def _state(step: int) -> dict:
    return {"w": torch.arange(256, dtype=torch.float32) + step, "step": step}


def _build(root: str) -> tuple[str, int]:
    """step 1 committed, 2 truncated by 4 bytes, 3 data but no manifest, 4 saved as step 5; returns
    step 2's data file (its name differs: object stores tag it with the save) and its saved size."""
    for step, saved_as in ((1, 1), (2, 2), (4, 5)):
        resurgo.save(_state(step), join(root, checkpoint_name(step)), step=saved_as)
    (data,) = [f for f in open_root(root).listing(checkpoint_name(2)).files if f.startswith("data/")]
    name2, name3 = f"{checkpoint_name(2)}/{data}", f"{checkpoint_name(3)}/{DATA}"
    if "://" in root:
        fs, prefix = split_url(root, None)
        size = fs.info(f"{prefix}/{name2}")["size"]
        fs.pipe_file(f"{prefix}/{name2}", fs.cat_file(f"{prefix}/{name2}")[:-4])
        fs.pipe_file(f"{prefix}/{name3}", b"\0" * 100)
    else:
        size = os.path.getsize(os.path.join(root, name2))
        os.truncate(os.path.join(root, name2), size - 4)
        os.makedirs(os.path.dirname(os.path.join(root, name3)))
        with open(os.path.join(root, name3), "wb") as f:
            f.write(b"\0" * 100)
    return data, size


@pytest.mark.parametrize("kind", ["directory", "memory url"])
def test_one_classification_reads_the_same_checkpoints_alike_on_a_directory_and_a_url(tmp_path, mem_url, kind):
    root = str(tmp_path / "run") if kind == "directory" else mem_url
    data, size = _build(root)
    store = open_root(root)
    words, running = ("on disk", "") if kind == "directory" else ("stored", " (or is still running)")
    expected = [
        (checkpoint_name(1), COMMITTED, 1, ""),
        (checkpoint_name(2), CORRUPT, 2, f"{data}: {size - 4} bytes {words}, the manifest says {size}"),
        (checkpoint_name(3), INCOMPLETE, 3, f"data/ but no manifest.json: the save never committed{running}"),
        (checkpoint_name(4), CORRUPT, 4, "its manifest says step 5, its name says step 4"),
    ]
    entries = scan(store)
    assert [(e.name, e.status, e.step, e.detail) for e in entries] == expected
    assert entries[2].nbytes == 100 and entries[1].nbytes == entries[0].nbytes - 4
    incomplete = store.listing(checkpoint_name(3))
    assert (incomplete.files, incomplete.has_manifest, incomplete.has_data) == ({DATA: 100}, False, True)
    assert [str(e.location) for e in entries] == [str(join(root, n)) for n, *_ in expected]
    assert entries[0].created_at == resurgo.read_manifest(join(root, checkpoint_name(1))).created_at
    # the manager's view of one step and ls's view of the tree come from the same function
    assert [classify_listing(store, store.listing(e.name), e.step) for e in entries] == entries
    assert [(classify(store, s).status, classify(store, s).detail) for s in (1, 2, 3, 4)] == [
        (status, detail) for _, status, _, detail in expected]
    assert classify(store, 9) is None
    listed = list_checkpoints(root)
    assert [(e.name, e.status, e.step) for e in listed] == [
        (checkpoint_name(1), COMMITTED, 1), (checkpoint_name(2), CORRUPT, 2), (checkpoint_name(3), INCOMPLETE, None),
        (checkpoint_name(4), COMMITTED, 5)]
    assert [e.nbytes for e in listed] == [e.nbytes for e in entries]

