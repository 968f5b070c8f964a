"""Lightning's sharded strategies with resurgo: ResurgoModelParallelStrategy (FSDP2) and
ResurgoFSDPStrategy (FSDP1) save one resurgo checkpoint from every process, through
ModelCheckpoint, and a job saved on 2 processes resumes on 1 or 3 from exactly the saved state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning.pytorch")

import resurgo  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from resurgo.pipeline.verify import verify_checkpoint  # noqa: E402

WORKER = "lightning_sharded_workers:fit"


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def saved_on_two(root: Path, kind: str) -> dict:
    """Two processes fit 4 steps; ModelCheckpoint saves at steps 2 and 4 (top 2 and last)."""
    ranks = run_ranks(2, WORKER, str(root), kind, 4, timeout=300)
    ckpts = root / "ckpts"
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert ranks[0]["best"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    manifest = resurgo.read_manifest(ckpts / "last.ckpt")
    assert manifest.world == {"size": 2} and manifest.step == 4 and manifest.pickled is False
    assert verify_checkpoint(ckpts / "last.ckpt").ok
    # Both processes wrote their own shards of the weights.
    chunks = manifest.tensors["state_dict.net.0.weight"].chunks
    assert sorted(c.box.offsets[0] for c in chunks) == [0, 3] and len({c.file for c in chunks}) == 2, chunks
    return ranks[0]["end"]  # the state at step 4, which last.ckpt holds


def resume_on(root: Path, kind: str, world: int, saved: dict) -> None:
    ranks = run_ranks(world, WORKER, str(root), kind, 6, "last", timeout=300)
    for rank, result in enumerate(ranks):
        loaded = result["start"]
        assert loaded.keys() == saved.keys() and any(".exp_avg_sq" in k for k in saved), rank
        assert [k for k in saved if not bitwise_equal(saved[k], loaded[k])] == [], rank
        assert result["global_step"] == 6 and len(result["losses"]) == 2, rank
        assert all(torch.isfinite(torch.tensor(result["losses"]))), rank
        assert not bitwise_equal(result["end"]["model.net.0.weight"], saved["model.net.0.weight"]), rank  # trained on
    assert resurgo.read_manifest(root / "ckpts" / "last.ckpt").step == 6
    assert resurgo.read_manifest(root / "ckpts" / "last.ckpt").world == {"size": world}
    # The save at step 6 made 3 top-k candidates: save_top_k=2 retired one, through resurgo.
    names = sorted(os.listdir(root / "ckpts"))
    assert names == sorted(ranks[0]["best"] + ["last.ckpt"]) and len(names) == 3, names
    assert all(verify_checkpoint(root / "ckpts" / name).ok for name in names)


@pytest.mark.slow  # 23 s: two processes, then one
def test_model_parallel_fsdp2_saved_on_two_processes_resumes_on_one(tmp_path):
    saved = saved_on_two(tmp_path, "fsdp2")
    full = resurgo.load_dict(tmp_path / "ckpts" / "last.ckpt")  # one process reads it whole
    assert bitwise_equal(full["state_dict"]["net.0.weight"], saved["model.net.0.weight"])
    assert full["global_step"] == 4 and "rng_per_rank" in full["callbacks"]["ResurgoCallback"]
    resume_on(tmp_path, "fsdp2", 1, saved)


@pytest.mark.slow
def test_model_parallel_fsdp2_saved_on_two_processes_resumes_on_three(tmp_path):
    resume_on(tmp_path, "fsdp2", 3, saved_on_two(tmp_path, "fsdp2"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_fsdp1_saved_on_two_processes_resumes_on_one_and_three(tmp_path, world):
    resume_on(tmp_path, "fsdp1", world, saved_on_two(tmp_path, "fsdp1"))


class Runs:
    """A pickled object whose unpickling leaves a file behind (it would run on load)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("cls", ["ResurgoModelParallelStrategy", "ResurgoFSDPStrategy"])
def test_a_foreign_checkpoint_that_would_be_unpickled_is_refused_naming_its_file_and_the_flag(tmp_path, cls):
    import pickle

    import resurgo.integrations.lightning as integration
    from resurgo.errors import PickleNotAllowedError

    strategy = getattr(integration, cls)()
    marker = tmp_path / "ran"
    dcp_folder = tmp_path / "epoch=0-step=4.ckpt"
    dcp_folder.mkdir()
    (dcp_folder / ".metadata").write_bytes(pickle.dumps(Runs(marker)))
    with pytest.raises(PickleNotAllowedError, match=rf"step=4\.ckpt/\.metadata: .*DCP.*pickle\.load.*{cls}\(\.\.\., "
                                                    r"allow_pickle=True\)"):
        strategy.load_checkpoint(dcp_folder)
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": Runs(marker)}, tmp_path / "old.ckpt")
    with pytest.raises(PickleNotAllowedError, match=rf"old\.ckpt: .*holds .*pathlib\.Path.*{cls}\(\.\.\., "
                                                    r"allow_pickle=True\)"):
        strategy.load_checkpoint(tmp_path / "old.ckpt")
    assert not marker.exists()  # neither pickle was run


@pytest.mark.slow
def test_a_dcp_folder_of_lightnings_own_strategy_resumes_and_the_next_saves_are_resurgo(tmp_path):
    ranks = run_ranks(2, WORKER, str(tmp_path / "before"), "lightning-fsdp2", 4, timeout=300)
    old = tmp_path / "before" / "ckpts" / "epoch=0-step=4.ckpt"
    assert (old / "meta.pt").is_file() and not (old / "manifest.json").exists()  # Lightning's DCP folder
    # Its .metadata is a pickle, which DCP runs when it reads it: loaded only with allow_pickle.
    after = run_ranks(1, WORKER, str(tmp_path / "after"), "fsdp2", 6, str(old), True, timeout=300)[0]
    saved = ranks[0]["end"]
    assert [k for k in saved if not bitwise_equal(saved[k], after["start"][k])] == []
    assert after["global_step"] == 6
    assert resurgo.read_manifest(tmp_path / "after" / "ckpts" / "last.ckpt").step == 6


@pytest.mark.slow
def test_model_parallel_resumed_on_the_same_two_processes_is_bit_identical(tmp_path):
    """Saved at an epoch's end (6 steps of 2 samples on each of 2 processes) and resumed on 2
    processes, ResurgoCallback gives each process its RNG states back: the dropout masks, losses
    and final weights and optimizer state are the uninterrupted run's, bit for bit."""
    whole = run_ranks(2, WORKER, str(tmp_path / "whole"), "fsdp2", 8, timeout=300)
    run_ranks(2, WORKER, str(tmp_path / "run"), "fsdp2", 6, timeout=300)
    resumed = run_ranks(2, WORKER, str(tmp_path / "run"), "fsdp2", 8, "last", timeout=300)
    for rank in range(2):
        assert resumed[rank]["losses"] == whole[rank]["losses"][6:], rank
        end_whole, end_resumed = whole[rank]["end"], resumed[rank]["end"]
        assert [k for k in end_whole if not bitwise_equal(end_whole[k], end_resumed[k])] == [], rank
