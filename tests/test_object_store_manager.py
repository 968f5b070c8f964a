"""The CheckpointManager over object stores and across storage tiers: ``memory://`` (fast) and
``s3://`` on a real SeaweedFS server, which a test kills mid-save and restarts."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

import resurgo
from helpers import bits_equal
from resurgo.errors import CheckpointNotFoundError, IncompleteCheckpointError, StorageError
from resurgo.manager import Tier
from resurgo.storage import retry
from resurgo.storage.fsspec_store import ObjectCheckpoint, split_url


def _state(step: int, n: int = 257) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _blank(n: int = 257) -> dict:
    return {"w": torch.zeros(n), "step": -1}


def test_manager_on_memory_url_retention_restore_and_incomplete(mem_url):
    with resurgo.CheckpointManager(mem_url, every_steps=1, keep_last=2) as mgr:
        for step in range(1, 5):
            mgr.maybe_save(_state(step), step)
        mgr.wait()
        assert mgr.steps() == [3, 4]
        assert mgr.path_for(4) == f"{mem_url}/step_000000004"
    # A save of step 5 that died: a writer token and a data object, no manifest.
    staging = ObjectCheckpoint(f"{mem_url}/step_000000005").stage(overwrite=False)
    h = staging.create(f"data/{staging.file_tag}rank00000-000.safetensors")
    h.write(memoryview(b"partial"))
    h.fsync()
    target = _blank()
    with pytest.warns(UserWarning, match=rf"not restoring {mem_url}/step_000000005: incomplete: "):
        mgr = resurgo.CheckpointManager(mem_url, every_steps=1, keep_last=2)
        assert mgr.restore(target) == 4
    assert bits_equal(target["w"], _state(4)["w"]) and target["step"] == 4
    mgr.wait()  # the new manager removed the leftover of the dead save (one job per root)
    fs, root = split_url(mem_url, None)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["step_000000003", "step_000000004"]
    ObjectCheckpoint(f"{mem_url}/step_000000005").stage(overwrite=False)  # dies again: its token would refuse
    mgr.save(_state(5), 5)  # the manager owns the root: it clears its own dead save of that step first
    mgr.close()
    assert mgr.steps() == [4, 5]


@pytest.mark.parametrize("kind", ["directory", "memory url"])
def test_run_gc_and_list_checkpoints_treat_a_directory_and_a_url_alike(tmp_path, mem_url, kind):
    """One code path for both kinds of root: the plan, the sizes, the deletions, and a refusal
    (a file resurgo did not write keeps its checkpoint, named in the reason and in ``refused``)."""
    from resurgo.manager.catalog import COMMITTED, list_checkpoints
    from resurgo.manager.gc import run_gc

    root = str(tmp_path / "run") if kind == "directory" else mem_url
    with resurgo.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(_state(step), step)
    fs, prefix = split_url(mem_url, None)
    if kind == "directory":
        (tmp_path / "run" / "step_000000001" / "notes.txt").write_text("mine")
    else:
        fs.pipe_file(f"{prefix}/step_000000001/notes.txt", b"mine")
    listed = list_checkpoints(root, verify=True)
    assert [(e.path.as_posix(), e.status, e.step) for e in listed] == [
        (f"step_00000000{s}", COMMITTED, s) for s in (1, 2, 3)]
    assert all(e.nbytes > 257 * 4 for e in listed)

    dry = run_gc(root, keep_last=1, dry_run=True)
    assert [(i.entry.step, i.action) for i in dry.plan] == [(1, "keep"), (2, "delete"), (3, "keep")]
    assert dry.plan[0].reason.startswith("refused: ") and "holds 'notes.txt'" in dry.plan[0].reason
    assert len(dry.refused) == 1 and "holds 'notes.txt'" in dry.refused[0]
    assert dry.rules == "keep_last 1"
    assert [e.step for e in list_checkpoints(root)] == [1, 2, 3]  # a dry run deletes nothing
    size_of_2 = next(e.nbytes for e in listed if e.step == 2)
    assert dry.plan[1].nbytes == size_of_2

    done = run_gc(root, keep_last=1)
    assert [i.entry.step for i in done.deleted] == [2] and done.deleted[0].nbytes == size_of_2
    assert [e.step for e in list_checkpoints(root)] == [1, 3]


def test_tiers_copy_verify_retain_and_fall_back_to_durable(tmp_path, mem_url):
    fast = tmp_path / "fast"
    tiers = [Tier(fast, keep_last=1), Tier(mem_url, copy_every_steps=2, keep_last=2)]
    with resurgo.CheckpointManager(tiers=tiers, every_steps=1, async_save=False) as mgr:
        for step in range(1, 8):
            mgr.maybe_save(_state(step), step)
        mgr.wait()
        assert mgr.steps() == [7] and mgr.steps(tier=1) == [4, 6]
    assert resurgo.load_dict(f"{mem_url}/step_000000006")["step"] == 6
    target = _blank()
    assert resurgo.CheckpointManager(tiers=tiers).restore(target) == 7  # the newest, from the fast tier
    shutil.rmtree(fast)  # the node is replaced: the fast tier is lost
    target = _blank()
    mgr = resurgo.CheckpointManager(tiers=tiers, every_steps=1, async_save=False)
    assert mgr.restore(target) == 6
    assert bits_equal(target["w"], _state(6)["w"]) and target["step"] == 6
    mgr.maybe_save(_state(7), 7)
    mgr.maybe_save(_state(8), 8)
    mgr.close()
    assert mgr.steps() == [8] and mgr.steps(tier=1) == [6, 8]


def test_fast_tier_retention_keeps_a_step_until_its_durable_copy_is_done(tmp_path, mem_url):
    """The background janitor may run a step's retention after later steps are committed: with
    keep_last=1 it would delete step 2 before its queued copy to the durable tier read it."""
    import threading

    tiers = [Tier(tmp_path / "fast", keep_last=1), Tier(mem_url, copy_every_steps=2)]
    gate = threading.Event()
    with resurgo.CheckpointManager(tiers=tiers, every_steps=1, async_save=False) as mgr:
        mgr._janitor.submit(gate.wait)  # hold every copy and deletion until all saves are committed
        for step in range(1, 5):
            mgr.maybe_save(_state(step), step)
        gate.set()
        mgr.wait()
        assert mgr.steps(tier=1) == [2, 4] and mgr.steps() == [4]
    assert bits_equal(resurgo.load_dict(f"{mem_url}/step_000000002")["w"], _state(2)["w"])


def test_tiers_restore_skips_a_corrupt_fast_copy_for_the_durable_one(tmp_path, mem_url):
    tiers = [Tier(tmp_path / "fast"), Tier(mem_url)]
    with resurgo.CheckpointManager(tiers=tiers, async_save=False) as mgr:
        mgr.save(_state(3), 3)
    data = next((tmp_path / "fast" / "step_000000003" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 1
    data.write_bytes(bytes(raw))
    target = _blank()
    with pytest.warns(UserWarning, match="step_000000003: .*does not match its xxh3-128 checksum"):
        assert resurgo.CheckpointManager(tiers=tiers).restore(target) == 3
    assert bits_equal(target["w"], _state(3)["w"])


def test_tier_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="either root"):
        resurgo.CheckpointManager(tmp_path, tiers=[Tier(tmp_path)])
    with pytest.raises(ValueError, match="the first tier takes every save"):
        resurgo.CheckpointManager(tiers=[Tier(tmp_path, copy_every_steps=2)])
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        Tier(tmp_path, keep_last=0)


@pytest.mark.slow  # 30 s: the server's start and restart
def test_s3_manager_server_killed_mid_save_then_restarted(seaweed, s3_bucket, monkeypatch):
    bucket, options = s3_bucket
    monkeypatch.setattr(retry, "RETRY", retry.RetryPolicy(attempts=2, first_delay=0.05))
    options = dict(options, config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1})
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    root = f"{bucket}/run"
    big = 10_000_000  # 40 MB: the upload (3 parts) is in flight when the server dies
    mgr = resurgo.CheckpointManager(root, storage_options=options, keep_last=3)
    mgr.save(_state(1, big), 1)
    mgr.wait()
    mgr.save(_state(2, big), 2)  # staged; uploading in the background
    seaweed.kill()
    with pytest.raises(StorageError, match=f"{root}/step_000000002"):
        mgr.wait()
    mgr.close()
    seaweed.start()
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
        resurgo.read_manifest(f"{root}/step_000000002", storage_options=options)  # never committed
    target = _blank(big)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the incomplete step 2, if any of it landed
        mgr = resurgo.CheckpointManager(root, storage_options=options, keep_last=3)
        assert mgr.restore(target) == 1
    assert bits_equal(target["w"], _state(1, big)["w"])
    mgr.save(_state(3), 3)
    mgr.close()
    assert mgr.steps() == [1, 3]
    assert resurgo.load_dict(f"{root}/step_000000003", storage_options=options)["step"] == 3


def test_cli_ls_gc_verify_inspect_on_s3(s3_bucket, s3_env):
    """The command line takes URLs; credentials and endpoint come from the environment."""
    from typer.testing import CliRunner

    from resurgo.cli import app

    bucket, options = s3_bucket
    root = f"{bucket}/run"
    with resurgo.CheckpointManager(root, storage_options=options, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(_state(step), step)
    ObjectCheckpoint(f"{root}/step_000000004", options).stage(overwrite=False)  # a save that died: a token only
    runner = CliRunner()
    out = runner.invoke(app, ["ls", root, "--json", "--verify"])
    assert out.exit_code == 0, out.output
    import json

    listed = {e["path"]: (e["status"], e["step"]) for e in json.loads(out.output)["checkpoints"]}
    assert listed == {"step_000000001": ("committed", 1), "step_000000002": ("committed", 2),
                      "step_000000003": ("committed", 3), "step_000000004": ("incomplete", None)}
    out = runner.invoke(app, ["verify", f"{root}/step_000000002"])
    assert out.exit_code == 0 and "OK" in out.output
    out = runner.invoke(app, ["inspect", f"{root}/step_000000002", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["step"] == 2 and json.loads(out.output)["warnings"] == []
    out = runner.invoke(app, ["gc", root, "--keep-last", "1", "--stale-after", "0", "--json"])
    assert out.exit_code == 0, out.output
    actions = {i["path"]: i["action"] for i in json.loads(out.output)["items"]}
    assert actions == {"step_000000001": "delete", "step_000000002": "delete", "step_000000003": "keep",
                       "step_000000004": "delete"}
    assert resurgo.CheckpointManager(root, storage_options=options).steps() == [3]
    out = runner.invoke(app, ["ls", root, "--json"])
    assert [e["path"] for e in json.loads(out.output)["checkpoints"]] == ["step_000000003"]


def test_s3_tiers_on_2_ranks_restore_from_s3_when_the_fast_tier_is_lost(tmp_path, s3_bucket):
    """Real gloo processes: saves to a local fast tier, background copies to S3, restore from S3 on
    both ranks once the fast tier is deleted, bit for bit (a DTensor and a resurgo.Shard)."""
    from dist_harness import run_ranks

    url, options = s3_bucket
    results = run_ranks(2, "dist_workers:tiers_fast_lost", str(tmp_path / "fast"), f"{url}/run", options)
    for r in results:
        assert r["held"] == ([4, 5], [2, 4])  # fast: keep_last=2; durable: every 2nd step, keep_last=2
        assert r["from_fast"] == (5, r["saved"][5], 5)
        assert r["from_durable"] == (4, r["saved"][4], 4)
    assert results[0]["saved"][4] != results[1]["saved"][4]  # each rank restored its own shards
    assert resurgo.read_manifest(f"{url}/run/step_000000004", storage_options=options).world == {"size": 2}
