"""``resurgo inspect``: keys, dtypes, shapes, sizes, metadata and values of a checkpoint, from its
manifest alone (no data read, nothing unpickled)."""

from __future__ import annotations

import json
import os
from typing import Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from resurgo.cli.app import fail_cleanly, load_manifest
from resurgo.cli.render import clip, console, format_time, human_bytes, note, plural, print_json, tree_values


def _place_json(chunk) -> dict:
    if chunk.box is not None:
        return {"box": {"offsets": list(chunk.box.offsets), "shape": list(chunk.box.shape)}}
    return {"flat": {"start": chunk.flat.start, "stop": chunk.flat.stop}}


def _where_json(chunk) -> dict:
    if chunk.extents is None:
        return {"file": chunk.file, "byte_range": list(chunk.byte_range)}
    return {"extents": [{"file": f, "byte_range": [a, b]} for f, a, b in chunk.spans]}


def inspect_summary(path: str | os.PathLike, with_chunks: bool = False) -> dict:
    """Everything ``inspect --json`` prints: read from the manifest only."""
    from resurgo.manager.catalog import size_problems

    manifest, manifest_bytes = load_manifest(path)
    tensors = {}
    for key, t in manifest.tensors.items():
        entry: dict[str, Any] = {
            "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
            "bytes": sum(c.nbytes for c in t.chunks), "num_chunks": len(t.chunks),
        }
        if with_chunks:
            entry["chunks"] = [{**_place_json(c), **_where_json(c)} for c in t.chunks]
        tensors[key] = entry
    data_bytes = sum(f.bytes for f in manifest.files.values())
    return {
        "path": str(path),
        "format_version": manifest.version,
        "step": manifest.step,
        "created_at": manifest.created_at,
        "library": dict(manifest.library),
        "world": dict(manifest.world),
        "metadata": manifest.metadata,
        "save_info": manifest.save_info,
        "pickled": manifest.pickled,
        "tensors": tensors,
        "values": {key: {"type": t, "value": text} for key, t, text in tree_values(manifest.tree)},
        "totals": {
            "tensors": len(manifest.tensors),
            "tensor_bytes": manifest.tensor_bytes,
            "chunks": sum(len(t.chunks) for t in manifest.tensors.values()),
            "data_files": len(manifest.files),
            "data_bytes": data_bytes,
            "manifest_bytes": manifest_bytes,
            "bytes_on_disk": data_bytes + manifest_bytes,
            "owned_tensor_bytes": manifest.owned_bytes,
            "referenced_tensor_bytes": sum(manifest.referenced_bytes.values()),
        },
        "references": {name: {"bytes_used": used, "file_bytes": manifest.references[name].bytes}
                       for name, used in sorted(manifest.referenced_bytes.items())},
        "warnings": size_problems(path, manifest),
        "external": None if manifest.external is None else {  # an import in place: where its chunks are read
            "root": manifest.external.root, "files": {rel: f.bytes for rel, f in manifest.external.files.items()},
            "tagged": manifest.external.tag is not None},
    }


def _print_inspect(s: dict, with_chunks: bool) -> None:
    out = console()
    _print_header(out, s)
    _print_tensors(out, s)
    if with_chunks and s["tensors"]:
        _print_chunks(out, s)
    _print_values(out, s)
    _print_totals(out, s)


def _print_header(out: Any, s: dict) -> None:
    out.print(f"[bold]Checkpoint[/bold] {escape(s['path'])}")
    head = Table(box=None, show_header=False, padding=(0, 2, 0, 2))
    head.add_column(style="bold")
    head.add_column(overflow="fold")
    head.add_row("step", "-" if s["step"] is None else str(s["step"]))
    head.add_row("created", escape(f"{format_time(s['created_at'])} UTC ({s['created_at']})"))
    head.add_row("format", f"resurgo.checkpoint v{s['format_version']}")
    head.add_row("library", escape(", ".join(f"{k} {v}" for k, v in s["library"].items())))
    head.add_row("world", escape(", ".join(f"{k} {v}" for k, v in s["world"].items())))
    head.add_row("metadata", escape(clip(json.dumps(s["metadata"], default=str), 400)) if s["metadata"] else "-")
    head.add_row("save info", escape(clip(json.dumps(s["save_info"], default=str), 400)) if s["save_info"] else "-")
    head.add_row("pickled", "yes (values shown by class, never unpickled)" if s["pickled"] else "no")
    if s["external"] is not None:
        ext = s["external"]
        head.add_row("in place", escape(f"reads {plural(len(ext['files']), 'foreign file')} under {ext['root']} "
                                        f"({human_bytes(sum(ext['files'].values()))})"))
    out.print(head)
    out.print()



def _print_tensors(out: Any, s: dict) -> None:
    table = Table(title="Tensors", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("key", overflow="fold")
    table.add_column("kind")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("size", justify="right")
    table.add_column("chunks", justify="right")
    for key, t in s["tensors"].items():
        table.add_row(escape(key), t["kind"], t["dtype"], escape(str(t["shape"])), human_bytes(t["bytes"]),
                      str(t["num_chunks"]))
    if s["tensors"]:
        out.print(table)
    else:
        out.print("[bold]Tensors[/bold]: none")
    out.print()


def _print_chunks(out: Any, s: dict) -> None:
    ct = Table(title="Chunks", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
    ct.add_column("key", overflow="fold")
    ct.add_column("#", justify="right")
    ct.add_column("place")
    ct.add_column("file", overflow="fold")
    ct.add_column("bytes [start, stop)")
    for key, t in s["tensors"].items():
        for i, c in enumerate(t["chunks"]):
            place = c.get("box")
            text = ("[" + ", ".join(f"{o}:{o + n}" for o, n in zip(place["offsets"], place["shape"])) + "]"
                    if place is not None else f"flat[{c['flat']['start']}:{c['flat']['stop']}]")
            for j, where in enumerate(c.get("extents") or [c]):
                ct.add_row(escape(key) if j == 0 else "", str(i) if j == 0 else "", escape(text) if j == 0 else "",
                           escape(where["file"]), escape(f"[{where['byte_range'][0]}, {where['byte_range'][1]})"))
    out.print(ct)
    out.print()


def _print_values(out: Any, s: dict) -> None:
    if s["values"]:
        vt = Table(title="Values", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
        vt.add_column("key", overflow="fold")
        vt.add_column("type")
        vt.add_column("value", overflow="fold")
        for key, v in s["values"].items():
            vt.add_row(escape(key or "(root)"), v["type"], escape(v["value"]))
        out.print(vt)
        out.print()


def _print_totals(out: Any, s: dict) -> None:
    tot = s["totals"]
    totals = Table(title="Totals", title_justify="left", title_style="bold", box=None, show_header=False,
                   padding=(0, 2, 0, 2))
    totals.add_column(style="bold")
    totals.add_column(justify="right")
    totals.add_column()
    totals.add_row("tensors", str(tot["tensors"]), f"{human_bytes(tot['tensor_bytes'])} in {plural(tot['chunks'], 'chunk')}")
    totals.add_row("data files", str(tot["data_files"]), human_bytes(tot["data_bytes"]))
    totals.add_row("manifest", "1", human_bytes(tot["manifest_bytes"]))
    if s["references"]:  # bytes this checkpoint reads from earlier checkpoints of its root
        totals.add_row("owned", "", f"{human_bytes(tot['owned_tensor_bytes'])} of tensor data in its own files")
        totals.add_row("referenced", str(len(s["references"])),
                       f"{human_bytes(tot['referenced_tensor_bytes'])} of tensor data in files of earlier checkpoints:")
        for name, ref in s["references"].items():
            totals.add_row("", "", escape(f"{name}: {human_bytes(ref['bytes_used'])} used"))
    totals.add_row("on disk", str(tot["data_files"] + 1), f"{human_bytes(tot['bytes_on_disk'])} ({tot['bytes_on_disk']} bytes)")
    out.print(totals)
    for w in s["warnings"]:
        note(f"warning: {w} (run `resurgo verify`)", style="yellow")

def inspect(
    path: str = typer.Argument(..., metavar="PATH", help="A checkpoint directory or URL (s3://bucket/run/step_100)."),
    chunks: bool = typer.Option(False, "--chunks", help="List every chunk: its place, file(s) and byte range(s)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary."),
) -> None:
    """Keys, dtypes, shapes, sizes, metadata and values of a checkpoint (reads only the manifest)."""
    with fail_cleanly():
        summary = inspect_summary(path, with_chunks=chunks)
    if as_json:
        print_json(summary)
    else:
        _print_inspect(summary, chunks)
