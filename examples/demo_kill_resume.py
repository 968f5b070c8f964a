"""resurgo's main demonstration: kill -9 a training run, resume it, get the same bits.

1. An uninterrupted reference run trains a small CNN (dropout, random flips, shuffled loader,
   Adam + StepLR) on synthetic CIFAR-10-shaped data for N steps.
2. The same training runs again in a new process, saving ``resurgo.TrainState`` every few steps.
   Once step K's checkpoint is committed, it is killed with SIGKILL at a random moment.
3. A fresh process builds everything anew, loads the newest committed checkpoint (model,
   optimizer, scheduler, scaler, RNGs, DataLoader position, step) and trains to N.
The final weights, the optimizer state and every step's loss are compared with the reference,
bit for bit. Exit status 0 if identical, 1 if not. Synthetic data only; no network needed.

    python examples/demo_kill_resume.py [--steps 60] [--save-every 5] [--kill-after 35]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from kill_resume_worker import parse_losses  # the worker beside this file prints the losses

HERE = Path(__file__).resolve().parent
WORKER = HERE / "kill_resume_worker.py"
console = Console(highlight=False)


def worker_cmd(*args: str) -> list[str]:
    return [sys.executable, str(WORKER), *args]


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run_reference(steps: int, out: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(worker_cmd("reference", "--steps", str(steps), "--out", str(out)),
                          capture_output=True, text=True, env=worker_env())
    if proc.returncode != 0:
        console.print(proc.stderr)
        raise SystemExit("reference run failed")
    return time.perf_counter() - t0


def run_and_kill(steps: int, save_every: int, kill_after: int, ckpt_dir: Path, rng: random.Random) -> tuple[list[str], int]:
    """Train with checkpoints; SIGKILL at a random moment after step ``kill_after``'s save."""
    proc = subprocess.Popen(
        worker_cmd("train", "--steps", str(steps), "--ckpt-dir", str(ckpt_dir), "--save-every", str(save_every),
                   "--step-delay", "0.05"),  # slows it down so the kill lands mid-run; changes no number
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("SAVED "):
            step = int(line.split()[1])
            console.print(f"    [green]checkpoint committed[/] at step {step:>3}  ->  {Path(line.split()[2]).name}")
            if step >= kill_after:
                time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the next steps, maybe mid-save
                proc.send_signal(signal.SIGKILL)
                break
    rest, err = proc.communicate(timeout=120)
    lines += rest.splitlines()
    if proc.returncode != -signal.SIGKILL:
        console.print(err)
        raise SystemExit(f"the training process was not killed (exit status {proc.returncode})")
    last_step = max(parse_losses(lines) or {0: 0.0})
    return lines, last_step


def run_resume(steps: int, ckpt_dir: Path, out: Path) -> tuple[int, str, int, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(worker_cmd("resume", "--steps", str(steps), "--ckpt-dir", str(ckpt_dir), "--out", str(out)),
                          capture_output=True, text=True, env=worker_env())
    if proc.returncode != 0:
        console.print(proc.stderr)
        raise SystemExit("resume run failed")
    for line in proc.stdout.splitlines():
        if line.startswith("RESUMED "):
            _, step, path, nbytes = line.split()
            return int(step), path, int(nbytes), time.perf_counter() - t0
    raise SystemExit("resume run did not report its checkpoint")


def compare(ref: dict, res: dict, combined: torch.Tensor) -> list[tuple[str, str, bool]]:
    rows = []
    params_same = ref["params"].keys() == res["params"].keys() and all(
        torch.equal(ref["params"][k], res["params"][k]) for k in ref["params"])
    n_values = sum(v.numel() for v in ref["params"].values())
    rows.append(("model parameters", f"{len(ref['params'])} tensors, {n_values:,} values", params_same))
    ro, co = ref["optimizer"], res["optimizer"]
    opt_same = ro["param_groups"] == co["param_groups"] and ro["state"].keys() == co["state"].keys() and all(
        torch.equal(v, co["state"][i][name]) for i in ro["state"] for name, v in ro["state"][i].items())
    n_opt = sum(v.numel() for s in ro["state"].values() for v in s.values())
    rows.append(("optimizer state (Adam)", f"{n_opt:,} values", opt_same))
    same_losses = combined.shape == ref["losses"].shape and bool((combined == ref["losses"]).all())
    rows.append(("loss at every step", f"{ref['losses'].numel()} steps", same_losses))
    rows.append(("step / epoch counters", f"{res['step']} / {res['epoch']}",
                 (ref["step"], ref["epoch"]) == (res["step"], res["epoch"])))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--kill-after", type=int, default=35, help="kill after this step's checkpoint is committed")
    ap.add_argument("--seed", type=int, default=None, help="seed for the moment of the kill (default: random)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep checkpoints here (default: a temp dir)")
    args = ap.parse_args()
    if not 0 < args.kill_after < args.steps:
        ap.error("--kill-after must be between 0 and --steps")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="resurgo-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt_dir = work / "ckpt"
    if ckpt_dir.exists():
        shutil.rmtree(ckpt_dir)
    ref_out, res_out = work / "reference.pt", work / "resumed.pt"
    kill_rng = random.Random(args.seed)

    console.print(Panel.fit(
        "[bold]resurgo[/]: kill -9 during training, resume in a fresh process, compare bits\n"
        "small CNN with dropout; 256 synthetic CIFAR-10-shaped images with random\n"
        f"flips, shuffled, batch 16; Adam + StepLR; {args.steps} steps; a checkpoint\n"
        f"(resurgo.TrainState) every {args.save_every} steps",
        border_style="cyan"))

    console.print("[bold]1.[/] uninterrupted reference run ...", end=" ")
    t = run_reference(args.steps, ref_out)
    console.print(f"{args.steps} steps in {t:.1f} s")

    console.print(f"[bold]2.[/] training run with checkpoints; [red]SIGKILL[/] after step {args.kill_after}'s checkpoint")
    b_lines, last_step = run_and_kill(args.steps, args.save_every, args.kill_after, ckpt_dir, kill_rng)
    console.print(f"    [red]killed[/] after step {last_step} (exit status -9: no handler, no clean-up)")
    entries = sorted(ckpt_dir.iterdir())
    committed = [p for p in entries if p.name.startswith("step_")]
    leftovers = [p for p in entries if p not in committed]
    size = sum(f.stat().st_size for f in committed[-1].rglob("*") if f.is_file()) if committed else 0
    console.print(f"    on disk: {len(committed)} committed checkpoints, {human(size)} each")
    if leftovers:
        console.print(f"    and {len(leftovers)} unfinished temporary dir(s) of the killed save (never loaded)")

    console.print("[bold]3.[/] fresh process: build everything anew, resurgo.load the newest checkpoint")
    start, path, nbytes, t = run_resume(args.steps, ckpt_dir, res_out)
    console.print(f"    resumed from {Path(path).name} (read {human(nbytes)}); steps {start + 1}..{args.steps} in {t:.1f} s")
    if last_step > start:
        lost = f"step {last_step} was" if last_step == start + 1 else f"steps {start + 1}..{last_step} were"
        console.print(f"    ({lost} lost with the killed process, and redone)")

    ref = torch.load(ref_out, weights_only=True)
    res = torch.load(res_out, weights_only=True)
    b_losses = parse_losses(b_lines)
    combined = torch.cat([torch.tensor([b_losses[s] for s in range(1, start + 1)], dtype=torch.float64),
                          res["losses"]])

    table = Table(title="loss per step (float32, printed exactly)", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("uninterrupted", justify="right")
    table.add_column("killed + resumed", justify="right")
    table.add_column("run", justify="left")
    table.add_column("same bits", justify="center")
    shown = sorted({1, 2} | set(range(max(1, start - 1), min(args.steps, start + 3) + 1)) | {args.steps - 1, args.steps})
    prev = 0
    for s in shown:
        if s - prev > 1:
            table.add_row("...", "", "", "", "")
        a = ref["losses"][s - 1].item()
        b = combined[s - 1].item() if s - 1 < combined.numel() else float("nan")
        table.add_row(str(s), f"{a:.9g}", f"{b:.9g}", "before kill" if s <= start else "resumed",
                      "[green]yes[/]" if a == b else "[red]NO[/]")
        prev = s
    console.print(table)

    rows = compare(ref, res, combined)
    summary = Table(title="uninterrupted vs killed + resumed", title_justify="left")
    summary.add_column("what")
    summary.add_column("size", justify="right")
    summary.add_column("bit-identical", justify="center")
    for what, size_s, ok in rows:
        summary.add_row(what, size_s, "[green]yes[/]" if ok else "[red]NO[/]")
    console.print(summary)

    ok = all(r[2] for r in rows)
    if ok:
        console.print(Panel.fit(f"[bold green]IDENTICAL[/]: killed after step {last_step}, resumed from step {start};\n"
                                "final weights bit-identical to the uninterrupted run", border_style="green"))
    else:
        console.print(Panel.fit("[bold red]DIFFERENT[/]: the resumed run does not match the uninterrupted one",
                                border_style="red"))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        console.print(f"checkpoints kept in {ckpt_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
