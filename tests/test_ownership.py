"""resurgo replaces or deletes only what it can prove it wrote: every path that replaces or deletes
(save, async_save, the manager's saves, retention and leftovers, gc, tier copies, object stores)
refuses a location holding anything else with ForeignFilesError naming it, and touches nothing."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import resurgo
from resurgo.cli import app
from resurgo.errors import CheckpointExistsError, ForeignFilesError
from resurgo.manager import CheckpointManager, Tier
from resurgo.manager.catalog import checkpoint_name
from resurgo.storage.fsspec_store import ObjectRoot
from resurgo.format.manifest import declared_files
from resurgo.pipeline import async_save as async_mod
from resurgo.storage import local
from resurgo.storage.fsspec_store import split_url

runner = CliRunner()


def tree(root: Path) -> dict[str, object]:
    """Everything under ``root``: each file's bytes, each link's target, each folder."""
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link", os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def state(v: float) -> dict:
    return {"w": torch.full((4, 3), float(v)), "b": torch.arange(5) + int(v)}


def with_foreign(path: Path, kind: str) -> str:
    """Plant something resurgo did not write in ``path``; returns its name in the message."""
    path.mkdir(parents=True, exist_ok=True)
    if kind == "notes":
        (path / "notes.txt").write_text("precious")
        (path / "sub").mkdir()
        (path / "sub" / "code.py").write_text("x = 1\n")
        return "'notes.txt' and 1 more"
    if kind == "in_data":
        (path / "data").mkdir(exist_ok=True)
        (path / "data" / "my_weights.safetensors").write_bytes(b"mine")
        return "'data/my_weights.safetensors'"
    if kind == "unlisted_data_file":  # a resurgo name, but the manifest does not list it
        (path / "data" / "rank00000-009.safetensors").write_bytes(b"not listed")
        return "'data/rank00000-009.safetensors'"
    if kind == "link":
        (path / "latest").symlink_to("/etc")
        return "'latest'"
    if kind == "edited_manifest":
        m = path / "manifest.json"
        m.write_bytes(m.read_bytes().replace(b'"step":1', b'"step":2'))
        return "'manifest.json' (it does not verify"
    raise AssertionError(kind)


KINDS = ["notes", "in_data", "unlisted_data_file", "link", "edited_manifest"]


def planted(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A directory at ``tmp_path/p`` holding a foreign entry: beside a committed checkpoint, or alone."""
    path = tmp_path / "p"
    if kind in ("unlisted_data_file", "edited_manifest") or kind == "link":
        resurgo.save(state(1), path, step=1)
    return path, with_foreign(path, kind)


# -- save and async_save ---------------------------------------------------------------------------
def test_the_reported_case_save_overwrite_keeps_a_directory_of_other_files(tmp_path):
    path = tmp_path / "p"
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("precious\n")
    (path / "sub" / "code.py").write_text("x\n")
    before = tree(tmp_path)
    with pytest.raises(ForeignFilesError, match=r"p: holds 'notes.txt' and 1 more, which resurgo did not write; "
                                                r"refusing to replace it, nothing was changed"):
        resurgo.save({"t": torch.ones(2)}, path, overwrite=True)
    assert tree(tmp_path) == before  # byte for byte, and no staging directory left


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_async", [False, True])
def test_save_overwrite_refuses_foreign_files_and_touches_nothing(tmp_path, kind, use_async):
    path, named = planted(tmp_path, kind)
    before = tree(tmp_path)
    with pytest.raises(ForeignFilesError) as info:
        if use_async:
            resurgo.async_save(state(2), path, overwrite=True, step=2).wait()
        else:
            resurgo.save(state(2), path, overwrite=True, step=2)
    assert f"holds {named}" in str(info.value) and isinstance(info.value, CheckpointExistsError)
    assert tree(tmp_path) == before


def test_a_foreign_file_that_appears_during_an_async_save_is_not_replaced(tmp_path, monkeypatch):
    path = tmp_path / "p"
    resurgo.save(state(1), path, step=1)
    gate = threading.Event()
    original = async_mod.write_and_commit
    monkeypatch.setattr(async_mod, "write_and_commit", lambda *a, **k: (gate.wait(30), original(*a, **k))[1])
    handle = resurgo.async_save(state(2), path, overwrite=True, step=2)  # checked now: all resurgo's
    (path / "notes.txt").write_text("written while the save ran")
    before = {k: v for k, v in tree(tmp_path).items() if local.TMP_MARKER not in k}  # the staging goes
    gate.set()
    with pytest.raises(ForeignFilesError, match=r"holds 'notes.txt', which resurgo did not write"):
        handle.wait()
    assert tree(tmp_path) == before
    assert resurgo.load_dict(path)["w"][0, 0].item() == 1.0


def test_replacing_resurgos_own_checkpoint_or_leftovers_still_works(tmp_path):
    path = tmp_path / "p"
    resurgo.save(state(1), path, step=1)
    resurgo.save(state(2), path, overwrite=True, step=2)
    assert resurgo.read_manifest(path).step == 2 and resurgo.load_dict(path)["w"][0, 0].item() == 2.0
    assert sorted(tree(tmp_path)) == ["p", "p/data", "p/data/rank00000-000.safetensors", "p/manifest.json"]
    (path / "manifest.json").unlink()  # an incomplete checkpoint: resurgo-named data files only
    resurgo.async_save(state(3), path, overwrite=True, step=3).wait()
    assert resurgo.read_manifest(path).step == 3
    assert sorted(tree(tmp_path)) == ["p", "p/data", "p/data/rank00000-000.safetensors", "p/manifest.json"]


# -- the manager, gc, tiers ----------------------------------------------------------------------
def test_manager_save_over_a_step_directory_holding_a_foreign_file(tmp_path):
    step_dir = tmp_path / checkpoint_name(3)
    (step_dir / "data").mkdir(parents=True)
    (step_dir / "data" / "rank00000-000.safetensors").write_bytes(b"cut short")
    (step_dir / "README").write_text("mine")
    before = tree(tmp_path)
    for use_async in (False, True):
        with CheckpointManager(tmp_path, async_save=use_async) as mgr:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # not announced as "replacing" either
                with pytest.raises(ForeignFilesError, match=r"step_000000003: holds 'README', which resurgo did not"):
                    mgr.save(state(3), 3)
        assert tree(tmp_path) == before


def test_retention_and_leftover_clean_up_leave_foreign_files_with_a_warning(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        for s in (1, 2):
            mgr.save(state(s), s)
    (tmp_path / checkpoint_name(1) / "notes.txt").write_text("mine")
    leftover = tmp_path / f".{checkpoint_name(5)}{local.TMP_MARKER}0123456789ab"
    (leftover / "data").mkdir(parents=True)
    (leftover / "data" / "rank00000-000.safetensors").write_bytes(b"cut short")
    (leftover / "data" / "keep.bin").write_bytes(b"mine")
    before = tree(tmp_path)
    with pytest.warns(UserWarning) as caught:
        with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
            mgr.wait()  # the start's clean-up of leftovers has run
            mgr.save(state(3), 3)
            mgr.wait()  # retention has run
            mgr.save(state(4), 4)
    messages = " | ".join(str(w.message) for w in caught)
    assert "holds 'data/keep.bin', which resurgo did not write; refusing to delete it" in messages
    assert "step_000000001: holds 'notes.txt', which resurgo did not write; refusing to delete it" in messages
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k in before and not k.startswith(checkpoint_name(2))} == \
        {k: v for k, v in before.items() if not k.startswith(checkpoint_name(2))}
    assert not (tmp_path / checkpoint_name(2)).exists() and not (tmp_path / checkpoint_name(3)).exists()


def test_gc_deletes_what_is_resurgos_and_keeps_foreign_files_with_a_warning(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(state(s), s)
    (tmp_path / checkpoint_name(1) / "notes.txt").write_text("mine")
    incomplete = tmp_path / checkpoint_name(7)
    (incomplete / "data").mkdir(parents=True)
    (incomplete / "data" / "rank00000-000.safetensors").write_bytes(b"cut short")
    foreign_incomplete = tmp_path / checkpoint_name(8)
    (foreign_incomplete / "data").mkdir(parents=True)
    (foreign_incomplete / "data" / "train.py").write_text("mine")
    kept = {k: v for k, v in tree(tmp_path).items() if k.split("/")[0] in (checkpoint_name(1), checkpoint_name(8))}
    dry = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "1", "--stale-after", "0", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    result = runner.invoke(app, ["gc", str(tmp_path), "--keep-last", "1", "--stale-after", "0", "--json"])
    assert result.exit_code == 0, result.output
    for out in (dry, result):
        items = {i["step"]: i for i in json.loads(out.stdout)["items"]}
        assert items[1]["action"] == "keep" and "holds 'notes.txt'" in items[1]["reason"]
        assert items[8]["action"] == "keep" and "holds 'data/train.py'" in items[8]["reason"]
        assert items[2]["action"] == items[7]["action"] == "delete"
    assert "warning: " in result.stderr and "holds 'notes.txt'" in result.stderr
    after = tree(tmp_path)
    assert {k: v for k, v in after.items() if k.split("/")[0] in (checkpoint_name(1), checkpoint_name(8))} == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(s) for s in (1, 3, 8)]


def test_tier_copy_does_not_replace_a_destination_holding_a_foreign_file(tmp_path):
    fast, durable = tmp_path / "fast", tmp_path / "durable"
    dest = durable / checkpoint_name(2)
    (dest / "data").mkdir(parents=True)  # an interrupted copy... with someone's file in it
    (dest / "notes.txt").write_text("mine")
    before = tree(durable)
    with CheckpointManager(tiers=[Tier(fast), Tier(durable)], async_save=False) as mgr:
        mgr.save(state(2), 2)
        with pytest.raises(ForeignFilesError, match=r"step_000000002: holds 'notes.txt', which resurgo did not write; "
                                                    r"refusing to delete it"):
            mgr.wait()  # the copy's refusal is raised, and tells the job to stop
        assert mgr.should_stop
        mgr.save(state(3), 3)
    assert {k: v for k, v in tree(durable).items() if k.split("/")[0] == checkpoint_name(2)} == before
    assert resurgo.load_dict(durable / checkpoint_name(3))["w"][0, 0].item() == 3.0


# -- object stores ---------------------------------------------------------------------------------
def objects(url: str) -> dict[str, bytes]:
    fs, root = split_url(url, None)
    return {name[len(root) + 1:]: fs.cat_file(name) for name in fs.find(root)}


def test_object_store_overwrite_refuses_a_prefix_with_foreign_objects(mem_url):
    url = f"{mem_url}/c"
    resurgo.save(state(1), url, step=1)
    fs, root = split_url(url, None)
    fs.pipe_file(f"{root}/notes.txt", b"mine")
    before = objects(url)
    for use_async in (False, True):
        with pytest.raises(ForeignFilesError, match=rf"{url}: holds 'notes.txt', which resurgo did not write"):
            if use_async:
                resurgo.async_save(state(2), url, overwrite=True, step=2).wait()
            else:
                resurgo.save(state(2), url, overwrite=True, step=2)
        assert objects(url) == before
    fs.rm(f"{root}/notes.txt")
    manifest = fs.cat_file(f"{root}/manifest.json")
    fs.pipe_file(f"{root}/manifest.json", manifest.replace(b'"step":1', b'"step":5'))  # edited: not provably ours
    before = objects(url)
    with pytest.raises(ForeignFilesError, match=r"holds 'manifest.json' \(it does not verify"):
        resurgo.save(state(2), url, overwrite=True, step=2)
    assert objects(url) == before
    fs.pipe_file(f"{root}/manifest.json", manifest)
    resurgo.save(state(2), url, overwrite=True, step=2)  # resurgo's own: replaced, old data objects deleted
    assert resurgo.read_manifest(url).step == 2 and set(objects(url)) == {"manifest.json", *resurgo.read_manifest(url).files}


def test_object_store_manager_never_deletes_foreign_objects(mem_url):
    with CheckpointManager(mem_url, async_save=False) as mgr:
        for s in (1, 2):
            mgr.save(state(s), s)
    fs, root = split_url(mem_url, None)
    fs.pipe_file(f"{root}/{checkpoint_name(1)}/notes.txt", b"mine")
    fs.pipe_file(f"{root}/{checkpoint_name(4)}/data/rank00000-000.safetensors", b"cut short")
    fs.pipe_file(f"{root}/{checkpoint_name(4)}/my.cfg", b"mine")
    before = objects(mem_url)
    with pytest.raises(ForeignFilesError, match=r"step_000000001: holds 'notes.txt'"):
        ObjectRoot(mem_url).remove(checkpoint_name(1), declared_files)
    with pytest.warns(UserWarning) as caught:
        with CheckpointManager(mem_url, keep_last=1, async_save=False) as mgr:
            mgr.wait()  # the start's clean-up of incomplete prefixes has run
            with pytest.raises(ForeignFilesError, match=r"step_000000004: holds 'my.cfg'"):
                mgr.save(state(4), 4)
            mgr.save(state(3), 3)
    messages = " | ".join(str(w.message) for w in caught)
    assert "step_000000004: holds 'my.cfg', which resurgo did not write; refusing to delete it" in messages
    assert "step_000000001: holds 'notes.txt', which resurgo did not write; refusing to delete it" in messages
    after = objects(mem_url)
    assert {k: v for k, v in after.items() if k.startswith((checkpoint_name(1), checkpoint_name(4)))} == \
        {k: v for k, v in before.items() if k.startswith((checkpoint_name(1), checkpoint_name(4)))}
    assert not any(k.startswith(checkpoint_name(2)) for k in after)


def test_a_manager_start_removes_a_multi_rank_saves_leftovers_indexes_included(tmp_path):
    """A save of several ranks cut short leaves each rank's data files and index (format 4)."""
    leftover = tmp_path / f".{checkpoint_name(1)}{local.TMP_MARKER}0123456789ab"
    (leftover / "data").mkdir(parents=True)
    for name in ("rank00000-000.safetensors", "rank00001-000.safetensors", "rank00001-index.safetensors",
                 "0123456789ab-rank00002-index.safetensors"):
        (leftover / "data" / name).write_bytes(b"cut short")
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.wait()  # the start's clean-up of leftovers has run
    assert not leftover.exists()
