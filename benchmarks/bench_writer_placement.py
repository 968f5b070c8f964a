"""Where should the background writer run: a thread of the training process, or a helper process?

Issue 4 asks which serves training better. The training loop (an MLP on CPU, as in
bench_async.py) runs a fixed number of steps while a background writer writes, hashes (xxh3-128
per 1 MiB block, as resurgo does) and fsyncs a snapshot of the state, placed:

- ``none``: no writer (the reference step time);
- ``thread``: resurgo's own path, ``async_save`` (writer thread at nice 10 in this process);
- ``process``: the same bytes written, hashed and fsynced by a helper process from shared
  memory (the snapshot is copied once into a shared-memory buffer, as a process-based writer
  would stage it).

Each repetition runs the three in rotating order; the output is the median step time while the
writer runs over the reference's, the writer's wall time, and the training time lost: the sum,
over the steps that ran beside the writer, of their excess over the reference step (the fair
measure: a slower, gentler writer slows fewer steps for longer).

    .venv/bin/python benchmarks/bench_writer_placement.py [--params-m 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

import resurgo  # noqa: E402
from common import environment, jsonable  # noqa: E402

BLOCK = 1 << 20
SLICE = 8 << 20


def build(params_m: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = int((params_m * 1e6 / 4) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _process_writer(shm_name: str, nbytes: int, path: str, done: "mp.synchronize.Event") -> None:
    from multiprocessing import shared_memory

    os.nice(10)  # as resurgo's writer thread
    shm = shared_memory.SharedMemory(name=shm_name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with memoryview(shm.buf) as whole:
            for off in range(0, nbytes, SLICE):
                with whole[off:min(off + SLICE, nbytes)] as piece:
                    for b in range(0, len(piece), BLOCK):
                        xxhash.xxh3_128_hexdigest(piece[b:b + BLOCK])
                    os.write(fd, piece)
        os.fsync(fd)
    finally:
        os.close(fd)
        done.set()
        shm.close()


def run_once(mode: str, model, opt, x, scratch: Path, warm_steps: int, max_steps: int,
             reference_steps: int = 10) -> dict:
    from multiprocessing import shared_memory

    for _ in range(warm_steps):
        train_step(model, opt, x)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    times: list[float] = []
    t_start = time.perf_counter()
    if mode == "none":
        for _ in range(reference_steps):
            t0 = time.perf_counter()
            train_step(model, opt, x)
            times.append(time.perf_counter() - t0)
        return {"step_times": times, "writer_seconds": 0.0}
    if mode == "thread":
        handle = resurgo.async_save(state, scratch / "thread", overwrite=True)
        active = lambda: not handle.done()  # noqa: E731
    else:
        tensors = [t for t in model.state_dict().values()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        shm = shared_memory.SharedMemory(create=True, size=nbytes)
        flat = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
        pos = 0
        for t in tensors:  # the stall: one copy into shared memory
            raw = t.detach().reshape(-1).view(torch.uint8).numpy()
            flat[pos:pos + len(raw)] = raw
            pos += len(raw)
        done = mp.get_context("fork").Event()
        proc = mp.get_context("fork").Process(target=_process_writer, args=(shm.name, nbytes, str(scratch / "proc.bin"), done))
        proc.start()
        active = lambda: not done.is_set()  # noqa: E731
    steps = 0
    while active() and steps < max_steps:
        t0 = time.perf_counter()
        train_step(model, opt, x)
        times.append(time.perf_counter() - t0)
        steps += 1
    if mode == "thread":
        handle.wait()
    else:
        proc.join()
        del flat
        shm.close()
        shm.unlink()
    return {"step_times": times, "writer_seconds": time.perf_counter() - t_start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default="bench-results/writer_placement.json")
    args = ap.parse_args()
    model, opt = build(args.params_m)
    width = model[0].in_features
    x = torch.randn(args.batch, width)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    modes = ["none", "thread", "process"]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(dir=os.environ.get("RESURGO_BENCH_DIR")) as d:
        for rep in range(args.repeats):
            for m in modes[rep % 3:] + modes[:rep % 3]:
                results[m].append(run_once(m, model, opt, x, Path(d), warm_steps=2, max_steps=200))
    ref = statistics.median(t for r in results["none"] for t in r["step_times"])
    rows = {}
    print(f"state {nbytes / 1e6:.0f} MB; reference step {ref * 1000:.1f} ms (median of {args.repeats} runs)")
    print(f"{'writer':<8} {'step while writing / reference':>31} {'writer wall s':>14} {'training s lost':>16}")
    for m in ("thread", "process"):
        per_run = [statistics.median(r["step_times"]) / ref for r in results[m] if r["step_times"]]
        wall = statistics.median(r["writer_seconds"] for r in results[m])
        # what the checkpoint costs training: the extra time of the steps that ran beside the writer
        lost = statistics.median(sum(t - ref for t in r["step_times"]) for r in results[m])
        rows[m] = {"step_slowdown": statistics.median(per_run), "writer_seconds": wall, "lost_seconds": lost,
                   "runs": per_run}
        print(f"{m:<8} {rows[m]['step_slowdown']:>30.2f}x {wall:>14.2f} {lost:>16.3f}")
    better = min(rows, key=lambda m: rows[m]["lost_seconds"])
    print(f"training loses least time with the writer in a {better}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(jsonable({"environment": environment(), "state_bytes": nbytes,
                                                   "reference_step_s": ref, "rows": rows}), indent=2))


if __name__ == "__main__":
    main()
