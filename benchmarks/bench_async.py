"""Checkpointing inside a training loop: stall, time to durable, peak memory, training overhead.

A CPU training loop (default: a ~100M-parameter MLP of Linear(4096, 4096) layers with AdamW, so
~1.2 GB of model + optimizer state) checkpoints every N steps with each mechanism: torch.save,
DCP save, DCP async_save (default, and with a reusable DefaultStager), resurgo.save,
resurgo.async_save, resurgo.async_save(guard=optimizer), plus a reference row that only copies
the state into warm preallocated buffers. Each mechanism runs in a fresh process, once per
repetition, in a rotated order; inside that process a window of the same loop without
checkpoints is the baseline for the overhead. See benchmarks/README.md for how to read it.

    .venv/bin/python benchmarks/bench_async.py [--params-m 100] [--every 12] [--steps 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import jsonable  # noqa: E402

SCHEMA = "resurgo-bench-async/1"
REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30

# name -> (label, note). The order here is the order of the table.
MECHANISMS: dict[str, tuple[str, str]] = {
    "copy": ("copy into warm buffers (reference)",
             "copy_ of every tensor into buffers allocated at the first checkpoint; writes nothing"),
    "torch": ("torch.save + fsync",
              "torch.save({model, optimizer state_dicts, step}) then fsync file and dirs; synchronous"),
    "dcp": ("DCP save",
            "torch.distributed.checkpoint.save(get_state_dict(model, optimizer), no_dist=True) "
            "then fsync; synchronous"),
    "dcp_async": ("DCP async_save (default)",
                  "dcp.async_save(no_dist=True): fresh staging copy per call, thread executor; "
                  "the next call first waits for the previous upload"),
    "dcp_async_stager": ("DCP async_save + DefaultStager",
                         "caller-owned DefaultStager reused across saves (cached staging storages; "
                         "pinned + non-blocking only with CUDA), async staging: the next "
                         "optimizer.step() waits for staging_completion"),
    "resurgo": ("resurgo.save", "synchronous; fsyncs and commits itself"),
    "resurgo_async": ("resurgo.async_save", "returns after copying into reused staging buffers"),
    "resurgo_async_guard": ("resurgo.async_save(guard=opt)",
                            "params + optimizer state copied in the background; a hook makes the "
                            "next optimizer.step() wait for that copy"),
}
WRITES = set(MECHANISMS) - {"copy"}

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*Ignoring pin_memory flag.*")
warnings.filterwarnings("ignore", category=FutureWarning)


# --------------------------------------------------------------------------------------------
# memory: /proc/self/status, and resetting the peak (VmHWM) before each window
# --------------------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, val = line.split(":", 1)
                out[key] = int(val.split()[0]) * 1024
    return out


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (writing 5 to clear_refs, Linux >= 4.0). False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Fallback when clear_refs is refused: samples VmRSS every 5 ms in a thread (misses spikes
    shorter than that, and costs a little CPU in every window alike)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status()["VmRSS"])
            self._stop.wait(0.005)

    def __enter__(self):
        self.peak = proc_status()["VmRSS"]
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, proc_status()["VmRSS"])


class PeakRss:
    """Peak RSS over a region: VmHWM after a reset, or the sampler when reset is refused."""

    def __init__(self, use_hwm: bool):
        self.use_hwm = use_hwm
        self.peak = 0
        self._sampler: RssSampler | None = None

    def __enter__(self):
        if self.use_hwm:
            reset_hwm()
        else:
            self._sampler = RssSampler().__enter__()
        return self

    def __exit__(self, *exc):
        if self.use_hwm:
            self.peak = proc_status()["VmHWM"]
        else:
            assert self._sampler is not None
            self._sampler.__exit__(*exc)
            self.peak = self._sampler.peak


# --------------------------------------------------------------------------------------------
# the training job
# --------------------------------------------------------------------------------------------


def model_shape(params_m: float, width: int | None) -> tuple[int, int]:
    """(width, layers) of an MLP of Linear(width, width) layers with about params_m million params."""
    p = params_m * 1e6
    if width is None:
        width = 4096
        while width > 64 and p / (width * width + width) < 2:
            width //= 2
    layers = max(1, round(p / (width * width + width)))
    return width, layers


def build(cfg: dict):
    import torch

    torch.manual_seed(cfg["seed"])
    width, layers = cfg["width"], cfg["layers"]
    mods: list = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    device = torch.device(cfg.get("device", "cpu"))  # bench_overhead.py builds without one
    model = torch.nn.Sequential(*mods).to(device)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cfg["fused"])
    except (RuntimeError, ValueError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    x = torch.randn(cfg["batch"], width, generator=g).to(device)
    y = torch.randn(cfg["batch"], width, generator=g).to(device)
    return model, opt, x, y


def settle_device(model) -> None:
    """On CUDA, wait for what the training stream has queued, so that host timings include it
    (kernels run behind the Python that queued them); on CPU nothing to do."""
    import torch

    dev = next(model.parameters()).device
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def train_step(model, opt, x, y) -> None:
    import torch.nn.functional as F

    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    settle_device(model)


def state_tensors(model, opt) -> dict:
    """{key: tensor} of everything checkpointed: model state_dict and optimizer state tensors."""
    import torch

    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer.state.{pid}.{name}"] = v
    return out


def mismatches(expected: dict, got: dict) -> list[str]:
    import common

    got = {k: v.cpu() for k, v in got.items() if k.startswith(("model.", "optimizer.state."))}
    return common.bitwise_mismatches({k: v.cpu() for k, v in expected.items()}, got)


# --------------------------------------------------------------------------------------------
# mechanisms (worker side): resurgo.study.mechanisms, driven by this loop
# --------------------------------------------------------------------------------------------

# the rows whose names differ from the shared mechanisms' names
SHARED_NAMES = {"torch": "torch_save"}


class Pending:
    """A checkpoint still being written: a thread waits for it and notes when it is durable."""

    def __init__(self, t0: float, wait_fn):
        self.t0 = t0
        self.t_done: float | None = None
        self.error: BaseException | None = None
        self.report = None
        self._thread = threading.Thread(target=self._run, args=(wait_fn,), daemon=True,
                                        name="bench-waiter")
        self._thread.start()

    def _run(self, wait_fn) -> None:
        try:
            self.report = wait_fn()
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.t_done = time.perf_counter()

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error

    @property
    def durable_s(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t0


def copy_reference():
    """The reference row: copy_ of every tensor into buffers allocated at the first checkpoint;
    writes nothing. A Mechanism like the shared ones, so that the loop drives it alike."""
    import torch

    from resurgo.study.mechanisms import Mechanism

    class CopyRef(Mechanism):
        name = "copy"

        def save(self, job, path):
            src = state_tensors(job.model, job.optimizer)
            if not hasattr(self, "buffers"):  # the first (untimed, warm-up) checkpoint allocates
                cuda = next(iter(src.values())).is_cuda  # page-locked host buffers for a device state
                self.buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in src.items()}
                self.groups = job.optimizer.state_dict()["param_groups"]
            for k, v in src.items():
                self.buffers[k].copy_(v, non_blocking=v.is_cuda)  # the caller's settle_device waits
            self.step = job.step
            return None

        def load(self, job, path):
            model = {k.removeprefix("model."): v for k, v in self.buffers.items() if k.startswith("model.")}
            state: dict = {}
            for k, v in self.buffers.items():
                if k.startswith("optimizer.state."):
                    _, _, pid, name = k.split(".", 3)
                    state.setdefault(int(pid), {})[name] = v
            job.model.load_state_dict(model)
            job.optimizer.load_state_dict({"state": state, "param_groups": self.groups})
            return self.step

    return CopyRef()


class Checkpointer:
    """One mechanism checkpointing the loop's job: ``checkpoint`` is the call the loop is blocked
    in, and returns a :class:`Pending` for a save that completes in the background."""

    def __init__(self, name: str, model, opt):
        import common
        from resurgo.study.mechanisms import make_mechanism
        from resurgo.study.training import Training

        # the loop feeds fixed batches and draws no random numbers: no loader, no RNG to save
        self.name, self.job = name, Training(model, opt, rng=False)
        if name == "copy":
            self.mech = copy_reference()
        else:  # torch.save leaves its files unsynced and DCP its directories: durable means fsynced
            self.mech = make_mechanism(SHARED_NAMES.get(name, name), common.fsync_tree)

    def checkpoint(self, step: int, path: Path) -> Pending | None:
        t0 = time.perf_counter()
        self.job.step = step
        done = self.mech.save(self.job, path)
        return None if done is None else Pending(t0, done)

    def extra(self) -> dict:
        """Per-checkpoint facts the mechanism reports about itself (JSON)."""
        return jsonable(self.mech.facts())

    def load_fresh(self, cfg: dict, path: Path) -> tuple[dict, int | None]:
        """({key: tensor} of state_tensors, step) restored from path into a newly built job."""
        from resurgo.study.training import Training

        model, opt, _, _ = build(cfg)
        step = self.mech.load(Training(model, opt, rng=False), path)
        return state_tensors(model, opt), step

    def close(self) -> None:
        self.mech.close()


def availability(name: str) -> str | None:
    """None if the mechanism can run here, else why not (printed as a note, row skipped)."""
    try:
        if name.startswith("dcp"):
            import torch.distributed.checkpoint as dcp

            if name != "dcp" and not hasattr(dcp, "async_save"):
                return "torch.distributed.checkpoint.async_save not in this torch"
            if name == "dcp_async_stager":
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        if name.startswith("resurgo"):
            import resurgo

            fn = resurgo.save if name == "resurgo" else resurgo.async_save
            if name == "resurgo_async_guard" and "guard" not in inspect.signature(fn).parameters:
                return "resurgo.async_save has no guard= parameter yet"
    except (ImportError, AttributeError) as e:
        return f"not importable: {type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------------
# the worker: one mechanism, one repetition, one fresh process
# --------------------------------------------------------------------------------------------


class StepProbe:
    """Times the wait a hook adds before ``optimizer.step()``, and runs one-shot hooks.

    A pre-hook registered first (before any mechanism's) stamps every step; a one-shot pre-hook
    registered right after each checkpoint call runs after the mechanism's own hook, so the gap
    between the two is the wait for the snapshot (~microseconds when there is nothing to wait for).
    One-shot hooks are removed after the step (``cleanup``), never while optimizer.step() iterates
    over its hooks: that raises "OrderedDict mutated during iteration".
    """

    def __init__(self, opt, settle=lambda: None):
        self.opt = opt
        self.settle = settle  # on CUDA: the wait is the training stream's, not the host's
        self.t_pre = 0.0
        self._spent: list = []
        opt.register_step_pre_hook(self._stamp)

    def _stamp(self, *_):
        self.settle()
        self.t_pre = time.perf_counter()

    def once(self, fn) -> None:
        holder: dict = {}

        def hook(*_):
            if not holder.get("fired"):
                holder["fired"] = True
                fn()
                self._spent.append(holder["h"])

        holder["h"] = self.opt.register_step_pre_hook(hook)

    def arm(self, rec: dict) -> None:
        def probe():
            self.settle()
            rec["guard_wait_s"] = time.perf_counter() - self.t_pre

        self.once(probe)

    def cleanup(self) -> None:
        while self._spent:
            self._spent.pop().remove()


def worker(cfg: dict) -> dict:
    import torch

    import common

    mech_name = cfg["mechanism"]
    if mech_name.startswith("dcp"):
        import torch.distributed.checkpoint  # noqa: F401
    if mech_name.startswith("resurgo"):
        import resurgo  # noqa: F401
    t_begin = time.perf_counter()
    model, opt, x, y = build(cfg)
    t_built = time.perf_counter()
    mech = Checkpointer(mech_name, model, opt)
    probe = StepProbe(opt, lambda: settle_device(model))

    def step() -> None:
        train_step(model, opt, x, y)
        probe.cleanup()

    root = Path(cfg["root"])
    common.remove(root)
    root.mkdir(parents=True)
    use_hwm = reset_hwm()
    common.freeze_gc()

    res: dict = {"mechanism": mech_name, "rep": cfg["rep"], "pid": os.getpid(),
                 "hwm_reset": use_hwm, "windows_order": cfg["windows_order"]}
    phases: dict[str, float] = {"build": t_built - t_begin}  # the worker's untimed seconds

    class phase:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self):
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            phases[self.name] = phases.get(self.name, 0.0) + time.perf_counter() - self.t0

    # warm-up: the first steps allocate the optimizer state and are several times slower
    with phase("warmup"):
        for _ in range(cfg["warmup_steps"]):
            step()
    with PeakRss(use_hwm) as pk:  # training's own peak: params, state, grads, activations
        for _ in range(2):
            step()
    res["train_peak_rss"] = pk.peak
    tensors = state_tensors(model, opt)
    res["state_bytes"] = sum(common.tensor_nbytes(t) for t in tensors.values())
    res["n_tensors"] = len(tensors)
    res["params"] = sum(p.numel() for p in model.parameters())
    del tensors
    step_no = cfg["warmup_steps"] + 2

    def heat_and_settle(heat: bool) -> None:
        with phase("sync"):
            gc.collect()
            os.sync()
        if heat and cfg["heat"] and cfg["device"] == "cpu":
            with phase("heat"):
                common.heat_page_cache(root / ".heat-scratch",
                                       (common.byte_view(t) for t in state_tensors(model, opt).values()))

    def first_checkpoint() -> dict:
        """Untimed: the first save allocates staging buffers and pays one-time costs, which a
        long job pays once. Verified bitwise (snapshot semantics: training mutates everything
        right after the call) in the repetitions that verify."""
        nonlocal step_no
        path = root / "first"
        with phase("verify"):
            ref = ({k: v.detach().to("cpu", copy=True) for k, v in state_tensors(model, opt).items()}
                   if cfg["verify"] else None)
        rec: dict = {"step": step_no}
        heat_and_settle(False)
        t0 = time.perf_counter()
        pend = mech.checkpoint(step_no, path)
        settle_device(model)  # a copy the training stream must wait for is part of the stall
        rec["call_s"] = time.perf_counter() - t0
        probe.arm(rec)
        saved_step = step_no
        for _ in range(2):  # change every parameter and optimizer tensor at once
            step()
            step_no += 1
        if pend is not None:
            pend.join()
            rec["durable_s"] = pend.durable_s
        elif mech_name != "copy":
            rec["durable_s"] = rec["call_s"]
        rec["stall_s"] = rec["call_s"] + rec.get("guard_wait_s", 0.0)
        rec.update(mech.extra())
        phases["first_checkpoint"] = time.perf_counter() - t0
        if ref is not None:
            t_verify = time.perf_counter()
            loaded, loaded_step = mech.load_fresh(cfg, path)  # as a restarted script would
            bad = mismatches(ref, loaded)
            if loaded_step != saved_step:
                bad.append(f"step: got {loaded_step!r}, expected {saved_step}")
            res["verified"] = not bad
            res["verify_errors"] = bad[:10]
            if cfg["keep"] and mech_name in WRITES:
                torch.save({"tensors": ref, "step": saved_step}, root / "reference.pt")
            del loaded, ref
            phases["verify"] += time.perf_counter() - t_verify
        if not (cfg["keep"] and mech_name in WRITES):
            with phase("cleanup"):
                common.remove(path)
        return rec

    def window(with_ckpt: bool) -> dict:
        """`steps` training steps; with_ckpt: checkpoint after every `every`-th step (not the
        last). The window ends when training is done *and* every checkpoint is durable."""
        nonlocal step_no
        wdir = root / "window"
        if with_ckpt:
            common.remove(wdir)
            wdir.mkdir()
        heat_and_settle(with_ckpt)
        steps = cfg["steps"] if with_ckpt else cfg["base_steps"]
        every = cfg["every"]
        step_s, ckpts, pending = [], [], []
        with PeakRss(use_hwm) as pk:
            t_start = time.perf_counter()
            for i in range(steps):
                ts = time.perf_counter()
                step()
                step_no += 1
                step_s.append(time.perf_counter() - ts)
                if with_ckpt and (i + 1) % every == 0 and (i + 1) < steps:
                    rec: dict = {"step": step_no, "window_step": i + 1}
                    t0 = time.perf_counter()
                    pend = mech.checkpoint(step_no, wdir / f"step{step_no:07d}")
                    settle_device(model)
                    rec["call_s"] = time.perf_counter() - t0
                    probe.arm(rec)
                    rec.update(mech.extra())
                    ckpts.append((rec, pend))
                    if pend is not None:
                        pending.append(pend)
            t_steps = time.perf_counter()
            for pend in pending:
                pend.join()
            t_end = time.perf_counter()
        out_ckpts = []
        for rec, pend in ckpts:
            rec["stall_s"] = rec["call_s"] + rec.get("guard_wait_s", 0.0)
            if pend is not None:
                rec["durable_s"] = pend.durable_s
                if pend.report is not None and mech_name.startswith("resurgo"):
                    rec["report"] = jsonable(pend.report)
            elif mech_name != "copy":
                rec["durable_s"] = rec["call_s"]
            out_ckpts.append(rec)
        files = common.file_sizes(wdir) if with_ckpt else []
        if with_ckpt and not (cfg["keep"] and mech_name in WRITES):
            with phase("cleanup"):
                common.remove(wdir)
        return {"time_s": t_end - t_start, "tail_wait_s": t_end - t_steps, "step_s": step_s,
                "peak_rss": pk.peak, "checkpoints": out_ckpts,
                "bytes_written": sum(f["bytes"] for f in files)}

    for w in cfg["windows_order"]:
        if w == "mech":
            res["first_checkpoint"] = first_checkpoint()
            res["mech"] = window(True)
        else:
            res["base"] = window(False)
    mech.close()
    res["phases"] = phases
    res["worker_s"] = time.perf_counter() - t_begin
    return res


# --------------------------------------------------------------------------------------------
# the parent: repetitions, interleaving, summary
# --------------------------------------------------------------------------------------------


def median(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


AFTER_STEPS = 8


def step_time_cost(mech: dict) -> float | None:
    """What one checkpoint cost training, from the checkpointing window's own step times: the
    call, plus the excess of the AFTER_STEPS steps that followed it (a guard's wait and the
    background work land there) over the median of the window's other steps, plus its share of
    the final wait for durability. Unlike per_ckpt_cost_s it needs no second window, so a
    machine that drifts between windows does not bias it (bench_overhead.py does the same)."""
    ck, steps = mech["checkpoints"], mech["step_s"]
    if not ck:
        return None
    hit = {i for c in ck for i in range(c["window_step"], min(c["window_step"] + AFTER_STEPS, len(steps)))}
    rest = [x for i, x in enumerate(steps) if i not in hit]
    if not rest:
        return None
    med = median(rest)
    total = sum(c["call_s"] for c in ck) + mech["tail_wait_s"] + sum(steps[i] - med for i in hit)
    return total / len(ck)


def run_metrics(res: dict, every: int) -> dict:
    """The numbers of one (mechanism, repetition) run."""
    mech, base = res["mech"], res["base"]
    ck = mech["checkpoints"]
    n = len(ck)
    t_step = base["time_s"] / len(base["step_s"])
    t_plain = t_step * len(mech["step_s"])  # the checkpointing window's steps without checkpoints
    per_ckpt = (mech["time_s"] - t_plain) / n if n else None
    med_step = median(base["step_s"])
    # the step right after each checkpoint (where a guard waits and a background copy overlaps)
    nxt = [mech["step_s"][c["window_step"]] - med_step for c in ck
           if c["window_step"] < len(mech["step_s"])]
    return {
        "step_cost_s": step_time_cost(mech),
        "stall_s": median([c["stall_s"] for c in ck]),
        "call_s": median([c["call_s"] for c in ck]),
        "guard_wait_s": median([c.get("guard_wait_s") for c in ck]),
        "durable_s": median([c.get("durable_s") for c in ck]),
        "first_stall_s": res["first_checkpoint"]["stall_s"],
        "first_durable_s": res["first_checkpoint"].get("durable_s"),
        "peak_extra_rss": mech["peak_rss"] - res["train_peak_rss"],
        "base_peak_extra_rss": base["peak_rss"] - res["train_peak_rss"],
        "next_step_excess_s": median(nxt),
        "window_overhead_pct": 100.0 * (mech["time_s"] - t_plain) / t_plain,
        "per_ckpt_cost_s": per_ckpt,
        "step_s": t_step,
        "overhead_at_every_pct": (100.0 * per_ckpt / (every * t_step)) if per_ckpt is not None else None,
        "tail_wait_s": mech["tail_wait_s"],
        "n_checkpoints": n,
    }


METRICS = ["step_cost_s", "stall_s", "call_s", "guard_wait_s", "next_step_excess_s", "durable_s",
           "first_stall_s", "first_durable_s",
           "peak_extra_rss", "base_peak_extra_rss", "window_overhead_pct", "per_ckpt_cost_s",
           "step_s", "overhead_at_every_pct", "tail_wait_s"]


def summarize(results: dict, state_bytes: int, every: int) -> dict:
    ok = {k: r for k, r in results.items() if r["status"] == "ok" and r["runs"]}
    for r in ok.values():
        r["per_rep"] = {m: [run_metrics(x, every)[m] for x in r["runs"]] for m in METRICS}
        r["median"] = {m: median(v) for m, v in r["per_rep"].items()}
        pe = r["median"]["peak_extra_rss"]
        r["median"]["peak_extra_x_state"] = pe / state_bytes if pe is not None else None

    def paired(name: str, ref: str, key: str):
        # median over repetitions of (name's value / ref's value) in the same repetition
        if name not in ok or ref not in ok:
            return None
        a = {x["rep"]: run_metrics(x, every)[key] for x in ok[name]["runs"]}
        b = {x["rep"]: run_metrics(x, every)[key] for x in ok[ref]["runs"]}
        return median([a[k] / b[k] for k in a if k in b and a[k] is not None and b[k]])

    for name, r in ok.items():
        r["ratios"] = {
            "stall_vs_dcp_async": paired(name, "dcp_async", "stall_s"),
            "stall_vs_dcp_async_stager": paired(name, "dcp_async_stager", "stall_s"),
            "stall_vs_copy": paired(name, "copy", "stall_s"),
            "per_ckpt_cost_vs_dcp": paired(name, "dcp", "per_ckpt_cost_s"),
        }
    return ok


def evaluate_targets(ok: dict) -> list[dict]:
    def get(name, *path):
        r = ok.get(name)
        for p in path:
            if r is None:
                return None
            r = r.get(p)
        return r

    def target(name, value, threshold):
        status = "SKIP" if value is None else ("PASS" if value <= threshold else "FAIL")
        return {"name": name, "value": value, "op": "<=", "threshold": threshold, "unit": "x",
                "status": status}

    # The training-time target (<= 1% at an N where DCP's save adds > 10%) is bench_overhead.py's:
    # it measures at that N, where this run's N would have to be extrapolated from.
    return [
        target("resurgo async stall <= 0.5x DCP async_save's blocking time",
               get("resurgo_async", "ratios", "stall_vs_dcp_async"), 0.5),
        target("resurgo async stall <= 1.2x a plain copy into warm buffers",
               get("resurgo_async", "ratios", "stall_vs_copy"), 1.2),
        target("resurgo async (guard) stall <= 0.1x DCP async_save's blocking time",
               get("resurgo_async_guard", "ratios", "stall_vs_dcp_async"), 0.1),
        target("resurgo async peak extra RSS <= 1.1x the state's bytes",
               get("resurgo_async", "median", "peak_extra_x_state"), 1.1),
        target("resurgo async (guard) peak extra RSS <= 1.1x the state's bytes",
               get("resurgo_async_guard", "median", "peak_extra_x_state"), 1.1),
    ]


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def _f(v, fmt="{:.3f}", none="-"):
    return none if v is None else fmt.format(v)


def print_report(console, doc: dict) -> None:
    from rich.table import Table

    cfg, st = doc["config"], doc["state"]
    results = doc["mechanisms"]
    table = Table(
        title=(f"checkpoint every {cfg['every']} of {cfg['steps']} steps, "
               f"{cfg['params_m_actual']:.1f}M-param "
               f"MLP + AdamW on {cfg.get('device', 'cpu')}, state {st['state_bytes'] / GiB:.2f} GiB, {cfg['repeats']} reps: medians; "
               "ratios = median of per-rep ratios"),
        title_justify="left",
    )
    cols = ["mechanism", "stall\ns/ckpt", "call\ns", "guard\nwait s", "next step\n+s", "first\nstall s",
            "durable\ns", "peak extra\nRSS GiB", "extra\nx state", "cost\ns/ckpt", "cost by\nsteps s",
            f"overhead\n@N={cfg['every']}", "stall x\nDCP async", "stall x\nstager", "stall x\ncopy"]
    for i, c in enumerate(cols):
        table.add_column(c, justify="left" if i == 0 else "right")
    for name, r in results.items():
        if r["status"] != "ok" or "median" not in r:
            table.add_row(name, f"[yellow]{r['status']}[/]", *[""] * (len(cols) - 2))
            continue
        m, ra = r["median"], r["ratios"]
        table.add_row(
            name, _f(m["stall_s"]), _f(m["call_s"]), _f(m["guard_wait_s"]),
            _f(m["next_step_excess_s"], "{:+.3f}"), _f(m["first_stall_s"]), _f(m["durable_s"], "{:.2f}"),
            _f(m["peak_extra_rss"] / GiB if m["peak_extra_rss"] is not None else None, "{:.2f}"),
            _f(m["peak_extra_x_state"], "{:.2f}x"), _f(m["per_ckpt_cost_s"]), _f(m["step_cost_s"]),
            _f(m["overhead_at_every_pct"], "{:+.1f}%"),
            _f(ra["stall_vs_dcp_async"], "{:.2f}x"), _f(ra["stall_vs_dcp_async_stager"], "{:.2f}x"),
            _f(ra["stall_vs_copy"], "{:.2f}x"),
        )
    console.print(table)
    for name, r in results.items():
        extra = ""
        if r["status"] != "ok":
            extra = f"  [yellow]{r['status']}: {r['reason']}[/]"
        elif r.get("verified") is False:
            extra = f"  [red]checkpoint did not load back equal: {r.get('verify_errors')}[/]"
        console.print(f"  [bold]{name}[/]: {r['label']}: {r['note']}.{extra}")
    base_step = median([r["median"]["step_s"] for r in results.values() if r.get("median")])
    console.print(f"  training step (no checkpoint) {_f(base_step)} s; state "
                  f"{st['state_bytes']:,} bytes in {st['n_tensors']} tensors")
    console.print()
    for t in doc["targets"]:
        color = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}[t["status"]]
        val = _f(t["value"], "{:.2f}x", "n/a") + f" (need <= {t['threshold']}x)"
        console.print(f"[{color}]{t['status']}[/]  {t['name']}: {val}")
    console.print(f"  the overhead at N={cfg['every']} is the table's; at the N where DCP's save adds 10%, "
                  "`make bench-overhead` measures it")


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=100,
                   help="model size in millions of parameters (default 100; state = 12 bytes/param)")
    p.add_argument("--width", type=int, default=None,
                   help="Linear width (default 4096, halved until there are >= 2 layers)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--steps", type=int, default=24,
                   help="training steps of the checkpointing window (default 24)")
    p.add_argument("--base-steps", type=int, default=12,
                   help="steps of the window without checkpoints, the baseline (default 12)")
    p.add_argument("--every", type=int, default=12,
                   help="checkpoint after every N-th step of a window, not after the last (default 12)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="untimed steps before anything is measured (default 2)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "async.json",
                   help="JSON output (default bench-results/async.json)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where checkpoints are written (default: a fresh dir beside --out; a real "
                        "disk, not tmpfs)")
    p.add_argument("--only", default=None, help="comma-separated subset of: " + ",".join(MECHANISMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify-reps", type=int, default=1,
                   help="repetitions whose first checkpoint is loaded back and compared bitwise "
                        "(default 1: the first)")
    p.add_argument("--no-heat", action="store_true",
                   help="no page-cache heat before each window (see common.heat_page_cache)")
    p.add_argument("--no-fused", action="store_true", help="AdamW without fused=True")
    p.add_argument("--device", default="cpu",
                   help="where the model trains: cpu (default) or cuda (staging is then page-locked "
                        "host memory and every timing waits for the training stream)")
    p.add_argument("--keep", action="store_true",
                   help="keep each mechanism's verified first checkpoint and its reference.pt "
                        "(last repetition) and the last window's checkpoints")
    p.add_argument("--strict", action="store_true", help="exit 1 if a target FAILs")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:  # internal: one mechanism, one repetition
        cfg = json.loads(args.worker)
        try:
            res = worker(cfg)
        except BaseException as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        tmp = Path(cfg["result"] + ".tmp")
        tmp.write_text(json.dumps(res, default=repr))
        os.replace(tmp, cfg["result"])
        os._exit(0 if "error" not in res else 3)  # an in-flight save's atexit wait is not ours

    import common
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200, highlight=False)
    if args.every < 1 or args.steps <= args.every:
        raise SystemExit("--steps must be larger than --every (the last step takes no checkpoint)")
    out: Path = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = (args.workdir or out.parent / f"async-work-{os.getpid()}").resolve()
    created_workdir = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    fstype = common.fs_type(workdir)
    if fstype in ("tmpfs", "ramfs"):
        console.print(f"[red]warning: {workdir} is on {fstype}: fsync and 'durable' mean nothing[/]")

    names = list(MECHANISMS)
    if args.only:
        wanted = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = set(wanted) - set(MECHANISMS)
        if unknown:
            raise SystemExit(f"--only: unknown mechanisms {sorted(unknown)}")
        names = [n for n in names if n in wanted]
    results: dict[str, dict[str, Any]] = {
        n: {"label": MECHANISMS[n][0], "note": MECHANISMS[n][1], "status": "ok", "reason": None,
            "runs": [], "verified": None, "verify_errors": []}
        for n in names
    }
    for n in names:
        why = availability(n)
        if why:
            results[n].update(status="skipped", reason=why)
            console.print(f"[yellow]note: skipping {n}: {why}[/]")

    width, layers = model_shape(args.params_m, args.width)
    params = layers * (width * width + width)
    base_cfg = {"width": width, "layers": layers, "batch": args.batch, "steps": args.steps,
                "base_steps": args.base_steps,
                "every": args.every, "warmup_steps": args.warmup_steps, "seed": args.seed,
                "heat": not args.no_heat, "fused": not args.no_fused, "device": args.device}
    n_ckpt = (args.steps - 1) // args.every
    loadavg = {"start": os.getloadavg()}
    console.print(
        f"model: {layers} x Linear({width}, {width}) = {params / 1e6:.1f}M params + AdamW on {args.device} "
        f"(~{params * 12 / GiB:.2f} GiB of state); {args.steps} steps per window, checkpoint every "
        f"{args.every} ({n_ckpt} per window); {args.repeats} reps x {len(names)} mechanisms, one "
        f"process each; workdir {workdir} ({fstype}); load average {loadavg['start'][0]:.2f} on "
        f"{os.cpu_count()} CPUs")

    orders, t_run = [], time.perf_counter()
    for rep in range(args.repeats):
        active = [n for n in names if results[n]["status"] == "ok"]
        order = common.rotated(active if rep % 2 == 0 else active[::-1], rep)
        orders.append(order)
        for pos, name in enumerate(order):
            if results[name]["status"] != "ok":
                continue
            # inside the process: baseline window first or last, alternating
            wo = ["base", "mech"] if (rep + pos) % 2 == 0 else ["mech", "base"]
            root = workdir / name
            result_file = workdir / f".{name}.rep{rep}.json"
            cfg = {**base_cfg, "mechanism": name, "rep": rep, "root": str(root),
                   "result": str(result_file), "windows_order": wo,
                   "verify": rep < args.verify_reps,
                   "keep": args.keep and rep == args.repeats - 1}
            common.remove(result_file)
            os.sync()
            t_proc = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)],
                                  capture_output=True, text=True)
            t_proc = time.perf_counter() - t_proc
            try:
                res = json.loads(result_file.read_text())
            except (OSError, ValueError):
                res = {"error": f"worker exited {proc.returncode} without a result",
                       "traceback": (proc.stdout + proc.stderr)[-4000:]}
            common.remove(result_file)
            if not cfg["keep"]:
                common.remove(root)
            if "error" in res:
                results[name].update(status="failed", reason=f"rep {rep}: {res['error']}",
                                     traceback=res.get("traceback"))
                console.print(f"[red]{name} failed in rep {rep}: {res['error']}[/]")
                continue
            if cfg["verify"]:
                ok_before = results[name]["verified"] is not False
                results[name]["verified"] = ok_before and res["verified"]
                results[name]["verify_errors"] += res["verify_errors"]
                if not res["verified"]:
                    results[name].update(status="failed",
                                         reason=f"rep {rep}: checkpoint did not load back equal: "
                                                f"{res['verify_errors'][:3]}")
                    console.print(f"[red]{name}: {results[name]['reason']}[/]")
            res["process_s"] = t_proc
            results[name]["runs"].append(res)
            m = run_metrics(res, args.every)
            console.print(
                f"  rep {rep} {name:20s} stall {_f(m['stall_s'])}s (call {_f(m['call_s'])} + guard "
                f"{_f(m['guard_wait_s'])})  durable {_f(m['durable_s'], '{:.2f}')}s  extra RSS "
                f"{m['peak_extra_rss'] / GiB:.2f} GiB  window {res['mech']['time_s']:.2f}s vs "
                f"{m['step_s'] * len(res['mech']['step_s']):.2f}s ({m['window_overhead_pct']:+.1f}%)  "
                f"[{t_proc:.0f}s]")

    loadavg["end"] = os.getloadavg()
    if loadavg["start"][0] > 0.75 * (os.cpu_count() or 1):
        console.print(f"[yellow]note: load average was {loadavg['start'][0]:.2f} at the start: "
                      "other work may share the CPUs and skew the overheads. Rerun when idle.[/]")
    any_run = next((r["runs"][0] for r in results.values() if r["runs"]), None)
    state: dict[str, Any] = {"state_bytes": any_run["state_bytes"] if any_run else params * 12,
             "n_tensors": any_run["n_tensors"] if any_run else None,
             "params": any_run["params"] if any_run else params}
    ok = summarize(results, state["state_bytes"], args.every)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "created_unix": time.time(),
        "config": {**{k: v for k, v in base_cfg.items()}, "params_m": args.params_m,
                   "params_m_actual": params / 1e6, "repeats": args.repeats,
                   "checkpoints_per_window": n_ckpt, "verify_reps": args.verify_reps,
                   "orders": orders, "workdir": str(workdir), "fs_type": fstype,
                   "loadavg": loadavg, "kept_files": bool(args.keep),
                   "run_seconds": time.perf_counter() - t_run,
                   "definitions": {
                       "stall_s": "call_s + guard_wait_s: the loop is blocked in the checkpoint "
                                  "call, then in optimizer-step pre-hooks before the next step",
                       "durable_s": "from the call to the commit (async: waiter thread; DCP: "
                                    "upload done + fsync of its files); sync: the call",
                       "peak_extra_rss": "VmHWM over the checkpointing window (reset at its "
                                         "start) minus VmHWM over 2 training-only steps",
                       "per_ckpt_cost_s": "(checkpointing window - its steps at the baseline "
                                          "window's time per step, same process) / number of "
                                          "checkpoints",
                       "overhead_at_every_pct": "100 * per_ckpt_cost_s / (every * step_s)",
                       "step_cost_s": "call + excess of the 8 steps after it over the median of "
                                      "the window's other steps + share of the final durability "
                                      "wait, per checkpoint (no second window needed)",
                       "ratios": "median over repetitions of the per-repetition ratio of run "
                                 "medians; < 1 = less than the reference",
                   }},
        "env": common.environment(),
        "state": state,
        "mechanisms": results,
    }
    doc["targets"] = evaluate_targets(ok)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=repr))
    os.replace(tmp, out)
    print_report(console, doc)
    console.print(f"\nraw timings and medians: {out}  (run took "
                  f"{doc['config']['run_seconds']:.0f} s)")
    if not args.keep and created_workdir:
        common.remove(workdir)
    if any(r["status"] == "failed" for r in results.values()):
        return 2
    if args.strict and any(t["status"] == "FAIL" for t in doc["targets"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
