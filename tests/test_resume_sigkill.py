"""Real processes: a training run killed with SIGKILL and resumed in a fresh process ends
bit-identical to an uninterrupted run (parameters, optimizer state, every step's loss).

Run A trains N steps uninterrupted. Run B trains with a checkpoint every few steps and is killed
with SIGKILL once it has reported step K's checkpoint committed. Run C, a fresh process, loads
the newest committed checkpoint and trains to N. B's losses up to C's starting step followed by
C's losses must equal A's, bit for bit. Synthetic data only; no network.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from kill_resume_worker import parse_losses  # noqa: E402  (the worker prints the LOSS lines)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_resume.py"
STEPS = 40  # 256 samples / batch 16 = 16 steps per epoch: the kill lands in the second epoch
SAVE_EVERY = 3
KILL_AFTER = 21  # checkpoints at 3, 6, ..., 21 (mid epoch 2), then SIGKILL


def _cmd(*args: str) -> list[str]:
    return [sys.executable, str(SCRIPT), *args]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_sigkill_then_resume_is_bitwise_identical(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    ref_out, resumed_out = tmp_path / "a.pt", tmp_path / "c.pt"

    # A runs alongside B: separate processes, one thread each.
    run_a = subprocess.Popen(_cmd("reference", "--steps", str(STEPS), "--out", str(ref_out)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())

    # step-delay only slows B down so that the kill lands mid-run; it changes no number.
    run_b = subprocess.Popen(
        _cmd("train", "--steps", str(STEPS), "--ckpt-dir", str(ckpt_dir), "--save-every", str(SAVE_EVERY),
             "--step-delay", "0.05"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )
    b_lines: list[str] = []
    killed = False
    try:
        assert run_b.stdout is not None
        for line in run_b.stdout:
            b_lines.append(line)
            if line.startswith(f"SAVED {KILL_AFTER} "):
                run_b.send_signal(signal.SIGKILL)
                killed = True
                break
    finally:
        if run_b.poll() is None and not killed:
            run_b.kill()
        rest, err_b = run_b.communicate(timeout=60)
    b_lines += rest.splitlines()
    assert killed, f"run B never reported step {KILL_AFTER}'s checkpoint:\n{''.join(b_lines)}\n{err_b}"
    assert run_b.returncode == -signal.SIGKILL
    assert not any(line.startswith("DONE") for line in b_lines), "B finished before the kill"

    run_c = subprocess.run(
        _cmd("resume", "--steps", str(STEPS), "--ckpt-dir", str(ckpt_dir), "--out", str(resumed_out)),
        capture_output=True, text=True, env=_env(), timeout=240,
    )
    assert run_c.returncode == 0, run_c.stderr
    _, err_a = run_a.communicate(timeout=240)
    assert run_a.returncode == 0, err_a

    ref = torch.load(ref_out, weights_only=True)
    res = torch.load(resumed_out, weights_only=True)
    start = res["start_step"]
    # C resumed from the newest committed checkpoint: K, or a later one B finished before dying.
    assert start >= KILL_AFTER and start % SAVE_EVERY == 0
    assert f"RESUMED {start} " in run_c.stdout

    b_losses = parse_losses(b_lines)
    assert all(s in b_losses for s in range(1, start + 1))
    combined = torch.tensor([b_losses[s] for s in range(1, start + 1)], dtype=torch.float64)
    combined = torch.cat([combined, res["losses"]])
    assert combined.shape == ref["losses"].shape == (STEPS,)
    mismatch = (combined != ref["losses"]).nonzero().flatten().tolist()
    assert not mismatch, f"losses differ at steps {[i + 1 for i in mismatch]}"

    assert ref["params"].keys() == res["params"].keys()
    for k in ref["params"]:
        assert torch.equal(ref["params"][k], res["params"][k]), k
    ro, co = ref["optimizer"], res["optimizer"]
    assert ro["param_groups"] == co["param_groups"]
    assert ro["state"].keys() == co["state"].keys()
    for i in ro["state"]:
        for name, v in ro["state"][i].items():
            assert torch.equal(v, co["state"][i][name]), f"optimizer state {i}.{name}"
    assert (ref["step"], ref["epoch"]) == (res["step"], res["epoch"]) == (STEPS, 2)
