"""Training worker for the kill-and-resume demonstration and its test.

A small CNN with dropout trains on synthetic CIFAR-10-shaped data (3x32x32 images, 10 classes,
random horizontal flips drawn while loading) from a shuffled DataLoader, with Adam, StepLR and a
(disabled on CPU) GradScaler. The whole training state is a ``resurgo.TrainState``.

Modes (one process each):
  reference  train ``--steps`` steps without interruption; write the result file.
  train      train and ``resurgo.save`` every ``--save-every`` steps into ``--ckpt-dir/step_NNNNN``;
             prints ``SAVED <step> <path>`` once each checkpoint is committed (this is the process
             that gets killed).
  resume     build everything afresh, load the newest committed checkpoint, train to ``--steps``;
             write the result file.
Every step prints ``LOSS <step> <float.hex>``, flushed, so the losses of a killed run survive it.
The result file (torch.save, tensors and plain values only) holds the final parameters, the
optimizer state, the losses of the steps run in that process and the step it started from.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import resurgo

try:
    from resurgo import TrainState
except ImportError:  # the package root may not export it yet
    from resurgo.state.train_state import TrainState

CKPT_NAME = re.compile(r"^step_(\d+)$")


class SyntheticCIFAR(Dataset):
    """CIFAR-10-shaped data, made from a fixed seed; flips are drawn from the global RNG."""

    def __init__(self, n: int = 256, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x = self.x[i]
        if torch.rand(()) < 0.5:  # augmentation: consumes the RNG as real pipelines do
            x = x.flip(-1)
        return x, self.y[i]


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.3), nn.Linear(32 * 8 * 8, 64), nn.ReLU(),
                                  nn.Dropout(0.3), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def build(seed: int = 0, samples: int = 256, batch_size: int = 16, num_workers: int = 0,
          model_cls: Callable[[], nn.Module] = SmallCNN) -> TrainState:
    torch.manual_seed(seed)
    model = model_cls()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # mixed precision is off on CPU
    loader = DataLoader(SyntheticCIFAR(samples), batch_size=batch_size, shuffle=True, num_workers=num_workers)
    return TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler, dataloader=loader,
                      step=0, epoch=0)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The committed checkpoint with the highest step; temporary dirs of a killed save are skipped."""
    found = []
    for p in Path(ckpt_dir).iterdir() if Path(ckpt_dir).is_dir() else []:
        m = CKPT_NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    for _, p in sorted(found, reverse=True):
        try:
            resurgo.read_manifest(p)  # exists only once committed; checked anyway
        except resurgo.ResurgoError:
            continue
        return p
    return None


def train(ts: TrainState, steps: int, *, ckpt_dir: Path | None = None, save_every: int = 0,
          step_delay: float = 0.0, after_step: Callable[[TrainState, float], None] | None = None) -> list[float]:
    """Train to ``steps``; ``after_step(ts, loss)`` runs after each step (e.g. a CheckpointManager)."""
    model, opt, sched, scaler = ts.model, ts.optimizer, ts.scheduler, ts.scaler
    model.train()
    losses: list[float] = []
    while ts.step < steps:
        for x, y in ts.dataloader:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            ts.step += 1
            losses.append(loss.item())
            print(f"LOSS {ts.step} {loss.item().hex()}", flush=True)
            if ckpt_dir is not None and save_every and ts.step % save_every == 0:
                path = Path(ckpt_dir) / f"step_{ts.step:05d}"
                resurgo.save(ts, path, step=ts.step)
                print(f"SAVED {ts.step} {path}", flush=True)
            if after_step is not None:
                after_step(ts, losses[-1])
            if step_delay:
                time.sleep(step_delay)  # only so that a kill lands mid-run; no effect on numbers
            if ts.step >= steps:
                break
        else:
            ts.epoch += 1
    return losses


def write_result(path: Path, ts: TrainState, losses: list[float], start_step: int) -> None:
    torch.save({
        "params": {k: v.detach().clone() for k, v in ts.model.state_dict().items()},
        "optimizer": ts.optimizer.state_dict(),
        "losses": torch.tensor(losses, dtype=torch.float64),
        "start_step": start_step,
        "step": ts.step,
        "epoch": ts.epoch,
    }, path)


def parse_losses(lines: list[str]) -> dict[int, float]:
    """The per-step losses from a worker's output lines ("LOSS <step> <float.hex()>")."""
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and parts[0] == "LOSS":
            out[int(parts[1])] = float.fromhex(parts[2])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["reference", "train", "resume"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ckpt-dir", type=Path)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-workers", type=int, default=0)
    args = ap.parse_args(argv)

    # One thread: the same kernels, hence the same float rounding, in every process.
    torch.set_num_threads(1)
    ts = build(samples=args.samples, batch_size=args.batch_size, num_workers=args.num_workers)
    start = 0
    if args.mode == "resume":
        ckpt = latest_checkpoint(args.ckpt_dir)
        if ckpt is None:
            print(f"no committed checkpoint in {args.ckpt_dir}", file=sys.stderr)
            return 2
        report = resurgo.load(ts, ckpt)
        start = ts.step
        print(f"RESUMED {start} {ckpt} {report.bytes_read}", flush=True)
    if args.mode == "train":
        if args.ckpt_dir is None:
            ap.error("train needs --ckpt-dir")
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        losses = train(ts, args.steps, ckpt_dir=args.ckpt_dir, save_every=args.save_every,
                       step_delay=args.step_delay)
    else:
        losses = train(ts, args.steps)
    if args.out is not None:
        write_result(args.out, ts, losses, start)
    print(f"DONE {ts.step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
