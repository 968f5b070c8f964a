"""What hostile inputs cost to refuse: per class of input (pickle, spec, stride-0 expansion,
DCP metadata, safetensors header, manifest, rank index, version 4 grid, chunk overlap, declared
names, expansion on load), the largest crafted input tried, its bytes, the wall and CPU seconds
resurgo takes on it, its peak memory (Python allocations by tracemalloc, and the growth of the
process's peak resident set, which counts torch's allocations too) and the outcome.
Run: ``python benchmarks/bench_hostile_import.py [--json]``.

Foreign files go to ``resurgo.import_checkpoint``: a pickle of lists sharing one child 21 and 24
levels deep (a tree walk expands them to 2**21 and 2**24 leaves), lists nested 100,000 deep, a
stride-0 tensor of 2**24 elements (torch.ones(1).expand(2**24) saved by torch.save), a spec of
4 TiB over a 4-byte file, a DCP ``.metadata`` whose storage entry names a file outside the
checkpoint, a safetensors file declaring a 2**40-byte header and one whose 20,000-entry header
gives a tensor a negative offset. Checkpoints go to ``load_dict``, ``read_manifest``, ``verify``
or ``save(overwrite=True)``: a manifest of 20,000 tensors naming a member twice, 20,000 tensors on
one 4 KB range (loaded, then verified), a version 4 core whose 2 MB rank index does not match it, a core of 797 bytes whose
grid declares 2**40 cells, 8,000 tall columns beside 8,000 wide rows overlapping by one row, and a
core declaring 4,000 ranks x 1,000 data files overwritten by a save.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hostile_inputs import craft_grid, craft_many_files, empty_index  # noqa: E402


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


def safetensors_cases(tmp: Path):
    """A model directory whose model.safetensors header is hostile (``--from hf``)."""
    from safetensors.torch import save_file

    (tmp / "huge").mkdir()
    save_file({"a": torch.ones(4)}, str(tmp / "huge" / "model.safetensors"))
    raw = (tmp / "huge" / "model.safetensors").read_bytes()
    (tmp / "huge" / "model.safetensors").write_bytes(struct.pack("<Q", 2 ** 40) + raw[8:])
    yield "safetensors header of 2**40 B", len(raw), lambda: resurgo.import_checkpoint(
        tmp / "huge", tmp / "out", source="hf")
    (tmp / "neg").mkdir()
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(20_000)}
    header["t19999"]["data_offsets"] = [-8, -4]
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path = tmp / "neg" / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(4 * 20_000))
    yield "safetensors 20,000 entries, one <0", path.stat().st_size, lambda: resurgo.import_checkpoint(
        tmp / "neg", tmp / "out", source="hf")


def _sharing(path: Path, copies: int) -> int:
    """A checkpoint of one 4 KB tensor whose manifest (resealed) lists ``copies`` more on its bytes."""
    from resurgo.format.manifest import seal

    resurgo.save({"x": torch.arange(1024.0)}, path)
    doc = json.loads((path / "manifest.json").read_bytes())
    del doc["manifest_checksum"]
    for i in range(copies):
        doc["tensors"][f"y{i}"] = entry = json.loads(json.dumps(doc["tensors"]["x"]))
        for chunk in entry["chunks"]:
            chunk["name"] = chunk.get("name", "x")  # as the data file's header names the bytes
        doc["tree"]["items"].append([f"y{i}", {"type": "tensor", "key": f"y{i}"}])
    raw = seal(json.dumps(doc, separators=(",", ":")).encode())
    (path / "manifest.json").write_bytes(raw)
    return len(raw) + sum(p.stat().st_size for p in (path / "data").iterdir())


def _overlap(path: Path, n: int) -> int:
    """A manifest of a (2n, n) uint8 tensor in n columns then n rows, the last row moved onto the
    one above it (same element count, one row covered twice); every chunk on one byte range."""
    from resurgo.format.manifest import BoxPlace, ChunkEntry, FileEntry, Manifest, TensorEntry

    boxes = [([0, j], [n, 1]) for j in range(n)] + [([n + i, 0], [1, n]) for i in range(n - 1)] + [([2 * n - 2, 0], [1, n])]
    digest = "0" * 32
    chunks = [ChunkEntry(box=BoxPlace(offsets=o, shape=sh), file="data/a.safetensors", byte_range=[8, 8 + n],
                         block_bytes=1 << 20, checksums=[digest]) for o, sh in boxes]
    m = Manifest(format="resurgo.checkpoint", version=2, created_at="2026-01-01T00:00:00.000+00:00",
                 library={"resurgo": "0"}, world={"size": 1}, checksum_algorithm="xxh3-128", pickled=False,
                 files={"data/a.safetensors": FileEntry(bytes=8 + n, header_bytes=8, header_checksum=digest)},
                 tensors={"w": TensorEntry(kind="torch", dtype="uint8", shape=[2 * n, n], chunks=chunks)},
                 tree={"type": "dict", "items": [["w", {"type": "tensor", "key": "w"}]]})
    path.mkdir(parents=True)
    raw = m.to_json_bytes()
    (path / "manifest.json").write_bytes(raw)
    return len(raw)


def checkpoint_cases(tmp: Path):
    """Hostile resurgo checkpoints: manifest, index, grid, overlap, declared names, expansion."""
    from resurgo.pipeline.verify import verify_checkpoint

    size = _sharing(tmp / "dup", 20_000)
    raw = (tmp / "dup" / "manifest.json").read_bytes()
    (tmp / "dup" / "manifest.json").write_bytes(raw[:1] + b'"pickled":true,' + raw[1:])  # named twice
    yield "manifest naming a member twice", size, lambda: resurgo.load_dict(tmp / "dup")
    size = _sharing(tmp / "shared", 20_000)
    yield "20,000 tensors on one 4 KB range", size, lambda: resurgo.load_dict(tmp / "shared")
    yield "the same, verified", size, lambda: verify_checkpoint(tmp / "shared")
    index = bytes(2 << 20)
    size = craft_grid(tmp / "index", 4, index, stored_index=b"\1" * len(index)) + len(index)
    yield "rank index of 2 MB, altered", size, lambda: resurgo.load_dict(tmp / "index")
    size = craft_grid(tmp / "grid", 2 ** 40) + len(empty_index(0))
    yield "grid of 2**40 cells (verify)", size, lambda: verify_checkpoint(tmp / "grid")
    size = _overlap(tmp / "overlap", 8000)
    yield "8,000 columns beside 8,000 rows", size, lambda: resurgo.read_manifest(tmp / "overlap")
    ck = tmp / "names" / "ck"
    size = craft_many_files(ck, world=4000, files_per_rank=1000)
    yield "4,000 ranks x 1,000 files declared", size, lambda: resurgo.save({"w": torch.ones(3)}, ck, overwrite=True)


# The class of hostile input each case is the largest one tried of.
CLASSES = {"shared lists 21 levels": "pickle", "shared lists 24 levels": "pickle",
           "lists nested 100,000 deep": "pickle", "stride-0 tensor of 2**24": "expansion (import)",
           "spec of 4 TiB over 4 bytes": "spec", "DCP entry naming /etc/passwd": "DCP metadata",
           "safetensors header of 2**40 B": "safetensors header", "safetensors 20,000 entries, one <0": "safetensors header",
           "manifest naming a member twice": "manifest", "20,000 tensors on one 4 KB range": "expansion (load)",
           "the same, verified": "expansion (verify)",
           "rank index of 2 MB, altered": "index", "grid of 2**40 cells (verify)": "grid",
           "8,000 columns beside 8,000 rows": "overlap", "4,000 ranks x 1,000 files declared": "names"}


def _rss_reset() -> int:
    """Resets the process's peak resident set to the current one (Linux); returns it in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _rss("VmRSS")


def _rss(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        resurgo.import_checkpoint(torch_file(Path(d) / "warm.pt", {"t": _Rebuild(_StorageId("0", 16))}),
                                  Path(d) / "warm", source="torch")  # lazy imports done before measuring
        for name, size, run in itertools.chain(cases(Path(d)), safetensors_cases(Path(d)), checkpoint_cases(Path(d))):
            rss = _rss_reset()
            tracemalloc.start()
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                out = run()
                outcome = "ok" if getattr(out, "ok", True) else f"reported: {out.problems[0][:60]}"
                if hasattr(out, "bytes_read"):
                    outcome += f" ({out.bytes_read:,} B read for {out.bytes_checked:,} B checked)"
            except resurgo.ResurgoError as e:
                outcome = type(e).__name__
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            rows.append({"class": CLASSES.get(name, ""), "case": name, "input_bytes": size, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                         "peak_python_mb": round(peak / 2 ** 20, 2),
                         "peak_rss_growth_mb": round(max(0, _rss("VmHWM") - rss) / 2 ** 20, 1), "outcome": outcome})
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
        return
    print("| class | case | input | wall | CPU | peak Python | peak RSS growth | outcome |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['class']} | {r['case']} | {r['input_bytes']:,} B | {r['wall_s']:.3f} s | {r['cpu_s']:.3f} s | "
              f"{r['peak_python_mb']:.2f} MB | {r['peak_rss_growth_mb']:.1f} MB | {r['outcome']} |")


if __name__ == "__main__":
    main()
