"""Save/load throughput of resurgo side by side with raw I/O, torch.save, safetensors and DCP.

One run, one synthetic state (default ~1 GiB), every mechanism interleaved per repetition with
the order rotated, so that disk weather hits everyone alike; results are reported as medians and
as per-repetition paired ratios. See benchmarks/README.md for how to read the output.

    .venv/bin/python benchmarks/bench_save_load.py [--size-mib 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import GB, KiB, MiB, jsonable  # noqa: E402

SCHEMA = "resurgo-bench-save-load/1"
REPO = Path(__file__).resolve().parent.parent

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

# --------------------------------------------------------------------------------------------
# mechanisms
# --------------------------------------------------------------------------------------------

# Raw I/O, no staging copy: one os.write per tensor (the largest buffers there are; capped below
# Linux's 2 GiB per-call limit) and readinto in 8 MiB pieces straight into the target tensors.
# On the dev VM (read_ahead_kb 8192) these were the fastest and steadiest choices: os.writev of
# 64 MiB batches wrote ~2x slower, whole-tensor (256 MiB) reads varied 0.5-1.3 s where 1-8 MiB
# pieces took 0.56-0.62 s.
WRITE_CHUNK = 1024 * MiB
READ_CHUNK = 8 * MiB


def _write_all(fd: int, view: memoryview) -> None:
    """os.write the whole buffer in WRITE_CHUNK pieces, retrying short writes."""
    pos, end = 0, len(view)
    while pos < end:
        pos += os.write(fd, view[pos : min(end, pos + WRITE_CHUNK)])


def _read_all(fh, view: memoryview, path: Path) -> None:
    """readinto the whole buffer in READ_CHUNK pieces, retrying short reads."""
    pos, end = 0, len(view)
    while pos < end:
        n = fh.readinto(view[pos : min(end, pos + READ_CHUNK)])
        if not n:
            raise EOFError(f"{path}: file ends before tensor data does")
        pos += n


class Mechanism:
    """One way of saving and loading. ``root`` holds everything it writes (deleted per rep)."""

    name = ""
    label = ""
    in_place = True  # load fills the preallocated target (else returns fresh tensors)
    self_fsyncs = False  # True: the library makes its files durable itself; we add no fsync
    note = ""

    def __init__(self, workdir: Path):
        self.root = workdir / self.name

    def prepare(self) -> None:
        """Outside the timer: make an empty root whose directory entry is durable."""
        common.remove(self.root)
        self.root.mkdir(parents=True)
        common.fsync_path(self.root.parent)

    def save(self, state: dict[str, torch.Tensor]):
        raise NotImplementedError

    def load(self, target: dict[str, torch.Tensor]):
        """Return (loaded_state, report). loaded_state is target itself for in-place loads."""
        raise NotImplementedError


class Raw(Mechanism):
    name = "raw"
    label = "raw os.write+fsync / readinto"
    note = "reference: the tensor bytes back to back in one file, no format"

    @property
    def path(self) -> Path:
        return self.root / "state.bin"

    def save(self, state):
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for t in state.values():
                _write_all(fd, common.byte_view(t))
            os.fsync(fd)
        finally:
            os.close(fd)
        common.fsync_path(self.root)

    def load(self, target):
        with open(self.path, "rb", buffering=0) as fh:
            for t in target.values():
                _read_all(fh, common.byte_view(t), self.path)
        return target, None


class TorchSave(Mechanism):
    name = "torch"
    label = "torch.save / torch.load"
    in_place = False
    note = "torch.load(mmap=False, weights_only=True): returns fresh tensors, no copy into target"

    @property
    def path(self) -> Path:
        return self.root / "state.pt"

    def save(self, state):
        torch.save(state, self.path)
        common.fsync_tree(self.root)

    def load(self, target):
        return torch.load(self.path, map_location="cpu", mmap=False, weights_only=True), None


class Safetensors(Mechanism):
    name = "safetensors"
    label = "safetensors save_file / load_file"
    note = (
        "load_file mmaps lazily; the timed load includes copy_ into the target "
        "(what load_state_dict does), which reads every page"
    )

    @property
    def path(self) -> Path:
        return self.root / "state.safetensors"

    def save(self, state):
        from safetensors.torch import save_file

        save_file(state, str(self.path))
        common.fsync_tree(self.root)

    def load(self, target):
        from safetensors.torch import load_file

        loaded = load_file(str(self.path))
        for k, t in target.items():
            t.copy_(loaded[k])
        del loaded  # drop the mmap
        return target, None


class DCP(Mechanism):
    name = "dcp"
    label = "torch.distributed.checkpoint"
    note = "single process, no process group (no_dist=True), default FileSystemWriter/Reader"

    @property
    def path(self) -> Path:
        return self.root / "ckpt"

    def save(self, state):
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(self.path), no_dist=True)
        common.fsync_tree(self.path)  # its files, its dir and self.root

    def load(self, target):
        import torch.distributed.checkpoint as dcp

        dcp.load(target, checkpoint_id=str(self.path), no_dist=True)
        return target, None


def resurgo_api():
    """(save, load) or raises with a reason: the API may not exist yet."""
    import resurgo

    return resurgo.save, resurgo.load


class Resurgo(Mechanism):
    name = "resurgo"
    label = "resurgo.save / resurgo.load"
    self_fsyncs = True
    note = "in place into the target, checksums verified (defaults)"

    @property
    def path(self) -> Path:
        return self.root / "ckpt"

    def save(self, state):
        save, _ = resurgo_api()
        return save(state, str(self.path))

    def load(self, target):
        _, load = resurgo_api()
        return target, load(target, str(self.path))


MECHANISMS: list[type[Mechanism]] = [Raw, TorchSave, Safetensors, DCP, Resurgo]
HEAT = True  # --no-heat turns it off: see common.heat_page_cache
REFERENCE = "raw"

# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------


def new_record(m: Mechanism) -> dict:
    return {
        "label": m.label,
        "note": m.note,
        "in_place_load": m.in_place,
        "status": "ok",
        "reason": None,
        "save_s": [],
        "load_cold_s": [],
        "load_warm_s": [],
        "post_save_fsync_s": [],
        "resident_after_evict": [],
        "resident_before_warm": [],
        "files_per_rep": [],
        "verified": {"cold": None, "warm": None},
        "save_reports": [],
        "load_reports": [],
    }


def run_once(
    m: Mechanism,
    state: dict,
    target: dict,
    rec: dict,
    *,
    verify: bool,
    keep: bool,
    record: bool = True,
) -> None:
    """One repetition of one mechanism: save, evict, cold load, prewarm, warm load, sizes."""
    def heat() -> None:
        if HEAT:
            common.heat_page_cache(m.root.parent / ".heat-scratch",
                                   (common.byte_view(t) for t in state.values()))

    m.prepare()
    heat()
    t = common.timed(lambda: m.save(state))
    # Durability check: fsync again; if the save left dirty pages this is slow.
    post = common.timed(lambda: common.fsync_tree(m.root))
    files = common.file_sizes(m.root)

    loads = {}
    for kind in ("cold", "warm"):
        heat()
        if kind == "cold":
            common.evict(m.root)
        else:
            common.prewarm(m.root)
        resident = common.resident_fraction(m.root)
        if m.in_place:
            common.zero_state(target)
        lt = common.timed(lambda: m.load(target))
        loaded, report = lt.value
        loads[kind] = (lt.seconds, resident, report)
        if verify:
            bad = common.bitwise_mismatches(state, loaded)
            rec["verified"][kind] = not bad
            if bad:
                raise AssertionError(f"{m.name} {kind} load is wrong: {bad[:5]}")
        del loaded, lt

    if record:
        rec["save_s"].append(t.seconds)
        rec["post_save_fsync_s"].append(post.seconds)
        rec["files_per_rep"].append(files)
        rec["load_cold_s"].append(loads["cold"][0])
        rec["load_warm_s"].append(loads["warm"][0])
        rec["resident_after_evict"].append(loads["cold"][1])
        rec["resident_before_warm"].append(loads["warm"][1])
        if t.value is not None:
            rec["save_reports"].append(jsonable(t.value))
        for kind in ("cold", "warm"):
            if loads[kind][2] is not None:
                rec["load_reports"].append({"kind": kind, **{"report": jsonable(loads[kind][2])}})
    if not keep:
        common.remove(m.root)
    os.sync()  # settle the journal and any unlink work before the next timed region


def summarize(results: dict, tensor_bytes: int) -> None:
    """Add medians, throughputs, sizes and paired ratios to every ok mechanism's record."""
    ok = {k: r for k, r in results.items() if r["status"] == "ok" and r["save_s"]}

    def paired(ref: str, key: str, name: str) -> float | None:
        # ratio ref_time / mech_time per repetition: >1 means `name` is faster than `ref`
        if ref not in ok or name not in ok:
            return None
        return common.median(common.paired_ratios(ok[ref][key], ok[name][key]))

    for name, r in ok.items():
        med = {k: common.median(r[k]) for k in ("save_s", "load_cold_s", "load_warm_s")}
        med["post_save_fsync_s"] = common.median(r["post_save_fsync_s"])
        r["median"] = med
        r["throughput_GBps"] = {
            k.removesuffix("_s"): (tensor_bytes / v / GB if v else None)
            for k, v in med.items()
            if k != "post_save_fsync_s"
        }
        last = r["files_per_rep"][-1]
        on_disk = sum(f["bytes"] for f in last)
        r["files"] = last
        r["bytes_on_disk"] = on_disk
        r["bytes_allocated"] = sum(f["allocated"] for f in last)
        r["overhead_bytes"] = on_disk - tensor_bytes
        r["overhead_pct"] = 100.0 * (on_disk - tensor_bytes) / tensor_bytes
        r["ratios"] = {
            "save_vs_raw": paired("raw", "save_s", name),
            "save_speedup_vs_torch": paired("torch", "save_s", name),
            "save_speedup_vs_dcp": paired("dcp", "save_s", name),
            "load_cold_vs_raw": paired("raw", "load_cold_s", name),
            "load_warm_vs_raw": paired("raw", "load_warm_s", name),
            "load_cold_speedup_vs_torch": paired("torch", "load_cold_s", name),
            "load_cold_speedup_vs_dcp": paired("dcp", "load_cold_s", name),
            "load_warm_speedup_vs_torch": paired("torch", "load_warm_s", name),
            "load_warm_speedup_vs_dcp": paired("dcp", "load_warm_s", name),
        }
        r["ratio_of_medians"] = {
            "save_vs_raw": (ok["raw"]["median"]["save_s"] / med["save_s"])
            if "raw" in ok and "median" in ok["raw"]
            else None,
        }


def evaluate_targets(results: dict, tensor_bytes: int) -> list[dict]:
    r = results.get("resurgo", {})
    have = r.get("status") == "ok" and "ratios" in r
    ratios = r.get("ratios", {}) if have else {}
    size_limit = tensor_bytes * 1.001 + 64 * KiB

    def target(name, value, op, threshold, unit="x"):
        if value is None:
            status = "SKIP"
        else:
            status = "PASS" if (value >= threshold if op == ">=" else value > threshold) else "FAIL"
        return {"name": name, "value": value, "op": op, "threshold": threshold, "unit": unit,
                "status": status}

    return [
        target("resurgo save throughput vs raw write", ratios.get("save_vs_raw"), ">=", 0.9),
        target("resurgo save faster than torch.save", ratios.get("save_speedup_vs_torch"), ">", 1.0),
        target("resurgo save faster than DCP", ratios.get("save_speedup_vs_dcp"), ">", 1.0),
        target("resurgo cold load speedup vs torch.load", ratios.get("load_cold_speedup_vs_torch"),
               ">=", 1.5),
        target("resurgo cold load speedup vs DCP", ratios.get("load_cold_speedup_vs_dcp"), ">=", 1.5),
        target("resurgo warm load speedup vs torch.load", ratios.get("load_warm_speedup_vs_torch"),
               ">=", 1.5),
        target("resurgo warm load speedup vs DCP", ratios.get("load_warm_speedup_vs_dcp"), ">=", 1.5),
        {
            **target(
                "resurgo size <= tensor bytes + 0.1% + 64 KiB",
                # value = headroom; >= 0 passes
                (size_limit - r["bytes_on_disk"]) if have else None,
                ">=",
                0,
                unit="B",
            ),
            "bytes_on_disk": r.get("bytes_on_disk") if have else None,
            "limit_bytes": size_limit,
        },
    ]


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def _f(v, fmt="{:.3f}", none="-"):
    return none if v is None else fmt.format(v)


def print_report(console, doc: dict) -> None:
    from rich.table import Table

    tb = doc["state"]["tensor_bytes"]
    results = doc["mechanisms"]
    cfg = doc["config"]
    table = Table(
        title=(
            f"save/load of {common.fmt_bytes(tb)} in {doc['state']['n_tensors']} tensors, "
            f"{cfg['repeats']} reps, medians; ratios = median of per-rep paired ratios"
        ),
        title_justify="left",
    )
    cols = [
        ("mechanism", "left"),
        ("save\ns", "right"), ("save\nGB/s", "right"), ("save\nx raw", "right"),
        ("load cold\ns", "right"), ("cold\nGB/s", "right"), ("cold\nx raw", "right"),
        ("load warm\ns", "right"),
        ("cold speedup\nvs torch.load", "right"), ("cold speedup\nvs DCP", "right"),
        ("warm speedup\nvs torch.load", "right"), ("warm speedup\nvs DCP", "right"),
        ("bytes on disk", "right"), ("overhead\nbytes", "right"), ("overhead\n%", "right"),
    ]
    for c, j in cols:
        table.add_column(c, justify=j)
    for name, r in results.items():
        if r["status"] != "ok" or "median" not in r:
            table.add_row(name, f"[yellow]{r['status']}[/]", *[""] * (len(cols) - 2))
            continue
        med, thr, ra = r["median"], r["throughput_GBps"], r["ratios"]
        table.add_row(
            name,
            _f(med["save_s"]), _f(thr["save"], "{:.2f}"), _f(ra["save_vs_raw"], "{:.2f}x"),
            _f(med["load_cold_s"]), _f(thr["load_cold"], "{:.2f}"),
            _f(ra["load_cold_vs_raw"], "{:.2f}x"),
            _f(med["load_warm_s"]),
            _f(ra["load_cold_speedup_vs_torch"], "{:.2f}x"), _f(ra["load_cold_speedup_vs_dcp"], "{:.2f}x"),
            _f(ra["load_warm_speedup_vs_torch"], "{:.2f}x"), _f(ra["load_warm_speedup_vs_dcp"], "{:.2f}x"),
            f"{r['bytes_on_disk']:,}", f"{r['overhead_bytes']:+,}", f"{r['overhead_pct']:+.4f}%",
        )
    console.print(table)
    for name, r in results.items():
        extra = [f"[yellow]{r['status']}: {r['reason']}[/]"] if r["status"] != "ok" else []
        if r["status"] == "ok" and r.get("post_save_fsync_s"):
            pf = max(r["post_save_fsync_s"])
            if pf > 0.05:
                extra.append(f"[red]post-save fsync took {pf:.3f}s: save left dirty data[/]")
            res = [x for x in r["resident_after_evict"] if x is not None]
            if res and max(res) > 0.02:
                extra.append(f"[red]{max(res):.0%} of pages still cached before a cold load[/]")
        console.print(f"  [bold]{name}[/]: {r['label']}. {r['note']}" +
                      ("" if not extra else "  " + "; ".join(extra)))
    console.print()
    for t in doc["targets"]:
        color = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}[t["status"]]
        if t["unit"] == "B":
            val = (f"{t['bytes_on_disk']:,} B on disk, limit {t['limit_bytes']:,.0f} B"
                   if t["value"] is not None else "n/a")
        else:
            val = _f(t["value"], "{:.2f}x", "n/a") + f" (need {t['op']} {t['threshold']}x)"
        console.print(f"[{color}]{t['status']}[/]  {t['name']}: {val}")


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "save_load.json",
                   help="JSON output (default bench-results/save_load.json)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where files are written (default: a fresh dir beside --out; must be a "
                        "real disk, not tmpfs)")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of: " + ",".join(m.name for m in MECHANISMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true",
                   help="keep the last repetition's files in --workdir (for inspection/tests)")
    p.add_argument("--warmup-reps", type=int, default=1,
                   help="untimed full-size repetitions before the timed ones (default 1): on VMs "
                        "the first use of fresh memory and page cache is several times slower")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip all warm-up: the tiny round that imports every path, and --warmup-reps")
    p.add_argument("--no-heat", action="store_true",
                   help="do not write+delete a scratch file of the state's size before each timed "
                        "phase (see common.heat_page_cache)")
    p.add_argument("--strict", action="store_true", help="exit 1 if a target FAILs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    global HEAT
    HEAT = not args.no_heat
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 220, highlight=False)
    out: Path = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = (args.workdir or out.parent / f"work-{os.getpid()}").resolve()
    created_workdir = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    fstype = common.fs_type(workdir)
    if fstype in ("tmpfs", "ramfs"):
        console.print(f"[red]warning: {workdir} is on {fstype}: fsync and cold loads mean nothing[/]")

    classes = MECHANISMS
    if args.only:
        wanted = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = wanted - {m.name for m in MECHANISMS}
        if unknown:
            raise SystemExit(f"--only: unknown mechanisms {sorted(unknown)}")
        classes = [m for m in MECHANISMS if m.name in wanted]
    mechs = [cls(workdir) for cls in classes]
    results = {m.name: new_record(m) for m in mechs}

    if "resurgo" in results:
        try:
            resurgo_api()
        except (ImportError, AttributeError) as e:
            results["resurgo"].update(status="skipped", reason=f"resurgo.save/load not importable: {e}")
            console.print(f"[yellow]note: skipping resurgo rows: {results['resurgo']['reason']}[/]")

    active = [m for m in mechs if results[m.name]["status"] == "ok"]
    # import every mechanism's modules now, outside the timers, then make GC cheap
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    common.freeze_gc()

    def fail(m: Mechanism, phase: str, exc: BaseException) -> None:
        r = results[m.name]
        r.update(status="failed", reason=f"{phase}: {type(exc).__name__}: {exc}")
        r["traceback"] = traceback.format_exc()
        console.print(f"[red]{m.name} failed during {phase}: {type(exc).__name__}: {exc}[/]")
        common.remove(m.root)

    if not args.no_warmup:
        tiny = common.make_state(1, seed=args.seed + 1)
        tiny_target = common.empty_like_state(tiny)
        for m in active:
            try:
                run_once(m, tiny, tiny_target, results[m.name], verify=True, keep=False, record=False)
            except Exception as e:  # noqa: BLE001
                fail(m, "warm-up", e)
        for m in active:
            results[m.name]["verified"] = {"cold": None, "warm": None}
        del tiny, tiny_target

    t0 = time.perf_counter()
    state = common.make_state(args.size_mib, seed=args.seed)
    target = common.empty_like_state(state)
    desc = common.describe_state(state)
    loadavg = {"start": os.getloadavg()}
    console.print(
        f"state: {common.fmt_bytes(desc['tensor_bytes'])} in {desc['n_tensors']} tensors "
        f"({desc['n_large']} > 1 MiB), built in {time.perf_counter() - t0:.1f}s; "
        f"workdir {workdir} ({fstype}); {args.repeats} reps; "
        f"load average {loadavg['start'][0]:.2f} on {os.cpu_count()} CPUs"
    )

    for w in range(0 if args.no_warmup else args.warmup_reps):
        for m in common.rotated([m for m in mechs if results[m.name]["status"] == "ok"], w):
            try:
                run_once(m, state, target, results[m.name], verify=False, keep=False, record=False)
            except Exception as e:  # noqa: BLE001
                fail(m, f"warm-up rep {w}", e)
        console.print(f"  warm-up rep {w} done (untimed)")

    orders = []
    for rep in range(args.repeats):
        # rotate the start each repetition and alternate the direction, so that every mechanism
        # moves through every position and does not always follow the same neighbour
        base = [m for m in mechs if results[m.name]["status"] == "ok"]
        order = common.rotated(base if rep % 2 == 0 else base[::-1], rep)
        orders.append([m.name for m in order])
        for m in order:
            if results[m.name]["status"] != "ok":
                continue
            last = rep == args.repeats - 1
            try:
                run_once(m, state, target, results[m.name], verify=(rep == 0),
                         keep=args.keep and last)
            except Exception as e:  # noqa: BLE001
                fail(m, f"rep {rep}", e)
                continue
            r = results[m.name]
            console.print(
                f"  rep {rep} {m.name:12s} save {r['save_s'][-1]:7.3f}s  "
                f"load cold {r['load_cold_s'][-1]:7.3f}s  warm {r['load_warm_s'][-1]:7.3f}s",
                highlight=False,
            )

    loadavg["end"] = os.getloadavg()
    # the 1-minute load average at the start is the others' (and any run just before this one);
    # at the end it includes this run's own threads, so only the start is judged
    if loadavg["start"][0] > 0.75 * (os.cpu_count() or 1):
        console.print(f"[yellow]note: load average was {loadavg['start'][0]:.2f} at the start: "
                      "other work may share the CPUs; CPU-heavy loaders (DCP, safetensors' copy) "
                      "suffer most. Rerun when the machine is idle.[/]")
    summarize(results, desc["tensor_bytes"])
    doc = {
        "schema": SCHEMA,
        "created_unix": time.time(),
        "config": {
            "size_mib": args.size_mib,
            "repeats": args.repeats,
            "warmup_reps": 0 if args.no_warmup else args.warmup_reps,
            "heat_page_cache": HEAT,
            "loadavg": loadavg,
            "seed": args.seed,
            "workdir": str(workdir),
            "fs_type": fstype,
            "kept_files": bool(args.keep),
            "orders": orders,
            "reference": REFERENCE,
            "ratio_definition": "median over repetitions of (reference seconds / mechanism seconds) "
                                "in the same repetition; >1 = faster than the reference",
            "gb": "10^9 bytes",
        },
        "env": common.environment(),
        "state": desc,
        "mechanisms": results,
    }
    doc["targets"] = evaluate_targets(results, desc["tensor_bytes"])
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=repr))
    os.replace(tmp, out)

    print_report(console, doc)
    console.print(f"\nraw timings and medians: {out}")
    if not args.keep:
        for m in mechs:
            common.remove(m.root)
        if created_workdir:
            try:
                workdir.rmdir()
            except OSError:
                pass
    if any(r["status"] == "failed" for r in results.values()):
        return 2
    if args.strict and any(t["status"] == "FAIL" for t in doc["targets"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
