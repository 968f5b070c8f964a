"""What hostile foreign files cost to refuse: per class, the input's bytes, the wall and CPU
seconds of ``resurgo.import_checkpoint`` and its peak Python memory (tracemalloc), and the
error it ends with. Run: ``python benchmarks/bench_hostile_import.py [--json]``.

Classes: a pickle of lists sharing one child 21 and 24 levels deep (a tree walk expands them to
2**21 and 2**24 leaves), lists nested 100,000 deep, a stride-0 tensor of 2**24 elements
(torch.ones(1).expand(2**24) saved by torch.save), a spec of 4 TiB over a 4-byte file, and a DCP
``.metadata`` whose storage entry names a file outside the checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import struct
import sys
import tempfile
import time
import tracemalloc
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

import resurgo


class _StorageId:
    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _Rebuild:
    def __init__(self, storage: _StorageId):
        self.args = (storage, 0, (16,), (1,), False, OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _StorageId) else None


def torch_file(path: Path, obj=None, raw: bytes | None = None) -> Path:
    torch.save({"t": torch.arange(16, dtype=torch.float32)}, path)
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    if raw is None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        raw = buf.getvalue()
    members[next(n for n in members if n.endswith("/data.pkl"))] = raw
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def shared(levels: int) -> list:
    node: list = [1]
    for _ in range(levels):
        node = [node, node]
    return node


def cases(tmp: Path):
    for levels in (21, 24):
        path = torch_file(tmp / f"shared{levels}.pt", {"t": _Rebuild(_StorageId("0", 16)), "v": shared(levels)})
        yield f"shared lists {levels} levels", path.stat().st_size, lambda p=path: resurgo.import_checkpoint(
            p, tmp / "out", source="torch")
    deep = b"\x80\x02}X\x01\x00\x00\x00v" + b"]" * 100_000 + b"a" * 99_999 + b"s."
    path = torch_file(tmp / "deep.pt", raw=deep)
    yield "lists nested 100,000 deep", path.stat().st_size, lambda: resurgo.import_checkpoint(
        path, tmp / "out", source="torch")
    torch.save({"x": torch.ones(1).expand(2 ** 24)}, tmp / "expand.pt")
    yield "stride-0 tensor of 2**24", (tmp / "expand.pt").stat().st_size, lambda: resurgo.import_checkpoint(
        tmp / "expand.pt", tmp / "out", source="torch")
    (tmp / "src").mkdir()
    (tmp / "src" / "one.bin").write_bytes(struct.pack("<f", 1.0))
    spec = {"format": "resurgo.import-spec", "version": 1, "values": {}, "tensors": [
        {"key": "x", "dtype": "float32", "shape": [2 ** 40], "pieces": [
            {"file": "one.bin", "shape": [2 ** 40], "strides": [0], "box": {"offsets": [0], "shape": [2 ** 40]}}]}]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    yield "spec of 4 TiB over 4 bytes", (tmp / "spec.json").stat().st_size + 4, lambda: resurgo.import_checkpoint(
        tmp / "src", tmp / "out", source="spec", spec=tmp / "spec.json")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"b": torch.ones(3)}, checkpoint_id=tmp / "dcp", no_dist=True)
    md = pickle.loads((tmp / "dcp" / ".metadata").read_bytes())
    key = next(iter(md.storage_data))
    md.storage_data[key] = dataclasses.replace(md.storage_data[key], relative_path="/etc/passwd", offset=0, length=12)
    (tmp / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    size = sum(p.stat().st_size for p in (tmp / "dcp").iterdir())
    yield "DCP entry naming /etc/passwd", size, lambda: resurgo.import_checkpoint(tmp / "dcp", tmp / "out",
                                                                                 source="dcp")


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        resurgo.import_checkpoint(torch_file(Path(d) / "warm.pt", {"t": _Rebuild(_StorageId("0", 16))}),
                                  Path(d) / "warm", source="torch")  # lazy imports done before measuring
        for name, size, run in cases(Path(d)):
            tracemalloc.start()
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                run()
                outcome = "ok"
            except resurgo.ResurgoError as e:
                outcome = type(e).__name__
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            rows.append({"case": name, "input_bytes": size, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                         "peak_python_mb": round(peak / 2 ** 20, 2), "outcome": outcome})
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(f"{r['case']:<30} {r['input_bytes']:>8} B  {r['wall_s']:>7.3f} s wall  {r['cpu_s']:>7.3f} s CPU  "
              f"{r['peak_python_mb']:>7.2f} MB  {r['outcome']}")


if __name__ == "__main__":
    main()
