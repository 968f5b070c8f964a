"""The cost of a load that leaves damaged tensors untouched: resurgo.load against a baseline resurgo.

A tensor is filled only once all of its bytes verified (``resurgo.pipeline.reader``): local bytes
are hashed where the page cache holds them (a mapping), then copied into place. This measures what that costs against another version of resurgo (``--baseline-rev``, a git
revision of this repository, or ``--baseline-src``, a directory holding a ``resurgo`` package),
or (``--in-place``) against this tree with reads landing in place and hashed there (the read path
of loads into fresh memory, where nothing is to be kept untouched: what every load did before),
which isolates the change from everything else that differs between versions.

One state of ``--size-mib`` (``common.make_state``: five large tensors and many small ones) is saved
once. Two worker processes, one per version, each hold a target allocated and loaded once before
the timers (untimed warm-up). Each repetition, in rotating order, each worker times one
``resurgo.load(target, path, io_threads=...)``, cold (every data file dropped from the page cache
with fsync + posix_fadvise DONTNEED first) and warm (dropped, then read once from start to end:
the page cache is in the same state whichever version read last, since how the pages came in
decides their size, 4 KiB or larger, and so what mapping them costs). Reports the
medians of ``--repeats`` per version and mode, the ratio of the medians (this tree / baseline) and
the median of the per-repetition ratios, for wall time and for the CPU time of all the load's
threads (what the work costs, steadier than wall time on a shared machine). After the last repetition each worker's target is compared
with the saved state (xxh3 of every tensor); the exit status is 2 if one differs.

    .venv/bin/python benchmarks/bench_load_atomic.py --in-place [--size-mib 1024] [--repeats 7]
    .venv/bin/python benchmarks/bench_load_atomic.py --baseline-rev <rev> [--size-mib 1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from common import environment, evict, make_state, median, paired_ratios, prewarm, rotated  # noqa: E402

MODES = ("cold", "warm")


def _digests(state: dict) -> dict[str, str]:
    import xxhash

    return {k: xxhash.xxh3_128_hexdigest(v.contiguous().view(-1).view(__import__("torch").uint8).numpy())
            for k, v in state.items()}


def worker(path: str, size_mib: float, seed: int, io_threads: int, in_place: bool) -> None:
    """Serve commands on stdin: ``load`` times one load into the held target, ``digest`` prints
    the target's digests; one JSON line each on stdout. ``in_place``: reads land in place and are
    verified there (the read path loads into fresh memory take), as before this change."""
    import torch

    import resurgo

    if in_place:
        from resurgo.pipeline import load as load_module

        into_place = load_module.read_destinations

        def verified_where_they_land(*args: object, **kwargs: object) -> object:
            kwargs["atomic"] = False
            return into_place(*args, **kwargs)  # type: ignore[arg-type]

        load_module.read_destinations = verified_where_they_land  # type: ignore[assignment]

    target = {k: torch.zeros_like(v) for k, v in make_state(size_mib, seed).items()}
    resurgo.load(target, path, io_threads=io_threads)  # warm-up: imports, first touch of the target
    print(json.dumps({"ready": resurgo.__file__}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "load":
            t0, c0 = time.perf_counter(), time.process_time()
            resurgo.load(target, path, io_threads=io_threads)
            print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": time.process_time() - c0}), flush=True)
        elif command == "digest":
            print(json.dumps({"digests": _digests(target)}), flush=True)
        else:
            return


class Worker:
    def __init__(self, name: str, src: Path, args: argparse.Namespace, path: Path, in_place: bool = False):
        self.name = name
        # src first; what PYTHONPATH held stays after it (dependencies installed outside a venv)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(path), "--size-mib", str(args.size_mib), "--seed", str(args.seed),
             "--io-threads", str(args.io_threads)] + (["--in-place"] if in_place else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.module = self.ask(None)["ready"]

    def ask(self, command: str | None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait()


def baseline_source(args: argparse.Namespace, scratch: Path) -> Path:
    if args.baseline_src is not None:
        return args.baseline_src
    out = scratch / "baseline"
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline_rev, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", help="git revision of this repository to compare against")
    parser.add_argument("--baseline-src", type=Path, help="a directory holding the baseline's resurgo package")
    parser.add_argument("--size-mib", type=float, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoint goes (a disk, not tmpfs)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    parser.add_argument("--in-place", action="store_true",
                        help="the baseline is this tree with reads verified where they land (no --baseline-*)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.size_mib, args.seed, args.io_threads, args.in_place)
        return 0
    if (args.baseline_rev is not None) + (args.baseline_src is not None) + args.in_place != 1:
        parser.error("pass one of --baseline-rev, --baseline-src, --in-place")

    import resurgo

    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench-load-atomic-") as tmp:
        scratch = Path(tmp)
        path = scratch / "ck"
        state = make_state(args.size_mib, args.seed)
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        resurgo.save(state, path)
        saved = _digests(state)
        del state
        workers = {"this": Worker("this", REPO / "src", args, path),
                   "baseline": Worker("baseline", REPO / "src" if args.in_place else baseline_source(args, scratch),
                                      args, path, in_place=args.in_place)}
        times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in workers} for m in MODES}
        cpu: dict[str, dict[str, list[float]]] = {m: {n: [] for n in workers} for m in MODES}
        try:
            for rep in range(args.repeats):
                for mode in MODES:
                    for name in rotated(list(workers), rep):
                        evict(path)
                        if mode == "warm":  # the same page cache whichever version read last
                            prewarm(path)
                        answer = workers[name].ask("load")
                        times[mode][name].append(answer["seconds"])
                        cpu[mode][name].append(answer["cpu"])
                print(f"repetition {rep + 1}/{args.repeats}: "
                      + ", ".join(f"{m} {n} {times[m][n][-1]:.3f}s" for m in MODES for n in workers), flush=True)
            exact = {name: w.ask("digest")["digests"] == saved for name, w in workers.items()}
            modules = {name: w.module for name, w in workers.items()}
        finally:
            for w in workers.values():
                w.close()
    summary = {}
    for mode in MODES:
        this, base = median(times[mode]["this"]), median(times[mode]["baseline"])
        summary[mode] = {
            "this_median_s": this, "baseline_median_s": base,
            "ratio_of_medians": this / base if this and base else None,
            "median_paired_ratio": median(paired_ratios(times[mode]["this"], times[mode]["baseline"])),
            "this_GBps": nbytes / this / 1e9 if this else None,
            "this_cpu_median_s": median(cpu[mode]["this"]), "baseline_cpu_median_s": median(cpu[mode]["baseline"]),
            "cpu_ratio_of_medians": median(cpu[mode]["this"]) / median(cpu[mode]["baseline"]),
        }
        print(f"{mode:5s} this {this:.3f}s baseline {base:.3f}s  ratio {summary[mode]['ratio_of_medians']:.3f} "
              f"(median paired {summary[mode]['median_paired_ratio']:.3f}), {summary[mode]['this_GBps']:.2f} GB/s; "
              f"CPU (all threads) ratio {summary[mode]['cpu_ratio_of_medians']:.3f}")
    print("loaded bit-exact:", exact)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "tensor_bytes": nbytes, "modules": modules,
              "times": times, "cpu_seconds": cpu, "summary": summary, "exact": exact, "environment": environment()}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if all(exact.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
