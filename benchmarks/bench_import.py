"""Import of foreign checkpoints: resurgo.import_checkpoint against the frameworks' own consolidation
tools, on the same checkpoint, in one run, as ratios.

Sources, written untimed at the start by the real libraries on 2 gloo CPU ranks (an MLP of
``--params-m`` million fp32 parameters; the last layer has an odd numel, so ZeRO pads):

* ``deepspeed``: ZeRO-2 (``--zero-stages 2,3`` for ZeRO-3 too) ``engine.save_checkpoint`` after
  one AdamW step. Compared: DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict`` (what
  ``zero_to_fp32.py`` runs: writes ``pytorch_model.bin``, the fp32 weights only) against
  ``import_checkpoint(source="deepspeed", only="model.*")`` (the same weights: like for like),
  and the full import (weights, both Adam moments, steps) printed beside it.
* ``dcp``: ``dcp.save`` of an FSDP2 model's state dict. Compared: torch's ``dcp_to_torch_save``
  against ``import_checkpoint(source="dcp")`` (both write every item).

Import in place (``in_place=True``: the checkpoint's chunks point into the source files, which are
read once for their checksums and never copied) runs beside the copying import of the same source
(``resurgo_dcp_in_place``, ``resurgo_full_in_place``): the ratios ``copy/in_place`` of the durable
time and of the bytes written are printed for each source, and its output is checked bit for bit
against the copying import's.

Every tool runs in its own Python process, started fresh for each repetition (imports done before
the timer), so its peak memory is its own: ``peak_rss`` is the child's ``VmHWM`` (its peak resident set; ``ru_maxrss`` would
not do: Linux carries the forking parent's peak over ``exec``; it counts
file pages mapped into the process, e.g. resurgo's and DeepSpeed's memory maps of the sources,
which are page cache), and ``peak_anon`` the most anonymous memory (``RssAnon``, sampled every
2 ms) above what the process held just before the timer: the buffers the tool allocated.

Durability: the frameworks' tools do not fsync; resurgo commits durably (fsync of every file and
directory). Each run times the tool (``raw_s``), then fsyncs its output and directories
(``durable_s`` = raw + that fsync; for resurgo the fsync finds nothing to do). The headline
ratio is ``durable_s(tool) / durable_s(resurgo)``: the time until the output survives a crash;
the ratio of raw times is printed too. Page cache: sources are warm (every source file is read
once right before every timed run, for every tool alike); outputs are deleted and ``sync``ed after
each run. Repetitions interleave the tools; medians and paired per-repetition ratios are printed.
The results are checked once, outside the timers: resurgo's weights equal zero_to_fp32's, and the
DCP import equals dcp_to_torch_save's output, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import GB, MiB, environment, fmt_bytes, fs_type, fsync_tree, median, paired_ratios, prewarm, remove  # noqa: E402

SCHEMA = "resurgo-bench-import/1"
TOOLS = {  # source -> (the framework's tool, resurgo like for like, other resurgo rows)
    "deepspeed": ("zero_to_fp32", "resurgo_weights", ("resurgo_full", "resurgo_full_in_place")),
    "dcp": ("dcp_to_torch_save", "resurgo_dcp", ("resurgo_dcp_in_place",)),
}
IN_PLACE = {"resurgo_dcp_in_place": "resurgo_dcp", "resurgo_full_in_place": "resurgo_full"}  # -> the copying import


# -- the model both sources are written from -----------------------------------------------------
def build_model(params_m: float):
    """An MLP of about ``params_m`` million fp32 parameters: square layers, then an odd-sized head."""
    from torch import nn

    params = int(params_m * 1e6)
    width = next(w for w in (4096, 2048, 1024, 512, 256, 64) if w * w * 4 <= max(params, 64 * 64 * 4))
    layers = max(1, round(params / (width * width + width)))
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)],
                         nn.Linear(width, 3)), width


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def _deepspeed_rank(rank: int, stage: int, out: str, port: int, params_m: float) -> None:
    import deepspeed
    import torch

    _init(rank, port)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model, width = build_model(params_m)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bucket = 50_000_000  # elements: DeepSpeed's default (5e8) would allocate 2 GB buffers per rank
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                    "stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=config)
    engine.backward(engine(torch.randn(2, width, generator=torch.Generator().manual_seed(rank))).square().mean())
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")


def _dcp_rank(rank: int, out: str, port: int, params_m: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, port)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, _ = build_model(params_m)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save({"model": model.state_dict(), "step": 1}, checkpoint_id=out)
    dist.barrier()  # both ranks leave together: a rank tearing gloo down under the other's feet can abort
    dist.destroy_process_group()


def write_sources(kind: str, out: Path, params_m: float, stage: int = 2) -> None:
    """Run 2 gloo ranks in a fresh process that write the source checkpoint ``out``."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_import as b; "
            "import torch.multiprocessing as mp; "
            + (f"mp.spawn(b._deepspeed_rank, args=({stage}, {str(out)!r}, {_free_port()}, {params_m}), nprocs=2)"
               if kind == "deepspeed" else
               f"mp.spawn(b._dcp_rank, args=({str(out)!r}, {_free_port()}, {params_m}), nprocs=2)"))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    for _ in range(2):  # the source is only the input: one crash of torch's process teardown is retried
        shutil.rmtree(out, ignore_errors=True)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if done.returncode == 0:
            return
    raise RuntimeError(f"writing the {kind} source failed twice:\n{done.stderr[-4000:]}")


# -- one tool, in its own process ------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class _AnonSampler(threading.Thread):
    """The most anonymous memory (RssAnon) the process holds while it runs, sampled every 2 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = _status_kib("RssAnon:")
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.002):
            self.peak_kib = max(self.peak_kib, _status_kib("RssAnon:"))

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak_kib = max(self.peak_kib, _status_kib("RssAnon:"))
        return self.peak_kib


def run_tool(tool: str, src: str, dst: str, budget: int) -> dict:
    """Run one tool (in this process: the child); its seconds, memory and output bytes."""
    import gc

    # Every module a tool imports lazily is imported here, before the timer: imports are not the
    # work compared (torch.distributed.checkpoint alone takes seconds to import on a loaded machine).
    import torch.distributed.checkpoint.filesystem  # noqa: F401
    if tool == "zero_to_fp32":
        import huggingface_hub  # noqa: F401  (imported inside the convert function)
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        def op() -> None:
            convert_zero_checkpoint_to_fp32_state_dict(src, dst)
    elif tool == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        def op() -> None:
            os.makedirs(dst)
            dcp_to_torch_save(src, os.path.join(dst, "model.pt"))
    else:
        import resurgo
        import resurgo.interop.api  # noqa: F401

        source = "dcp" if tool.startswith("resurgo_dcp") else "deepspeed"
        only = "model.*" if tool == "resurgo_weights" else None
        in_place = tool in IN_PLACE

        def op() -> None:
            resurgo.import_checkpoint(src, dst, source=source, only=only, buffer_bytes=budget, in_place=in_place)
    gc.collect()
    base_kib = _status_kib("RssAnon:")
    sampler = _AnonSampler()
    sampler.start()
    t0 = time.perf_counter()
    op()
    raw = time.perf_counter() - t0
    fsync_tree(Path(dst))  # resurgo's output is durable already: this finds nothing to write
    durable = time.perf_counter() - t0
    peak_kib = sampler.stop()
    return {"raw_s": raw, "durable_s": durable, "peak_anon": (peak_kib - base_kib) * 1024,
            "peak_rss": _status_kib("VmHWM:") * 1024,
            "output_bytes": sum(f.stat().st_size for f in Path(dst).rglob("*") if f.is_file())}


def spawn_tool(tool: str, src: Path, dst: Path, budget: int) -> dict:
    """Run a tool in a fresh process and return what it measured of itself."""
    cmd = [sys.executable, __file__, "--worker", tool, str(src), str(dst), str(budget)]
    done = subprocess.run(cmd, env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- checks, outside the timers ----------------------------------------------------------------------
def check_outputs(kind: str, out: Path) -> list[str]:
    """Bit-for-bit differences between the framework's output and resurgo's (empty: identical)."""
    import torch

    import resurgo

    def bits(t: torch.Tensor) -> bytes:
        return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def flat(node: dict, prefix: str = "") -> dict:
        """The import nests its keys (model.<name> under "model"): joined back with dots."""
        out: dict = {}
        for k, v in node.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    if kind == "deepspeed":
        weights = torch.load(out / "zero_to_fp32" / "pytorch_model.bin", weights_only=True)
        theirs = {f"model.{k}": v for k, v in weights.items()}
        ours = flat(resurgo.load_dict(out / "resurgo_weights"))
        full = {"model": {k: torch.empty_like(v) for k, v in weights.items()}}  # only the full import's weights
        resurgo.load(full, out / "resurgo_full", strict=False)
        bad = [k for k in weights if bits(full["model"][k]) != bits(weights[k])]
        del full
    else:
        theirs = {}
        for k, v in torch.load(out / "dcp_to_torch_save" / "model.pt", weights_only=True).items():
            if isinstance(v, dict):
                theirs.update({f"{k}.{n}": t for n, t in v.items()})
            else:
                theirs[k] = v
        ours = resurgo.load_dict(out / "resurgo_dcp")
        bad = []
    for in_place, copied in IN_PLACE.items():  # the same tensors and values as the copying import
        if (out / in_place).is_dir():
            a, b = flat(resurgo.load_dict(out / in_place)), flat(resurgo.load_dict(out / copied))
            if set(a) != set(b) or any(bits(v) != bits(b[k]) if isinstance(v, torch.Tensor) else v != b[k]
                                       for k, v in a.items()):
                bad.append(f"{in_place} differs from {copied}")
    if set(ours) != set(theirs):
        bad.append(f"keys differ: {sorted(set(ours) ^ set(theirs))[:5]}")
    for k, v in theirs.items():
        got = ours.get(k)
        same = bits(got) == bits(v) if isinstance(v, torch.Tensor) and isinstance(got, torch.Tensor) else got == v
        if not same:
            bad.append(k)
    return bad


# -- the run ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=270, help="millions of fp32 parameters (default 270: 1.07 GB)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument("--sources", default="deepspeed,dcp", help="comma-separated: deepspeed, dcp")
    p.add_argument("--zero-stages", default="2", help="comma-separated ZeRO stages of the DeepSpeed source (2, 3)")
    p.add_argument("--memory-budget-mib", type=int, default=256, help="resurgo's buffer_bytes (default 256 MiB)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "import.json")
    p.add_argument("--workdir", type=Path, default=None, help="where sources and outputs go (a real disk)")
    p.add_argument("--keep", action="store_true", help="keep the sources (the workdir)")
    p.add_argument("--reuse-sources", action="store_true",
                   help="use the sources an earlier --keep run left in --workdir instead of writing them")
    p.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        tool, src, dst, budget = args.worker
        print(json.dumps(run_tool(tool, src, dst, int(budget))))
        return 0

    work = args.workdir or args.out.parent / "import-work"
    if not args.reuse_sources:
        remove(work)
    work.mkdir(parents=True, exist_ok=True)
    remove(work / "out")
    budget = args.memory_budget_mib * MiB
    sources: dict[str, Path] = {}  # name -> source checkpoint
    kinds: dict[str, str] = {}
    doc: dict = {"schema": SCHEMA, "environment": environment(), "fs_type": fs_type(work),
                 "config": {"params_m": args.params_m, "repeats": args.repeats, "memory_budget": budget,
                            "page_cache": "warm sources (each read once before every timed run)",
                            "headline": "durable_s(tool) / durable_s(resurgo): time until the output survives a crash"},
                 "sources": {}}
    status = 0
    try:
        for kind in args.sources.split(","):
            stages = [int(s) for s in args.zero_stages.split(",")] if kind == "deepspeed" else [None]
            for stage in stages:
                name = f"deepspeed_zero{stage}" if kind == "deepspeed" else "dcp"
                path = work / "src" / name
                t0 = time.perf_counter()
                try:
                    if not (args.reuse_sources and path.is_dir()):
                        remove(path)
                        write_sources(kind, path, args.params_m, stage or 0)
                except RuntimeError as e:
                    doc["sources"][name] = {"status": "skipped", "reason": str(e)[-2000:]}
                    print(f"{name}: could not be written, skipped:\n{str(e)[-2000:]}", file=sys.stderr)
                    status = 2
                    continue
                sources[name], kinds[name] = path, kind
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                print(f"{name}: written in {time.perf_counter() - t0:.1f} s ({fmt_bytes(size)} of files)", flush=True)
                doc["sources"][name] = {"status": "ok", "source_bytes": size, "runs": {}}
        for rep in range(args.repeats):
            for name, path in sources.items():
                theirs, like, others = TOOLS[kinds[name]]
                tools = [theirs, like, *others]
                tools = tools[rep % len(tools):] + tools[:rep % len(tools)]  # interleaved order
                out = work / "out" / name
                for tool in tools:
                    prewarm(path)
                    r = spawn_tool(tool, path, out / tool, budget)
                    doc["sources"][name]["runs"].setdefault(tool, []).append(r)
                    print(f"  rep {rep} {name} {tool}: {r['durable_s']:.2f} s durable ({r['raw_s']:.2f} s raw), "
                          f"peak RSS {fmt_bytes(r['peak_rss'])}, peak extra anon {fmt_bytes(r['peak_anon'])}", flush=True)
                    if rep > 0:
                        remove(out / tool)
                        os.sync()
                if rep == 0:
                    bad = check_outputs(kinds[name], out)
                    doc["sources"][name]["verified"] = not bad
                    if bad:
                        status = 2
                        print(f"  {name}: resurgo's output differs from the tool's: {bad[:5]}", file=sys.stderr)
                    remove(out)
                    os.sync()
        summarize(doc)
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        if not args.keep:
            remove(work)
    print(f"\nresults: {args.out}")
    return status


def summarize(doc: dict) -> None:
    """Medians, GB/s and paired ratios per source; printed as a table."""
    print(f"\nmemory_budget {fmt_bytes(doc['config']['memory_budget'])}; sources warm; "
          "durable = the tool's time + an fsync of its output (resurgo fsyncs and commits itself)")
    print(f"{'source':<16} {'tool':<18} {'raw s':>7} {'durable s':>9} {'GB/s':>6} {'peak RSS':>10} {'extra anon':>10}")
    for name, entry in doc["sources"].items():
        if entry.get("status") != "ok":
            continue
        kind = "deepspeed" if name.startswith("deepspeed") else "dcp"
        theirs, like, others = TOOLS[kind]
        entry["median"] = {}
        for tool, runs in entry["runs"].items():
            m = {k: median(r[k] for r in runs) for k in ("raw_s", "durable_s", "peak_rss", "peak_anon", "output_bytes")}
            m["gb_per_s"] = m["output_bytes"] / m["durable_s"] / GB
            entry["median"][tool] = m
            print(f"{name:<16} {tool:<18} {m['raw_s']:>7.2f} {m['durable_s']:>9.2f} {m['gb_per_s']:>6.2f} "
                  f"{fmt_bytes(m['peak_rss']):>10} {fmt_bytes(m['peak_anon']):>10}")
        ratios = {}
        for ours in (like, *others):
            for kind_s in ("durable_s", "raw_s"):
                paired = paired_ratios([r[kind_s] for r in entry["runs"][theirs]], [r[kind_s] for r in entry["runs"][ours]])
                ratios[f"{theirs}/{ours} {kind_s}"] = median(paired)
        for in_place, copied in IN_PLACE.items():
            if in_place in entry["runs"] and copied in entry["runs"]:
                for key in ("durable_s", "output_bytes"):
                    ratios[f"{copied}/{in_place} {key}"] = median(paired_ratios(
                        [r[key] for r in entry["runs"][copied]], [r[key] for r in entry["runs"][in_place]]))
        entry["ratios"] = ratios
        for k, v in ratios.items():
            head = " (headline: like for like, durable)" if k == f"{theirs}/{like} durable_s" else ""
            print(f"  {name}: {k} = {v:.2f}x{head}")


if __name__ == "__main__":
    sys.exit(main())
