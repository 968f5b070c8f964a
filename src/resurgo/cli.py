"""The command line: ``resurgo inspect | verify | diff | ls | gc | convert | bench | study``.

``study`` runs the checkpointing study (``resurgo.study``) and writes its report. Every other
command reads only the manifest unless it has to read data (``verify``, ``ls --verify``),
never unpickles anything, and turns an error into a one-line red message on stderr (no
traceback). ``--json`` prints a machine-readable summary on stdout instead of the tables.

Exit codes, the same for every command (:data:`EXIT_CODES` maps errors to them, in one place):
0 success; 1 ``diff`` only: the checkpoints differ; 2 usage: a bad command line or a refused
request; 3 damaged: a checkpoint whose bytes do not match what it declares; 4 unavailable: not
found, not a checkpoint, never committed, or a storage error.

Only typer and rich are imported here at module level: torch and the rest of resurgo are
imported inside the commands, so that ``resurgo --help`` starts at once.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignFilesError,
    ManifestError,
    MemoryBudgetError,
    NotACheckpointError,
    ResurgoError,
    StorageError,
)
from resurgo.version import __version__

if TYPE_CHECKING:
    from resurgo.diff import CheckpointDiff, TensorDiff
    from resurgo.format.manifest import Manifest
    from resurgo.manager.gc import GcItem
    from resurgo.pipeline.verify import VerifyReport

PROGRESS_THRESHOLD_BYTES = 64 << 20  # verify and convert show a progress bar above this much tensor data
MAX_VALUE_CHARS = 72  # non-tensor values are clipped to this many characters

EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE, EXIT_DAMAGED, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4

# Every error a command can end with, and its exit code: the first class that matches wins, so
# the refusals that are also OS errors (FileExistsError) come before OSError.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (CorruptCheckpointError, EXIT_DAMAGED),
    (ManifestError, EXIT_DAMAGED),
    (CheckpointExistsError, EXIT_USAGE),
    (MemoryBudgetError, EXIT_USAGE),
    (CheckpointNotFoundError, EXIT_UNAVAILABLE),
    (NotACheckpointError, EXIT_UNAVAILABLE),  # and IncompleteCheckpointError
    (StorageError, EXIT_UNAVAILABLE),
    (OSError, EXIT_UNAVAILABLE),
    (ResurgoError, EXIT_USAGE),  # refused: pickled values, foreign files, unsupported values
    (ValueError, EXIT_USAGE),  # arguments that do not fit
)


def exit_code_of(error: BaseException) -> int:
    """The exit code a command ends with when ``error`` stops it (see :data:`EXIT_CODES`)."""
    for cls, code in EXIT_CODES:
        if isinstance(error, cls):
            return code
    raise error


def _version_callback(value: bool) -> None:
    if value:
        print(f"resurgo {__version__}")
        raise typer.Exit()


_TYPE_TAG = re.compile(r" <[^<>]*>")  # typer's " <str>", " <bool>", " <int range>" after a name


def _format_options(command: Any, ctx: Any, formatter: Any) -> None:
    """Arguments and options as click lays them out, without typer's type tags: metavars (N,
    SIZE, ROOT) and the help text say what a value is."""
    sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            name, text = record
            sections["Arguments" if param.param_type_name == "argument" else "Options"].append(
                (_TYPE_TAG.sub("", name), text))
    for title, rows in sections.items():
        if rows:
            with formatter.section(title):
                formatter.write_dl(rows)


class _Group(TyperGroup):
    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_options(self, ctx, formatter)
        self.format_commands(ctx, formatter)


class _Command(TyperCommand):
    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_options(self, ctx, formatter)


app = typer.Typer(
    name="resurgo",
    cls=_Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: paragraphs rewrapped to the terminal, no boxes
)


def _command(name: Optional[str] = None) -> Any:
    return app.command(name, cls=_Command)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Inspect, verify, list, garbage-collect and convert resurgo checkpoints; run the checkpointing study.

    Exit codes: 0 success, 1 diff found differences, 2 usage error or refused, 3 damaged
    checkpoint, 4 not found, not a checkpoint, incomplete, or storage error."""


# -- output helpers ---------------------------------------------------------------------------
def _console(stderr: bool = False) -> Console:
    """A console on the current stdout/stderr; not squeezed to 80 columns when piped."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=200)
    return console


def _error(message: str) -> None:
    _console(stderr=True).print(f"error: {message}", style="bold red", markup=False, soft_wrap=True)


@contextmanager
def _fail_cleanly() -> Iterator[None]:
    """An error that stops a command becomes one red line and its exit code, never a traceback."""
    try:
        yield
    except (ResurgoError, OSError, ValueError) as e:
        code = exit_code_of(e)
        if isinstance(e, OSError) and not isinstance(e, ResurgoError):
            _error(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
        else:
            _error(str(e))
        raise typer.Exit(code) from None


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


def human_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``3.0 GiB``."""
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        size /= 1024
        if size < 1024 or unit == "PiB":
            return f"{size:.1f} {unit}"
    raise AssertionError("unreachable")


def _plural(n: int, word: str) -> str:
    from resurgo.wording import plural

    return plural(n, word)


def _clip(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _format_time(iso: Optional[str]) -> str:
    """An ISO timestamp as ``YYYY-MM-DD HH:MM:SS`` UTC; unparsable ones as they are."""
    if not iso:
        return "-"
    try:
        t = datetime.fromisoformat(iso)
    except ValueError:
        return _clip(iso, 40)
    if t.tzinfo is not None:
        t = t.astimezone(timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def _load_manifest(path: str | os.PathLike) -> tuple[Manifest, int]:
    """The validated manifest of ``path`` and its size in bytes."""
    from resurgo.format.manifest import MANIFEST_NAME, parse_manifest
    from resurgo.storage.open import open_checkpoint

    ckpt = open_checkpoint(path)  # a URL: credentials from the environment / ~/.aws (s3fs)
    raw = ckpt.read_manifest_bytes()
    return parse_manifest(raw, ckpt.describe(MANIFEST_NAME)), len(raw)


# -- the tree's non-tensor values, decoded without reading data or unpickling ------------------
def render_scalar(node: dict) -> str:
    """A short readable form of one tagged scalar node; pickled values are never loaded."""
    from resurgo.format import values

    t = node.get("type")
    if t == "pickle":
        return f"<pickled {_clip(str(node.get('class')), 100)}>"
    try:
        v = values.decode_scalar(node, "", allow_pickle=False)
    except ResurgoError:
        return f"<invalid {str(t)[:40]} node>"
    if t == "numpy_scalar":
        return f"numpy.{node['dtype']}({v.item()!r})"
    if t == "torch_dtype":
        return f"torch.{node['value']}"
    if t == "torch_device":
        return f"torch.device({str(v)!r})"
    try:
        return _clip(repr(v))
    except ValueError:  # an int too long for str() (sys.set_int_max_str_digits)
        return f"<int of {v.bit_length()} bits>"


def _key_component(knode: Any) -> Any:
    from resurgo.format import values

    if isinstance(knode, str):
        return knode
    if isinstance(knode, dict) and knode.get("type") in values.SCALAR_TYPES and knode.get("type") != "pickle":
        try:
            return values.decode_scalar(knode, "", allow_pickle=False)
        except ResurgoError:
            pass
    return "<?>"


_EMPTY = {"dict": "{}", "ordered_dict": "OrderedDict()", "list": "[]", "tuple": "()"}


def tree_values(tree: Any) -> list[tuple[str, str, str]]:
    """(key, type, short text) of every non-tensor leaf of a manifest tree, in tree order.

    Keys follow the tensor key convention (path joined with '.', Statefuls add no component).
    A list or tuple of scalars is shown on one line; empty containers appear as ``{}``/``[]``.
    """
    from resurgo.format import values
    from resurgo.format.tree import MAX_TREE_DEPTH
    from resurgo.state.flatten import path_key

    out: list[tuple[str, str, str]] = []

    def scalar_seq(t: str, items: list) -> str:
        inner = ", ".join(render_scalar(n) for n in items)
        if t == "tuple":
            return _clip(f"({inner},)" if len(items) == 1 else f"({inner})")
        return _clip(f"[{inner}]")

    def walk(node: Any, path: tuple, depth: int) -> None:
        key = path_key(path)
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            out.append((key, "?", "<invalid node>"))
            return
        t = node["type"]
        if depth > MAX_TREE_DEPTH:
            out.append((key, t, "<nested too deep>"))
            return
        if t in ("tensor", "ndarray"):
            return
        if t == "stateful":
            walk(node.get("state"), path, depth + 1)
            return
        if t in _EMPTY:
            items = node.get("items")
            if not isinstance(items, list):
                out.append((key, t, "<invalid node>"))
            elif not items:
                out.append((key, t, _EMPTY[t]))
            elif t in ("dict", "ordered_dict"):
                for pair in items:
                    if isinstance(pair, list) and len(pair) == 2:
                        walk(pair[1], path + (_key_component(pair[0]),), depth + 1)
                    else:
                        out.append((key, t, "<invalid item>"))
            elif all(isinstance(n, dict) and n.get("type") in values.SCALAR_TYPES for n in items):
                out.append((key, t, scalar_seq(t, items)))
            else:
                for i, n in enumerate(items):
                    walk(n, path + (i,), depth + 1)
            return
        if t == "per_rank":  # one value per saving rank: key@rankN, as per-rank tensors are named
            items = node.get("items")
            if not isinstance(items, list):
                out.append((key, t, "<invalid node>"))
                return
            for r, n in enumerate(items):
                walk(n, path[:-1] + (f"{path[-1]}@rank{r}",) if path else (f"@rank{r}",), depth + 1)
            return
        if t == "torch_size":
            out.append((key, t, _clip(f"torch.Size({node.get('items')!r})")))
            return
        if t in values.SCALAR_TYPES:
            out.append((key, t, render_scalar(node)))
            return
        out.append((key, _clip(t, 40), "<unknown node type>"))

    walk(tree, (), 0)
    return out


# -- inspect ----------------------------------------------------------------------------------
def _place_json(chunk) -> dict:
    if chunk.box is not None:
        return {"box": {"offsets": list(chunk.box.offsets), "shape": list(chunk.box.shape)}}
    return {"flat": {"start": chunk.flat.start, "stop": chunk.flat.stop}}


def _object_size_problems(url: str, manifest: Manifest) -> list[str]:
    """Data objects missing or of another size than the manifest says (one listing, no reads)."""
    from resurgo.storage.fsspec_store import ObjectCheckpoint

    stored = ObjectCheckpoint(url).listing().files
    return [f"{name}: missing" if name not in stored else f"{name}: {stored[name]} bytes stored, the manifest says {e.bytes}"
            for name, e in manifest.files.items() if stored.get(name) != e.bytes]


def inspect_summary(path: str | os.PathLike, with_chunks: bool = False) -> dict:
    """Everything ``inspect --json`` prints: read from the manifest only."""
    from resurgo.manager.catalog import file_size_problems
    from resurgo.storage.open import is_url

    manifest, manifest_bytes = _load_manifest(path)
    tensors = {}
    for key, t in manifest.tensors.items():
        entry: dict[str, Any] = {
            "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape),
            "bytes": sum(c.nbytes for c in t.chunks), "num_chunks": len(t.chunks),
        }
        if with_chunks:
            entry["chunks"] = [{**_place_json(c), "file": c.file, "byte_range": list(c.byte_range)} for c in t.chunks]
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
        },
        "warnings": _object_size_problems(str(path), manifest) if is_url(path) else file_size_problems(path, manifest),
    }


def _print_inspect(s: dict, with_chunks: bool) -> None:
    out = _console()
    tot = s["totals"]
    out.print(f"[bold]Checkpoint[/bold] {escape(s['path'])}")
    head = Table(box=None, show_header=False, padding=(0, 2, 0, 2))
    head.add_column(style="bold")
    head.add_column(overflow="fold")
    head.add_row("step", "-" if s["step"] is None else str(s["step"]))
    head.add_row("created", escape(f"{_format_time(s['created_at'])} UTC ({s['created_at']})"))
    head.add_row("format", f"resurgo.checkpoint v{s['format_version']}")
    head.add_row("library", escape(", ".join(f"{k} {v}" for k, v in s["library"].items())))
    head.add_row("world", escape(", ".join(f"{k} {v}" for k, v in s["world"].items())))
    head.add_row("metadata", escape(_clip(json.dumps(s["metadata"], default=str), 400)) if s["metadata"] else "-")
    head.add_row("save info", escape(_clip(json.dumps(s["save_info"], default=str), 400)) if s["save_info"] else "-")
    head.add_row("pickled", "yes (values shown by class, never unpickled)" if s["pickled"] else "no")
    out.print(head)
    out.print()

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

    if with_chunks and s["tensors"]:
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
                ct.add_row(escape(key), str(i), escape(text), escape(c["file"]),
                           escape(f"[{c['byte_range'][0]}, {c['byte_range'][1]})"))
        out.print(ct)
        out.print()

    if s["values"]:
        vt = Table(title="Values", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, show_edge=False)
        vt.add_column("key", overflow="fold")
        vt.add_column("type")
        vt.add_column("value", overflow="fold")
        for key, v in s["values"].items():
            vt.add_row(escape(key or "(root)"), v["type"], escape(v["value"]))
        out.print(vt)
        out.print()

    totals = Table(title="Totals", title_justify="left", title_style="bold", box=None, show_header=False,
                   padding=(0, 2, 0, 2))
    totals.add_column(style="bold")
    totals.add_column(justify="right")
    totals.add_column()
    totals.add_row("tensors", str(tot["tensors"]), f"{human_bytes(tot['tensor_bytes'])} in {_plural(tot['chunks'], 'chunk')}")
    totals.add_row("data files", str(tot["data_files"]), human_bytes(tot["data_bytes"]))
    totals.add_row("manifest", "1", human_bytes(tot["manifest_bytes"]))
    totals.add_row("on disk", str(tot["data_files"] + 1), f"{human_bytes(tot['bytes_on_disk'])} ({tot['bytes_on_disk']} bytes)")
    out.print(totals)
    for w in s["warnings"]:
        _console(stderr=True).print(f"warning: {w} (run `resurgo verify`)", style="yellow", markup=False,
                                    soft_wrap=True)


@_command()
def inspect(
    path: str = typer.Argument(..., metavar="PATH", help="A checkpoint directory or URL (s3://bucket/run/step_100)."),
    chunks: bool = typer.Option(False, "--chunks", help="List every chunk: its place, file and byte range."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary."),
) -> None:
    """Keys, dtypes, shapes, sizes, metadata and values of a checkpoint (reads only the manifest)."""
    with _fail_cleanly():
        summary = inspect_summary(path, with_chunks=chunks)
    if as_json:
        _print_json(summary)
    else:
        _print_inspect(summary, chunks)


# -- diff -------------------------------------------------------------------------------------
def render_node(node: Optional[dict]) -> str:
    """A value node of the tree in one short line; ``-`` for an absent one."""
    if node is None:
        return "-"
    t = node.get("type")
    if t in _EMPTY:
        return _EMPTY[t]
    if t == "torch_size":
        return _clip(f"torch.Size({node.get('items')!r})")
    return render_scalar(node)


def _diff_detail(t: TensorDiff) -> str:
    if t.change in ("only_a", "only_b"):
        return f"only in {t.change[-1].upper()}"
    if t.change != "data":
        return f"{t.change} differs"
    parts = []
    if t.blocks_differing is not None:
        parts.append(f"{t.blocks_differing} of {t.blocks_total} checksum blocks differ")
    if t.elements_differing is not None:
        parts.append(f"{_plural(t.elements_differing, 'element')} differ" if t.elements_differing != 1 else "1 element differs")
    if t.max_abs_diff is not None:
        parts.append(f"max |a-b| {t.max_abs_diff:.6g}")
    return ", ".join(parts)


@_command("diff")
def diff_command(
    a: str = typer.Argument(..., metavar="A", help="A checkpoint directory or URL."),
    b: str = typer.Argument(..., metavar="B", help="Another checkpoint directory or URL."),
    stats: bool = typer.Option(False, "--stats", help="Read tensors that differ: how many elements, and the largest |a-b|."),
    only: Optional[str] = typer.Option(None, "--only", metavar="PREFIX", help="Compare only the keys with this prefix (e.g. 'model.')."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", metavar="SIZE",
                                                help="Memory for tensors read to compare (default 256MiB)."),
    verify: bool = typer.Option(False, "--verify", help="First read and verify every byte of both checkpoints."),
    save_info: bool = typer.Option(False, "--save-info",
                                   help="Also compare what describes the save: creation time, library versions, save_info."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """What differs between two checkpoints: step, metadata, tensors, values. Exit 0 same, 1 differ,
    3 a checkpoint is damaged.

    Every data file's size is checked. Tensors stored in the same chunks compare by their checksums
    (no data read; --verify checks the data against them first); others are read, verified and
    compared bit for bit."""
    budget = _size_option(memory_budget, "--memory-budget")
    with _fail_cleanly():
        from resurgo.diff import DEFAULT_DIFF_BUDGET, diff_checkpoints

        found = diff_checkpoints(a, b, stats=stats, only=only, memory_budget=budget or DEFAULT_DIFF_BUDGET,
                                 verify=verify, include_save_info=save_info)
    if as_json:
        doc = asdict(found)
        doc["identical"] = found.identical
        doc["fields"] = [{"field": f, "a": x, "b": y} for f, x, y in found.fields]
        _print_json(doc)
    else:
        _print_diff(found)
    raise typer.Exit(EXIT_OK if found.identical else EXIT_DIFFERENT)


def _diff_table(*columns: str) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def _print_diff(d: CheckpointDiff) -> None:
    out = _console()
    out.print(f"[bold]A[/bold] {escape(d.a)}\n[bold]B[/bold] {escape(d.b)}", soft_wrap=True)
    if d.fields:
        table = _diff_table("field", "A", "B")
        for name, x, y in d.fields:
            table.add_row(escape(name), escape(_clip(json.dumps(x))), escape(_clip(json.dumps(y))))
        out.print(table)
    if d.tensors:
        table = _diff_table("tensor", "A", "B", "difference")
        for t in d.tensors:
            table.add_row(escape(t.key), t.a or "-", t.b or "-", escape(_diff_detail(t)))
        out.print(table)
    if d.values:
        table = _diff_table("value", "A", "B")
        for v in d.values:
            table.add_row(escape(v.key), escape(render_node(v.a)), escape(render_node(v.b)))
        out.print(table)
    equal = (f"{_plural(d.equal_by_checksums + d.equal_by_data, 'tensor')} equal "
             f"({d.equal_by_checksums} by checksums, {d.equal_by_data} by reading); {human_bytes(d.bytes_read)} read")
    if d.verified:
        equal += f"; both verified ({human_bytes(d.bytes_verified)})"
    if d.identical:
        out.print(f"[bold green]SAME[/bold green] {equal}", soft_wrap=True)
    else:
        out.print(f"[bold red]DIFFERENT[/bold red] {_plural(len(d.fields), 'field')}, "
                  f"{_plural(len(d.tensors), 'tensor')}, {_plural(len(d.values), 'value')} differ; {equal}",
                  soft_wrap=True)


# -- verify -----------------------------------------------------------------------------------
def _verify_with_progress(path: str, total: int, show: bool) -> VerifyReport:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from resurgo.pipeline.verify import verify_checkpoint

    if not show:
        return verify_checkpoint(path)
    columns = (TextColumn("verifying"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=_console(stderr=True), transient=True) as progress:
        task = progress.add_task("verify", total=total)
        return verify_checkpoint(path, progress=lambda n: progress.advance(task, n))


@_command()
def verify(
    path: str = typer.Argument(..., metavar="PATH", help="A checkpoint directory or URL (s3://bucket/run/step_100)."),
    progress: Optional[bool] = typer.Option(
        None, "--progress/--no-progress",
        help=f"Show a progress bar (default: on a terminal, above {human_bytes(PROGRESS_THRESHOLD_BYTES)} of data).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """Check every file size, header and block checksum. Exit 0 clean, 3 damaged, 4 unreadable."""
    from resurgo.pipeline.verify import VerifyReport

    with _fail_cleanly():
        manifest: Manifest | None
        try:
            manifest = _load_manifest(path)[0]
        except (CorruptCheckpointError, ManifestError) as e:  # an edited or broken manifest: damaged
            manifest, report, seconds = None, VerifyReport(str(path), problems=[str(e)]), 0.0
        if manifest is not None:
            show = progress if progress is not None else (
                manifest.tensor_bytes > PROGRESS_THRESHOLD_BYTES and _console(stderr=True).is_terminal and not as_json)
            t0 = time.perf_counter()
            report = _verify_with_progress(path, manifest.tensor_bytes, show)
            seconds = time.perf_counter() - t0
    n_files = len(manifest.files) if manifest else 0
    if as_json:
        _print_json({"path": str(path), "ok": report.ok, "tensor_bytes": manifest.tensor_bytes if manifest else None,
                     "bytes_checked": report.bytes_checked, "chunks_checked": report.chunks_checked,
                     "data_files": n_files if manifest else None, "problems": report.problems})
    else:
        out = _console()
        for p in report.problems:
            out.print(f"  - {p}", style="red", markup=False, soft_wrap=True)
        counts = (f"{_plural(report.chunks_checked, 'chunk')} in {_plural(n_files, 'file')}, "
                  f"{human_bytes(report.bytes_checked)} checked in {seconds:.2f} s")
        if report.ok:
            out.print(f"[bold green]OK[/bold green] {escape(str(path))}: {counts}", soft_wrap=True)
        else:
            out.print(f"[bold red]CORRUPT[/bold red] {escape(str(path))}: {_plural(len(report.problems), 'problem')} "
                      f"({counts})", soft_wrap=True)
    raise typer.Exit(EXIT_OK if report.ok else EXIT_DAMAGED)


# -- ls ---------------------------------------------------------------------------------------
@dataclass
class Listed:
    path: str  # relative to the listed directory ("." for the directory itself)
    status: str  # committed | incomplete | temporary | corrupt
    step: Optional[int]
    bytes: int  # every file under the directory, as found on disk
    created_at: Optional[str]
    detail: str
    metrics: dict  # what a CheckpointManager stored with the checkpoint (metadata "metrics")


def list_checkpoints(root: Path) -> list[Listed]:
    """Every checkpoint (or leftover of a save) at or below ``root``, sorted by path.

    Does not descend into a checkpoint, an incomplete save or a temporary directory, and does not
    follow symbolic links to directories.
    """
    from resurgo.manager import catalog

    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: no such directory")
    if not root.is_dir():
        raise NotACheckpointError(f"{root}: is a file, expected a directory")
    found: list[Listed] = []
    stack = [root]
    while stack:
        d = stack.pop()
        c = catalog.classify(d)
        if c is not None:
            rel = d.relative_to(root).as_posix() if d != root else "."
            found.append(Listed(rel, c.status, c.step, catalog.dir_bytes(d), c.created_at, c.detail, c.metrics))
            continue
        try:
            with os.scandir(d) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
        except OSError:
            continue
    found.sort(key=lambda e: (() if e.path == "." else tuple(e.path.split("/"))))
    return found


def list_object_checkpoints_listed(url: str) -> list[Listed]:
    """Every checkpoint (or incomplete save) at or below a URL prefix, from one listing."""
    from resurgo.manager.roots import list_object_checkpoints

    return [Listed(str(e.path), e.status, e.step, e.nbytes, e.created_at, e.detail, e.metrics)
            for e in list_object_checkpoints(url)]


def _listing_table(columns: list[str], note: str) -> Table:
    """A table of checkpoints: path, step, size, then ``columns``, then a dim ``note`` column."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("path", overflow="fold")
    table.add_column("step", justify="right")
    table.add_column("size", justify="right")
    for name in columns:
        table.add_column(name, overflow="fold")
    table.add_column(note, overflow="fold", style="dim")
    return table


_STATUS_STYLE = {"committed": "green", "incomplete": "yellow", "temporary": "yellow", "corrupt": "bold red"}
_CORRUPT = "corrupt"  # the catalog's status of a damaged checkpoint (resurgo.manager.catalog.CORRUPT)


def _format_metrics(metrics: dict) -> str:
    return ", ".join(f"{k}={'-' if v is None else format(v, '.6g') if isinstance(v, (int, float)) else v}"
                     for k, v in metrics.items())


@_command("ls")
def ls(
    directory: str = typer.Argument(".", metavar="DIRECTORY", help="The directory or URL prefix to search (recursively)."),
    verify_all: bool = typer.Option(False, "--verify", help="Also verify every checksum of committed checkpoints."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable list."),
) -> None:
    """Every checkpoint at or below DIRECTORY: path, step, size, creation time, status and metrics.

    Exit 0, or 3 when a checkpoint is damaged (its manifest does not verify, or a data file has
    another size; with --verify, also a block that does not match its checksum).
    """
    with _fail_cleanly():
        from resurgo.manager import catalog
        from resurgo.pipeline.verify import verify_checkpoint
        from resurgo.storage.open import is_url, join

        entries = list_object_checkpoints_listed(directory) if is_url(directory) else list_checkpoints(Path(directory))
        if verify_all:
            for e in entries:
                if e.status != catalog.COMMITTED:
                    continue
                try:
                    report = verify_checkpoint(directory if e.path == "." else join(directory, e.path))
                except ResurgoError as err:  # changed since it was listed
                    e.status, e.detail = catalog.CORRUPT, str(err)
                    continue
                if not report.ok:
                    more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
                    e.status, e.detail = catalog.CORRUPT, report.problems[0] + more
    exit_code = EXIT_DAMAGED if any(e.status == _CORRUPT for e in entries) else EXIT_OK
    if as_json:
        docs = [asdict(e) for e in entries]
        if verify_all:
            for doc in docs:
                doc["verified"] = doc["status"] == "committed"
        _print_json({"root": str(directory), "checkpoints": docs})
        raise typer.Exit(exit_code)
    out = _console()
    if not entries:
        out.print(f"no checkpoints at or below {escape(str(directory))}")
        return
    show_metrics = any(e.metrics for e in entries)  # checkpoints of a CheckpointManager
    table = _listing_table(["created (UTC)", "status"] + (["metrics"] if show_metrics else []), "detail")
    for e in entries:
        status = e.status + (" (verified)" if verify_all and e.status == "committed" else "")
        metrics = [escape(_clip(_format_metrics(e.metrics), 80))] if show_metrics else []
        table.add_row(escape(e.path), "-" if e.step is None else str(e.step), human_bytes(e.bytes),
                      _format_time(e.created_at), f"[{_STATUS_STYLE[e.status]}]{status}[/]", *metrics,
                      escape(_clip(e.detail, 160)))
    out.print(table)
    raise typer.Exit(exit_code)


# -- gc ---------------------------------------------------------------------------------------
def _parse_keep_best(text: str) -> tuple:
    """``loss:min`` -> ("loss", "min"); ``acc:max:3`` -> ("acc", "max", 3)."""
    parts = text.rsplit(":", 2) if text.count(":") >= 2 else text.rsplit(":", 1)
    if len(parts) == 3 and parts[2].isdigit():
        return parts[0], parts[1], int(parts[2])
    if len(parts) == 2 and parts[0] and parts[1] in ("min", "max"):
        return parts[0], parts[1]
    raise typer.BadParameter(f"expected METRIC:min or METRIC:max (optionally :K), got {text!r}",
                             param_hint="--keep-best")


@_command("gc")
def gc(
    root: str = typer.Argument(..., metavar="ROOT",
                               help="A CheckpointManager root (step_NNNNNNNNN below it): a directory or a URL."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", min=1, metavar="N",
                                            help="Keep the N newest committed checkpoints (replaces the recorded keep_last)."),
    keep_every: Optional[int] = typer.Option(None, "--keep-every", min=1, metavar="N",
                                             help="Keep every checkpoint whose step is a multiple of N (replaces the "
                                                  "recorded keep_every)."),
    keep_best: Optional[str] = typer.Option(None, "--keep-best", metavar="METRIC:min|max",
                                            help="Keep the checkpoint with the best value of METRIC (METRIC:mode:K "
                                                 "keeps K); replaces the recorded keep_best."),
    no_keep_best: bool = typer.Option(False, "--no-keep-best", help="Drop the recorded keep_best rule."),
    ignore_recorded: bool = typer.Option(False, "--ignore-recorded",
                                         help="Apply only the rules given here, not those the manager recorded."),
    stale_after: float = typer.Option(3600.0, "--stale-after", min=0.0, metavar="SECONDS",
                                      help="Remove incomplete checkpoints and temporary directories unchanged "
                                           "for this many seconds (younger ones may belong to a running save)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be deleted and why the rest is kept; "
                                                          "delete nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable plan."),
) -> None:
    """Delete the checkpoints of a manager root that its retention rules do not keep (never the
    newest committed one), incomplete checkpoints and stale temporary directories; damaged ones are kept.

    The rules are those the CheckpointManager recorded in the newest checkpoint (keep_last,
    keep_every, keep_best), so `resurgo gc ROOT` deletes what the manager would; each option
    replaces the recorded rule of its name. Exit 0, or 3 when a damaged checkpoint was found (kept)."""
    best = _parse_keep_best(keep_best) if keep_best is not None else None
    if best is not None and no_keep_best:
        raise typer.BadParameter("give --keep-best or --no-keep-best, not both", param_hint="--no-keep-best")
    with _fail_cleanly():
        from resurgo.manager import catalog
        from resurgo.manager.gc import DELETE, gc_policy, plan_gc
        from resurgo.manager.removal import remove_checkpoint
        from resurgo.manager.roots import LocalRoot, ObjectRoot, root_name
        from resurgo.storage.open import is_url

        rules: dict[str, Any] = dict(keep_last=keep_last, keep_every=keep_every, keep_best=best, no_keep_best=no_keep_best,
                     ignore_recorded=ignore_recorded)
        if is_url(root):  # one listing; an incomplete save's age is that of its newest object
            store = ObjectRoot(root)
            entries = store.scan()
            policy, source = gc_policy(entries, root_name(store), **rules)
            newest = {e.path: e.newest for e in entries}
            plan = plan_gc(entries, policy, now=time.time(), stale_after=stale_after, mtime=lambda p: newest[p])
            sizes = {id(item): item.entry.nbytes for item in plan}
            for item in plan:
                if item.action == DELETE and item.entry.step is not None:
                    _gc_remove(item, functools.partial(store.remove, item.entry.step, dry_run=dry_run))
        else:
            local = Path(root)
            if not local.exists():
                raise CheckpointNotFoundError(f"{local}: no such directory")
            if not local.is_dir():
                raise NotACheckpointError(f"{local}: is a file, expected a CheckpointManager root directory")
            entries = catalog.scan_root(local)
            policy, source = gc_policy(entries, root_name(LocalRoot(local)), **rules)
            plan = plan_gc(entries, policy, now=time.time(), stale_after=stale_after, mtime=catalog.newest_mtime)
            sizes = {id(item): catalog.dir_bytes(item.entry.path) for item in plan}
            for item in plan:
                if item.action == DELETE:
                    _gc_remove(item, functools.partial(remove_checkpoint, item.entry.path, dry_run=dry_run))
    from resurgo.manager.retention import describe

    rules_text = describe(policy) if policy is not None else "none (every committed checkpoint is kept)"
    exit_code = EXIT_DAMAGED if any(item.entry.status == _CORRUPT for item in plan) else EXIT_OK
    doomed = [item for item in plan if item.action == DELETE]
    freed = sum(sizes[id(item)] for item in doomed)
    verb = "would delete" if dry_run else "deleted"
    if as_json:
        _print_json({"root": str(root), "dry_run": dry_run, "bytes_freed": 0 if dry_run else freed,
                     "retention": {"rules": rules_text, "source": source}, "items": [
            {"path": item.entry.path.name, "step": item.entry.step, "status": item.entry.status,
             "action": item.action, "bytes": sizes[id(item)], "reason": item.reason} for item in plan]})
        raise typer.Exit(exit_code)
    out = _console()
    if not plan:
        out.print(f"no checkpoints in {escape(str(root))}")
        return
    out.print(f"retention: {escape(rules_text)} ({escape(source)})", soft_wrap=True)
    table = _listing_table(["status", "action"], "why")
    for item in plan:
        e = item.entry
        action = verb if item.action == DELETE else "keep"
        table.add_row(escape(e.path.name), "-" if e.step is None else str(e.step), human_bytes(sizes[id(item)]),
                      f"[{_STATUS_STYLE[e.status]}]{e.status}[/]",
                      f"[bold red]{action}[/]" if item.action == DELETE else action, escape(item.reason))
    out.print(table)
    out.print(f"{verb} {len(doomed)} of {len(plan)}, {human_bytes(freed)}"
              + (" (dry run: nothing was deleted)" if dry_run else ""))
    raise typer.Exit(exit_code)


def _gc_remove(item: GcItem, remove: Callable[[], bool]) -> None:
    """Delete (or, in a dry run, check) one item; one holding files resurgo did not write is kept,
    with a warning naming one of them."""
    from resurgo.manager.gc import KEEP

    try:
        remove()
    except ForeignFilesError as e:
        item.action, item.reason = KEEP, f"refused: {e}"
        typer.echo(f"warning: {e}", err=True)


# -- convert ----------------------------------------------------------------------------------
def _size_option(value: Optional[str], what: str) -> Optional[int]:
    if value is None:
        return None
    from resurgo.convert import parse_size

    try:
        return parse_size(value, what)
    except ValueError as e:
        _error(str(e))
        raise typer.Exit(EXIT_USAGE) from None


@_command("convert")
def convert_command(
    src: str = typer.Argument(..., metavar="SRC", help="A checkpoint directory or URL (s3://bucket/run/step_100; credentials "
                                        "from the environment or ~/.aws, as for s3fs)."),
    dst: Path = typer.Argument(..., metavar="DST", help="The output, local: a file (safetensors, torch) or a directory (hf)."),
    to: str = typer.Option(..., "--to", metavar="FORMAT", help="safetensors (one file) | hf (sharded, with index) | torch (torch.save)."),
    max_shard_size: Optional[str] = typer.Option(
        None, "--max-shard-size", metavar="SIZE", help="hf: the most tensor bytes per shard, e.g. 5GB (the default) or 500MB."),
    memory_budget: Optional[str] = typer.Option(
        None, "--memory-budget", metavar="SIZE",
        help="The most tensor bytes held in memory at once, e.g. 2GB (safetensors/hf default: 1GiB; torch: the whole state must fit)."),
    only: Optional[str] = typer.Option(
        None, "--only", metavar="PREFIX", help="Keep the tensors whose key starts with this prefix, without it (e.g. 'model.')."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output (atomically)."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="torch: load pickled values (trusted checkpoints only)."),
    progress: Optional[bool] = typer.Option(
        None, "--progress/--no-progress",
        help=f"Show a progress bar (default: on a terminal, above {human_bytes(PROGRESS_THRESHOLD_BYTES)} of data)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """Convert a checkpoint to one safetensors file, Hugging Face shards or a torch.save file.

    Exit 0 done, 2 refused (the output exists, pickled values), 3 damaged checkpoint (nothing
    written), 4 unreadable."""
    from resurgo.convert import TARGETS, convert as convert_checkpoint

    if to not in TARGETS:
        _error(f"--to must be one of {', '.join(TARGETS)}, not {to!r}")
        raise typer.Exit(EXIT_USAGE)
    shard_bytes = _size_option(max_shard_size, "--max-shard-size")
    budget = _size_option(memory_budget, "--memory-budget")
    with _fail_cleanly():
        total = read_tensor_bytes(src, only)
        show = progress if progress is not None else (
            total > PROGRESS_THRESHOLD_BYTES and _console(stderr=True).is_terminal and not as_json)
        kwargs: dict[str, Any] = dict(to=to, memory_budget=budget, max_shard_bytes=shard_bytes, only=only,
                                      overwrite=overwrite, allow_pickle=allow_pickle)
        if show:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            columns = (TextColumn(f"converting to {to}"), BarColumn(), DownloadColumn(binary_units=True),
                       TransferSpeedColumn(), TimeRemainingColumn())
            with Progress(*columns, console=_console(stderr=True), transient=True) as bar:
                task = bar.add_task("convert", total=total)
                report = convert_checkpoint(src, dst, progress=lambda n: bar.advance(task, n), **kwargs)
        else:
            report = convert_checkpoint(src, dst, **kwargs)
    if as_json:
        _print_json(asdict(report))
        return
    out = _console()
    out.print(f"[bold green]OK[/bold green] {escape(str(src))} -> {escape(str(dst))} ({to}): "
              f"{_plural(report.num_tensors, 'tensor')}, {human_bytes(report.tensor_bytes)} in "
              f"{_plural(len(report.files), 'file')}, {report.seconds['total']:.2f} s", soft_wrap=True)
    err = _console(stderr=True)
    if report.tensors_skipped:
        err.print(f"note: {_plural(len(report.tensors_skipped), 'tensor')} outside --only {only!r} not converted",
                  markup=False, soft_wrap=True)
    if report.raw_dtype_keys:
        err.print(f"note: stored as raw bytes (U8; dtype and shape under __metadata__ 'resurgo.raw_dtypes'): "
                  f"{_clip(', '.join(report.raw_dtype_keys), 400)}", markup=False, soft_wrap=True)
    if report.values_dropped:
        err.print(f"warning: {_plural(len(report.values_dropped), 'non-tensor value')} not kept by {to}: "
                  f"{_clip(', '.join(k or '(root)' for k in report.values_dropped), 400)}", style="yellow",
                  markup=False, soft_wrap=True)


def read_tensor_bytes(src: str | os.PathLike, only: Optional[str]) -> int:
    """Tensor bytes a conversion of ``src`` writes (for the progress bar): from the manifest."""
    manifest, _ = _load_manifest(src)
    return sum(sum(c.nbytes for c in t.chunks) for k, t in manifest.tensors.items()
               if only is None or k.startswith(only))


# -- bench ------------------------------------------------------------------------------------
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds from ``"3600"``, ``"90m"``, ``"24h"`` or ``"7d"``."""
    t = text.strip().lower()
    unit = _DURATION_UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if unit else t) * (unit or 1)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration (examples: 3600, 90m, 24h, 7d)") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"a duration must be positive, got {text!r}")
    return value


def _human_seconds(s: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.1f} {unit}"
    return f"{s:.1f} s"


_BENCH_LABELS = {"save": "resurgo.save (until committed)", "async_stall": "resurgo.async_save: stall",
                 "async_durable": "resurgo.async_save: until committed", "load": "resurgo.load (verified)",
                 "torch_save": "torch.save + fsync (reference)", "torch_load": "torch.load (reference)"}


@_command("bench")
def bench_command(
    location: str = typer.Argument(".", metavar="LOCATION", help="Where to measure: an existing directory (scratch "
                                   "checkpoints go in a new subdirectory, deleted at the end) or a URL."),
    size: str = typer.Option("1GiB", "--size", metavar="SIZE", help="State size (random float32), e.g. 256MiB, 4GiB."),
    tensors: int = typer.Option(16, "--tensors", metavar="N", help="Number of tensors the state is split into."),
    repeats: int = typer.Option(3, "--repeats", metavar="N", help="Repetitions; medians are reported."),
    mtbf: Optional[str] = typer.Option(None, "--mtbf", metavar="DURATION", help="The job's mean time between failures (3600, 90m, 24h, "
                                                            "7d): prints the optimal checkpoint interval (Daly)."),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="Also time torch.save/torch.load "
                                                                            "(local directories only)."),
    create: bool = typer.Option(False, "--create", help="Create LOCATION (and its parents) if it does not exist."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """What a checkpoint costs on this storage (save, async stall, load, against torch.save), and how often to save."""
    nbytes = _size_option(size, "--size")
    try:
        mtbf_seconds = parse_duration(mtbf) if mtbf is not None else None
    except ValueError as e:
        _error(f"--mtbf: {e}")
        raise typer.Exit(EXIT_USAGE) from None
    with _fail_cleanly():
        from resurgo.bench import bench_storage

        report = bench_storage(location, size=nbytes or (1 << 30), tensors=tensors, repeats=repeats,
                               mtbf_seconds=mtbf_seconds, reference=reference, create=create)
    if as_json:
        _print_json(asdict(report))
        return
    out = _console()
    out.print(f"[bold]{human_bytes(report.state_bytes)}[/bold] in {_plural(report.tensors, 'tensor')} at "
              f"{escape(report.location)}, medians of {report.repeats}", soft_wrap=True)
    table = _diff_table("", "median s", "GB/s", "each run s")
    for m, median in report.medians.items():
        rate = report.gb_per_s.get(m)
        table.add_row(_BENCH_LABELS[m], f"{median:.3f}", "-" if rate is None else f"{rate:.2f}",
                      " ".join(f"{x:.3f}" for x in report.seconds[m]))
    out.print(table)
    if "torch_save" in report.medians:
        out.print(f"resurgo.save takes {report.medians['save'] / report.medians['torch_save']:.2f}x torch.save's time; "
                  f"async_save stalls training {report.medians['async_stall'] / report.medians['torch_save']:.2f}x it.",
                  soft_wrap=True)
    if report.mtbf_seconds is not None:
        iv = report.interval_seconds
        out.print(f"With a failure every {_human_seconds(report.mtbf_seconds)} on average, save every "
                  f"{_human_seconds(iv['async_save'])} of training with async_save "
                  f"({_human_seconds(iv['save'])} with save), by Daly's estimate.", soft_wrap=True)


# -- study ------------------------------------------------------------------------------------
def _names(text: Optional[str]) -> Optional[tuple[str, ...]]:
    return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())


def _check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and make sure a file can be written in it (StorageError if not)."""
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise StorageError(f"{directory}: cannot write there ({e.strerror or e}); choose another --out") from None


@_command()
def study(
    quick: bool = typer.Option(False, "--quick", help="Networks at 1/8 width, a few steps: minutes on 2 cores."),
    out: Path = typer.Option(Path("study-results"), "--out", metavar="DIR", help="Directory for report.md, the plots, results.json."),
    data: Optional[Path] = typer.Option(None, "--data", metavar="DIR", help="A local CIFAR-10 python copy (data_batch_1..5) "
                                        "instead of synthetic data."),
    models: Optional[str] = typer.Option(None, "--models", metavar="NAMES", help="Comma-separated: resnet50,vgg16."),
    mechanisms: Optional[str] = typer.Option(None, "--mechanisms", metavar="NAMES", help="Comma-separated, default all: "
                                             "torch_save,dcp,dcp_async,safetensors,resurgo,resurgo_async,"
                                             "resurgo_async_guard."),
    ranks: Optional[str] = typer.Option(None, "--ranks", metavar="COUNTS", help="Comma-separated rank counts for the scale "
                                        "experiment (default 1,2,4; empty to skip it)."),
    width: Optional[int] = typer.Option(None, "--width", metavar="N", help="Channels of the first stage (64 = published)."),
    steps: Optional[int] = typer.Option(None, "--steps", metavar="N", help="Steps per training run (>= 4)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", metavar="N", help="Cost pairs (without, with checkpoints) per "
                                          "mechanism; medians reported (quick: 3, full: 1)."),
    threads: Optional[int] = typer.Option(None, "--threads", metavar="N", help="torch threads of the study process (default 1)."),
) -> None:
    """Reproduce the checkpointing study (cost, formats and sizes, scale, determinism) with ResNet-50
    and VGG-16 on CIFAR-10-shaped data, for torch.save, DCP, safetensors and resurgo."""
    from dataclasses import replace

    from rich.progress import TimeElapsedColumn

    from resurgo.study.experiments import full_config, quick_config, run_study, with_steps
    from resurgo.study.report import REPORT, require_matplotlib, write_outputs

    with _fail_cleanly():
        require_matplotlib()  # before minutes of training, not after
        cfg = quick_config() if quick else full_config()
        chosen_models = _names(models)
        if chosen_models is not None:
            cfg = replace(cfg, models=chosen_models,
                          scale_models=tuple(m for m in cfg.scale_models if m in chosen_models) or chosen_models[:1])
        chosen_mechanisms = _names(mechanisms)
        if chosen_mechanisms is not None:
            cfg = replace(cfg, mechanisms=chosen_mechanisms)
        if ranks is not None:
            try:
                cfg = replace(cfg, scale_worlds=tuple(int(n) for n in _names(ranks) or ()))
            except ValueError:
                raise typer.BadParameter(f"--ranks takes comma-separated integers, got {ranks!r}") from None
        if width is not None:
            cfg = replace(cfg, width=width)
        if threads is not None:
            cfg = replace(cfg, threads=threads)
        if repeats is not None:
            cfg = replace(cfg, cost_repeats=repeats)
        if data is not None:
            cfg = replace(cfg, data_dir=str(data))
        if steps is not None:
            cfg = with_steps(cfg, steps)
        cfg.check()
        if data is not None and not data.is_dir():
            raise CheckpointNotFoundError(f"{data}: no such directory (--data takes a local CIFAR-10 python copy, "
                                          "data_batch_1..5)")
        _check_writable(out)  # before anything is drawn or trained
        console = _console()
        from rich.progress import BarColumn, Progress, TextColumn

        columns = (TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("starting", total=None)

            def on_progress(done: int, total: int, label: str) -> None:
                progress.update(task, completed=done, total=total, description=label)

            results = run_study(cfg, out, on_progress)
        write_outputs(results, out)
    console.print(f"study done in {results['duration_s']:.0f} s: {escape(str(out / REPORT))}")
    for model, det in results["determinism"].items():
        diffs = ", ".join(f"{name} {r['max_abs_diff']:.3g}" for name, r in det["restarts"].items())
        console.print(f"  {model}: largest loss difference after restart: {escape(diffs)}")


def main() -> None:
    """Entry point of the ``resurgo`` script and of ``python -m resurgo``."""
    app(prog_name="resurgo")


if __name__ == "__main__":
    main()
