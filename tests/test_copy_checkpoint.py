"""copy_checkpoint: a committed checkpoint copied byte for byte, several data files at once; a copy
that fails leaves nothing at the destination."""

from __future__ import annotations

import os

import pytest
import torch

import resurgo
from resurgo.pipeline.verify import verify_checkpoint
from resurgo.plan.save_plan import MIN_FILE_BYTES
from resurgo.pipeline.copy import copy_checkpoint
from helpers import bits_equal


def _four_files(tmp_path):
    state = {f"t{i}": torch.randn(MIN_FILE_BYTES // 8 + i) for i in range(8)}  # 4 files' worth
    resurgo.save(state, tmp_path / "src", io_threads=4)
    assert len(os.listdir(tmp_path / "src" / "data")) == 4
    return state


@pytest.mark.parametrize("threads", [1, 4])
def test_copy_is_byte_for_byte(tmp_path, mem_url, threads):
    state = _four_files(tmp_path)
    for dst in (tmp_path / "dst", f"{mem_url}/dst"):
        copied = copy_checkpoint(tmp_path / "src", dst, threads=threads)
        src_files = sorted((tmp_path / "src").rglob("*"))
        assert copied == sum(p.stat().st_size for p in src_files if p.is_file())
        assert bits_equal(resurgo.load_dict(dst), state)
        assert verify_checkpoint(dst).ok


def test_a_failed_file_leaves_no_checkpoint_and_names_it(tmp_path, mem_url):
    _four_files(tmp_path)
    victim = sorted((tmp_path / "src" / "data").iterdir())[2]
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 1)
    for dst in (tmp_path / "dst", f"{mem_url}/dst"):
        with pytest.raises(resurgo.CorruptCheckpointError, match=victim.name):
            copy_checkpoint(tmp_path / "src", dst, threads=4)
        with pytest.raises(resurgo.CheckpointNotFoundError):
            resurgo.load_dict(dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
