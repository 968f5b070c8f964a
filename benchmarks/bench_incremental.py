"""Incremental checkpoints: bytes written and save time of a save with a base, against full saves.

Three cases, each a state saved once in full (``v0``), changed, then saved again three ways, in a
rotated order, ``--repeats`` times, each save deleted once timed (median time; "vs full": the
median of each repeat's ratio to that repeat's full save, with a distribution-free 95% interval
for that median from the ratios' order statistics; "CPU vs full": the same median for the
process's CPU time, all threads, which other jobs on the machine disturb less):

- ``full``: ``resurgo.save(state, path)``, the default full save;
- ``full (incremental blocks)``: ``resurgo.save(state, path, as_base=True)``, a full save with
  the checksum blocks reuse needs (8 rows, at least 4 KiB: what an incremental manager's full
  saves cost);
- ``with base``: ``resurgo.save(state, path, base=v0)``: only changed blocks are written.

Then the training-loop case: ``finetune`` saved every step by a ``CheckpointManager`` with
``incremental=True`` (each save's base is the manager's previous checkpoint) against a full
manager, ``--manager-saves`` times, in alternating order (median of each pair's ratio).

Cases: ``lora`` (a frozen base of --lora-mib MiB in 1024x1024 float32 layers, plus rank-8 LoRA
adapters, under 2% of it, all updated), ``embedding`` (nn.Embedding(200_000, 128), 1% of the rows
updated at random), ``finetune`` (--finetune-mib MiB of float32 weights, every element updated).

    .venv/bin/python benchmarks/bench_incremental.py [--dir /path/on/the/disk] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import resurgo

MiB = 1 << 20


def lora(base_mib: int) -> tuple[dict, Callable[[dict], None]]:
    g = torch.Generator().manual_seed(0)
    layers = max(1, base_mib // 4)  # 4 MiB per 1024 x 1024 float32 layer
    state = {}
    for i in range(layers):
        state[f"layer{i}.weight"] = torch.randn(1024, 1024, generator=g)  # frozen
        state[f"layer{i}.lora_A"] = torch.randn(8, 1024, generator=g)
        state[f"layer{i}.lora_B"] = torch.zeros(1024, 8)

    def step(s: dict) -> None:
        for k, v in s.items():
            if "lora" in k:
                v.add_(torch.randn(v.shape, generator=g) * 1e-3)
    return state, step


def embedding() -> tuple[dict, Callable[[dict], None]]:
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(200_000, 128)
    state = {"embedding.weight": emb.weight.detach()}

    def step(s: dict) -> None:
        rows = torch.randperm(200_000, generator=g)[:2_000]
        s["embedding.weight"][rows] += torch.randn(2_000, 128, generator=g) * 1e-2
    return state, step


def finetune(mib: int) -> tuple[dict, Callable[[dict], None]]:
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(max(1, mib // 4))}

    def step(s: dict) -> None:
        for v in s.values():
            v.add_(torch.randn(v.shape, generator=g) * 1e-3)
    return state, step


def run_case(name: str, state: dict, step: Callable[[dict], None], where: Path, repeats: int) -> list[dict]:
    root = where / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    resurgo.save(state, root / "v0", as_base=True)
    step(state)
    ways: dict[str, dict] = {
        "full": {},
        "full (incremental blocks)": {"as_base": True},
        "with base": {"base": root / "v0"},
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    written: dict[str, int] = {}
    order = list(ways)
    for r in range(repeats):
        for way in order[r % len(order):] + order[:r % len(order)]:
            path = root / f"v1-{way.split()[0]}-{way.count(' ')}-{r}"
            c0, t0 = time.process_time(), time.perf_counter()
            report = resurgo.save(state, path, **ways[way])
            times[way].append(time.perf_counter() - t0)
            cpu[way].append(time.process_time() - c0)
            written[way] = report.bytes_written
            loaded = resurgo.load_dict(path) if r == 0 else None
            if loaded is not None:
                assert all(torch.equal(loaded[k], v) for k, v in state.items()), (name, way)
            shutil.rmtree(path)  # every way's, so that each save follows the same deletion
    shutil.rmtree(root, ignore_errors=True)
    full_bytes = written["full"]
    # Each repeat's ratio to that repeat's full save: on a shared machine the load drifts between
    # repeats more than between the saves of one repeat.
    return [{"case": name, "way": way, "bytes": written[way], "bytes_vs_full": written[way] / full_bytes,
             "seconds": statistics.median(times[way]), **ratios([t / f for t, f in zip(times[way], times["full"])]),
             "cpu_vs_full": statistics.median(t / f for t, f in zip(cpu[way], cpu["full"]))}
            for way in ways]


def ratios(values: list[float]) -> dict:
    """The median of per-pair ratios and a distribution-free interval around it: order statistics
    ``k`` and ``n + 1 - k`` with ``k`` the largest such that P(Binomial(n, 1/2) < k) <= 2.5%
    (a 95% or wider interval for the median; min and max when there are too few pairs)."""
    xs, n = sorted(values), len(values)
    k = 1
    while k < n // 2 and sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n <= 0.025:
        k += 1
    return {"time_vs_full": statistics.median(xs), "low": xs[k - 1], "high": xs[n - k]}


def run_manager(state: dict, step: Callable[[dict], None], where: Path, saves: int) -> list[dict]:
    """The training-loop case: a CheckpointManager(incremental=True) saving every step, each save's
    base the manager's previous one (whose manifest it holds), against a full manager on the same
    states; synchronous saves, each pair in alternating order, keep_last=2 for both, each save's
    deletions (the manager's background retention) done, untimed, before the next save."""
    roots = {"manager, full": where / "manager-full", "manager, incremental": where / "manager-incremental"}
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    managers = {"manager, full": resurgo.CheckpointManager(roots["manager, full"], keep_last=2, async_save=False),
                "manager, incremental": resurgo.CheckpointManager(roots["manager, incremental"], keep_last=2,
                                                                  async_save=False, incremental=True)}
    times: dict[str, list[float]] = {w: [] for w in managers}
    cpu: dict[str, list[float]] = {w: [] for w in managers}
    written: dict[str, list[int]] = {w: [] for w in managers}
    for n in range(saves + 1):
        step(state)
        order = list(managers) if n % 2 == 0 else list(reversed(managers))
        for way in order:
            c0, t0 = time.process_time(), time.perf_counter()
            managers[way].save(state, n)
            elapsed, used = time.perf_counter() - t0, time.process_time() - c0
            managers[way].wait()  # its deletions, untimed: not run beside the other manager's save
            if n > 0:  # the first save of each is full: the loop's steady state follows it
                times[way].append(elapsed)
                cpu[way].append(used)
                written[way].append(sum(f.stat().st_size for f in (roots[way] / f"step_{n:09d}").rglob("*")
                                        if f.is_file()))
    for m in managers.values():
        m.close()
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    full = "manager, full"
    return [{"case": "finetune", "way": way, "bytes": statistics.median(written[way]),
             "bytes_vs_full": statistics.median(b / f for b, f in zip(written[way], written[full])),
             "seconds": statistics.median(times[way]), **ratios([t / f for t, f in zip(times[way], times[full])]),
             "cpu_vs_full": statistics.median(t / f for t, f in zip(cpu[way], cpu[full])),
             "target": "time <= 105%" if way != full else ""}
            for way in managers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-mib", type=int, default=256)
    ap.add_argument("--finetune-mib", type=int, default=256)
    ap.add_argument("--manager-saves", type=int, default=7,
                    help="saves timed in the manager loop (finetune state, after a first full save)")
    args = ap.parse_args()
    where = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="resurgo-bench-incremental-"))
    rows = []
    for name, (state, step) in {"lora": lora(args.lora_mib), "embedding": embedding(),
                                "finetune": finetune(args.finetune_mib)}.items():
        rows += run_case(name, state, step, where, args.repeats)
    targets = {"lora": "bytes <= 3%", "embedding": "bytes <= 10%", "finetune": "time <= 105%"}
    for r in rows:
        r["target"] = targets[r["case"]] if r["way"] == "with base" else ""
    rows += run_manager(*finetune(args.finetune_mib), where, args.manager_saves)
    print(f"{'case':<10} {'save':<26} {'MiB written':>12} {'vs full':>8} {'seconds':>8} {'vs full':>8} "
          f"{'interval':>15} {'CPU vs full':>11}  target")
    for r in rows:
        print(f"{r['case']:<10} {r['way']:<26} {r['bytes'] / MiB:>12.2f} {r['bytes_vs_full']:>8.1%} "
              f"{r['seconds']:>8.3f} {r['time_vs_full']:>8.1%} {r['low']:>7.1%}-{r['high']:<7.1%} {r['cpu_vs_full']:>11.1%}  {r['target']}")
    if not args.dir:
        shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
