"""The requests a peer is asked for are the reads the reader makes (pipeline/peer_read.py builds
them with reader.task_extent before the reads run; a receiver matches each read to one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import resurgo
from resurgo.format.manifest import parse_manifest
from resurgo.pipeline.reader import plan_tasks, read_ops, task_extent
from resurgo.plan.load_plan import ReadOp, ReadPart
from resurgo.storage.local import CheckpointDir


class _Recording:
    """A data file's handle that records every read's (offset, buffer lengths)."""

    def __init__(self, handle, calls: list):
        self.handle, self.calls = handle, calls
        self.rel, self.size = handle.rel, handle.size

    def read_into_many(self, offset, bufs):
        self.calls.append((offset, tuple(len(b) for b in bufs)))
        self.handle.read_into_many(offset, bufs)

    def close(self):
        self.handle.close()


def test_a_tasks_extent_is_the_offset_and_buffer_lengths_the_reader_reads(tmp_path: Path):
    a, b = torch.arange(1 << 16, dtype=torch.float32), torch.arange(1 << 16, dtype=torch.float64)
    resurgo.save({"a": a, "b": b}, tmp_path / "c")
    ckpt = CheckpointDir(tmp_path / "c")
    manifest = parse_manifest(ckpt.read_manifest_bytes(), "test")
    (name,) = manifest.files
    ca, cb = manifest.tensors["a"].chunks[0], manifest.tensors["b"].chunks[0]
    (_, a_at, _), (_, b_at, _) = ca.spans[0], cb.spans[0]
    block = ca.block_bytes
    # a's first block, then all of b: a gap between them, read in one request with the header
    ops = [ReadOp(name, a_at, block, (ReadPart("a", 0, block, 0, 0),)),
           ReadOp(name, b_at, cb.nbytes, (ReadPart("b", 0, cb.nbytes, 0, 1),))]
    tasks = plan_tasks(manifest, ops, {name}, True, (1 << 30, 1 << 30))
    header = manifest.file_entry(name).header_bytes
    assert [task_extent(t, header) for t in tasks] == [(0, (header, block, b_at - a_at - block, cb.nbytes))]
    calls: list = []
    bufs = [np.zeros(block, dtype=np.uint8), np.zeros(cb.nbytes, dtype=np.uint8)]
    handle = _Recording(ckpt.open_read(name), calls)
    read_ops(ckpt, manifest, {"a": manifest.tensors["a"], "b": manifest.tensors["b"]}, bufs, ops,
             handles={name: handle}, tasks=tasks)
    handle.close()
    assert calls == [task_extent(tasks[0], header)]
    assert bufs[0].tobytes() == a.numpy().tobytes()[:block] and bufs[1].tobytes() == b.numpy().tobytes()
