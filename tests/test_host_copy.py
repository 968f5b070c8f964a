"""Copy batches: every task runs exactly once whichever threads share the batch; memmove slices
copy every byte; a failed task is raised by wait() and never leaves a waiter hanging."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.pipeline import host_copy
from resurgo.pipeline.host_copy import CopyBatch, memmove_tasks


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 5000), slice_bytes=st.integers(1, 700))
def test_memmove_slices_copy_every_byte(n, slice_bytes):
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    old, host_copy.SLICE_BYTES = host_copy.SLICE_BYTES, slice_bytes
    try:
        tasks = memmove_tasks(dst, src)
    finally:
        host_copy.SLICE_BYTES = old
    assert len(tasks) == -(-n // slice_bytes)
    CopyBatch(tasks).finish(threads=3)
    assert np.array_equal(dst, src)


def test_each_task_runs_exactly_once_across_threads():
    counts = [0] * 2000
    lock = threading.Lock()

    def task(i):
        def run():
            with lock:
                counts[i] += 1
        return run

    batch = CopyBatch([task(i) for i in range(len(counts))])
    others = [threading.Thread(target=batch.run) for _ in range(3)]
    for t in others:
        t.start()
    batch.finish(threads=4)
    for t in others:
        t.join()
    assert counts == [1] * len(counts)


def test_a_failed_task_is_raised_and_the_rest_skipped():
    ran = []

    def boom():
        raise OSError(5, "copy failed")

    batch = CopyBatch([lambda: ran.append(0), boom, lambda: ran.append(2)])
    batch.run()
    with pytest.raises(OSError, match="copy failed"):
        batch.wait()
    assert ran == [0]  # after the failure nothing more is copied, yet wait() returned
    with pytest.raises(OSError, match="copy failed"):
        CopyBatch([boom]).finish(threads=2)


def test_finish_waits_for_tasks_other_threads_hold():
    started, release = threading.Event(), threading.Event()
    order = []

    def slow():
        started.set()
        release.wait(10)
        order.append("slow")

    batch = CopyBatch([slow, lambda: order.append("fast")])
    # Claim the slow task from another thread, then finish from this one.
    claimed = threading.Thread(target=batch.run)
    claimed.start()
    assert started.wait(10)
    finisher = threading.Thread(target=lambda: batch.finish(threads=1))
    finisher.start()
    finisher.join(0.2)
    assert finisher.is_alive()  # the slow slice is still being copied: finish() must not return
    release.set()
    finisher.join(10)
    claimed.join(10)
    assert not finisher.is_alive() and sorted(order) == ["fast", "slow"]


def test_a_forked_child_gets_its_own_copy_threads():
    CopyBatch([lambda: None] * 4).finish(threads=2)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # child: its copy would hang on the parent's (absent) threads
        code = 1
        try:
            out = []
            CopyBatch([lambda i=i: out.append(i) for i in range(8)]).finish(threads=2)
            code = 0 if sorted(out) == list(range(8)) else 2
        finally:
            os._exit(code)
    done, status = 0, 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done and os.WEXITSTATUS(status) == 0
