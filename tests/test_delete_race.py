"""Deleting while someone swaps folders for links: gc and the manager's retention (``catalog.remove``,
of a committed checkpoint and of a save's leftover directory) and ``save(overwrite=True)`` run in a
loop for a few seconds while another process keeps replacing the checkpoint directory and its
``data/`` folder by a symbolic link to a victim directory holding files of the very names resurgo
would delete. Every victim file survives: deletion goes through the descriptors of the folders it
proved, never through a path resolved again. Each operation either completes or is refused with a
ResurgoError; some complete (the race is exercised, not avoided)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import ResurgoError
from resurgo.manager import catalog
from resurgo.storage.open import open_root

from link_swapper import swap

SECONDS = 6.0
LEFTOVER_FILES = 300  # a save's leftover directory: resurgo-named data files, no manifest


def _files(folder: Path) -> int:
    return sum(len(names) for _, _, names in os.walk(folder))


def _clean(root: Path) -> None:
    for entry in root.iterdir():
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink()
        else:
            for sub in entry.rglob("*"):
                if sub.is_symlink():
                    sub.unlink()
            shutil.rmtree(entry)


@pytest.mark.filterwarnings("ignore:resurgo.*was replaced:RuntimeWarning")  # an overwrite under attack says so
def test_deletions_never_touch_what_a_swapped_in_link_leads_to(tmp_path: Path):
    root, victims, template = tmp_path / "root", tmp_path / "victims", tmp_path / "template"
    root.mkdir()
    resurgo.save({"w": torch.arange(1000.0), "b": torch.ones(10)}, template)
    leftover = tmp_path / "leftover"
    (leftover / "data").mkdir(parents=True)
    for i in range(LEFTOVER_FILES):
        (leftover / "data" / f"rank00000-{i:03d}.safetensors").write_bytes(b"x")
    # Victims: what path-based deletion would reach through each swapped-in link.
    shutil.copytree(template, victims / "checkpoint")
    shutil.copytree(template / "data", victims / "checkpoint-data")
    shutil.copytree(leftover, victims / "leftover")
    shutil.copytree(leftover / "data", victims / "leftover-data")
    victim_files = _files(victims)
    assert victim_files == 2 * (LEFTOVER_FILES + len(list((template / "data").iterdir()))) + 1

    ck, tmp = root / "step_000000001", root / ".step_000000002.resurgo-tmp-0123456789ab"
    pairs = [(str(ck), str(victims / "checkpoint")), (str(ck / "data"), str(victims / "checkpoint-data")),
             (str(tmp), str(victims / "leftover")), (str(tmp / "data"), str(victims / "leftover-data"))]
    ctx = mp.get_context("spawn")
    want, seen = ctx.Value("q", -(1 << 40)), ctx.Value("q", 0)
    swapper = ctx.Process(target=swap, args=(pairs, want, seen), daemon=True)
    swapper.start()
    while seen.value != -(1 << 40):  # started, nothing swapped yet
        assert swapper.is_alive()
        time.sleep(0.01)
    done = {"remove": 0, "remove leftover": 0, "overwrite": 0}
    refused = 0
    state = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    store = open_root(root)
    try:
        start, k = time.monotonic(), 0
        # At least SECONDS, and on a slow machine until every operation completed once (at most 60 s).
        while time.monotonic() - start < (SECONDS if all(done.values()) else 60):
            k += 1
            shutil.copytree(template, ck)
            shutil.copytree(leftover, tmp)
            want.value = k
            try:
                for op in ("remove leftover", "remove" if k % 2 else "overwrite"):
                    try:
                        if op == "remove leftover":
                            catalog.remove(store, tmp.name)
                        elif op == "remove":
                            catalog.remove(store, ck.name)
                        else:
                            resurgo.save(state, ck, overwrite=True)
                        done[op] += 1
                    except ResurgoError:
                        refused += 1
            finally:
                want.value = -k
                while seen.value != -k:
                    assert swapper.is_alive()
                    time.sleep(0.001)
            assert _files(victims) == victim_files, f"iteration {k}: a victim file was deleted"
            _clean(root)
    finally:
        want.value = 0
        swapper.join(10)
    assert _files(victims) == victim_files
    assert all(n > 0 for n in done.values()), (done, refused)
