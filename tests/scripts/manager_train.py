"""Training process for tests/test_manager_faults.py: a CheckpointManager run that gets SIGKILLed.

The training loop, data and determinism are examples/kill_resume_worker.py's; the model here is a
wide MLP so that the state (parameters + Adam moments) is ~22 MB and a save takes a while. Each
process restores the newest committed checkpoint through the manager (async saves, keep_last=2,
every ``--save-every`` steps) and trains to ``--steps``.

Output lines (stdout, flushed, parsed by the test):
  RESTORED <step or -1> <digest>   right after restore: what this process starts from
  LOSS <step> <float.hex>          every step
  DIGEST <step> <digest>           the state after each step that is a multiple of --save-every
  EVENT <message>                  the manager's log: saving / staged / committed / deleting / deleted
  DONE <step>                      the run is complete and the result file written
<digest> is xxh3-64 over the bytes of every parameter and optimizer state tensor, in order.
``--slow-delete S`` sleeps S seconds between renaming a checkpoint away and removing its files:
it only widens that window so that kills land in it; the library code is unchanged.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from kill_resume_worker import build, train, write_result  # noqa: E402

from resurgo import CheckpointManager, TrainState  # noqa: E402
from resurgo.storage import local  # noqa: E402


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class WholeLines:
    """stdout shared by threads (the loop's prints, the manager's log from its background thread):
    each line reaches the pipe in one write, so lines never interleave (print writes the text and
    the newline separately)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._pending = threading.local()

    def write(self, text: str) -> int:
        buf = getattr(self._pending, "text", "") + text
        head, sep, tail = buf.rpartition("\n")
        self._pending.text = tail
        if sep:
            with self._lock:
                self._stream.write(head + sep)
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        pass


def digest(ts: TrainState) -> str:
    h = xxhash.xxh3_64()
    tensors = list(ts.model.parameters())
    tensors += [v for s in ts.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--slow-delete", type=float, default=0.0)
    args = ap.parse_args(argv)

    sys.stdout = WholeLines(sys.stdout)  # type: ignore[assignment]
    torch.set_num_threads(1)  # the same kernels, hence the same rounding, in every process
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("EVENT %(message)s"))
    logging.getLogger("resurgo.manager").addHandler(handler)
    logging.getLogger("resurgo.manager").setLevel(logging.INFO)
    if args.slow_delete:
        remove_files = local.remove_checkpoint_dir

        def slowly(path: Path, owned: Any) -> None:  # between the rename away and the removal of files
            time.sleep(args.slow_delete)
            remove_files(path, owned)

        local.remove_checkpoint_dir = slowly  # type: ignore[assignment]

    ts = build(model_cls=WideMLP)
    with CheckpointManager(args.root, every_steps=args.save_every, keep_last=args.keep_last) as mgr:
        restored = mgr.restore(ts)
        print(f"RESTORED {-1 if restored is None else restored} {digest(ts)}", flush=True)
        start = ts.step

        def after_step(state: TrainState, loss: float) -> None:
            if state.step % args.save_every == 0:
                print(f"DIGEST {state.step} {digest(state)}", flush=True)
            mgr.maybe_save(state, state.step, metrics={"loss": loss})

        losses = train(ts, args.steps, after_step=after_step)
    write_result(args.out, ts, losses, start)
    print(f"DONE {ts.step}", flush=True)
    return 0


def forked_main(argv: list[str], out_path: str, err_path: str) -> None:
    """Entry point in a process forked from a pre-imported server (multiprocessing "forkserver"):
    a new process that has imported torch and resurgo and done nothing else, so a restart costs
    no interpreter start. Output goes to ``out_path`` (a FIFO the test reads) and ``err_path``."""
    sys.stderr = open(err_path, "w", buffering=1)
    sys.stdout = open(out_path, "w", buffering=1)
    rc = main(argv)
    sys.stdout.flush()
    sys.exit(rc)


if __name__ == "__main__":
    sys.exit(main())
