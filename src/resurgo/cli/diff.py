"""``resurgo diff``: what differs between two checkpoints (step, metadata, tensors, values); the
comparison itself is :func:`resurgo.diff.diff_checkpoints`."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from resurgo.cli.app import EXIT_DIFFERENT, EXIT_OK, OLD_BUFFER_HELP, buffer_option, fail_cleanly
from resurgo.cli.render import clip, console, human_bytes, plural, print_json, render_node, simple_table

if TYPE_CHECKING:
    from resurgo.diff import CheckpointDiff, TensorDiff


def _diff_detail(t: TensorDiff) -> str:
    if t.change in ("only_a", "only_b"):
        return f"only in {t.change[-1].upper()}"
    if t.change != "data":
        return f"{t.change} differs"
    parts = []
    if t.blocks_differing is not None:
        parts.append(f"{t.blocks_differing} of {t.blocks_total} checksum blocks differ")
    if t.elements_differing is not None:
        parts.append(f"{plural(t.elements_differing, 'element')} differ" if t.elements_differing != 1 else "1 element differs")
    if t.max_abs_diff is not None:
        parts.append(f"max |a-b| {t.max_abs_diff:.6g}")
    return ", ".join(parts)


def diff(
    a: str = typer.Argument(..., metavar="A", help="A checkpoint directory or URL."),
    b: str = typer.Argument(..., metavar="B", help="Another checkpoint directory or URL."),
    stats: bool = typer.Option(False, "--stats", help="Read tensors that differ: how many elements, and the largest |a-b|."),
    only: Optional[str] = typer.Option(None, "--only", metavar="PREFIX", help="Compare only the keys with this prefix (e.g. 'model.')."),
    buffer: Optional[str] = typer.Option(None, "--buffer", metavar="SIZE",
                                         help="Memory for tensors read to compare (default 256MiB)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", metavar="SIZE", hidden=True, help=OLD_BUFFER_HELP),
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
    budget = buffer_option(buffer, memory_budget)
    with fail_cleanly():
        from resurgo.diff import DEFAULT_DIFF_BUDGET, diff_checkpoints

        found = diff_checkpoints(a, b, stats=stats, only=only, buffer_bytes=budget or DEFAULT_DIFF_BUDGET,
                                 verify=verify, include_save_info=save_info)
    if as_json:
        doc = asdict(found)
        doc["identical"] = found.identical
        doc["fields"] = [{"field": f, "a": x, "b": y} for f, x, y in found.fields]
        print_json(doc)
    else:
        _print_diff(found)
    raise typer.Exit(EXIT_OK if found.identical else EXIT_DIFFERENT)


def _print_diff(d: CheckpointDiff) -> None:
    out = console()
    out.print(f"[bold]A[/bold] {escape(d.a)}\n[bold]B[/bold] {escape(d.b)}", soft_wrap=True)
    if d.fields:
        table = simple_table("field", "A", "B")
        for name, x, y in d.fields:
            table.add_row(escape(name), escape(clip(json.dumps(x))), escape(clip(json.dumps(y))))
        out.print(table)
    if d.tensors:
        table = simple_table("tensor", "A", "B", "difference")
        for t in d.tensors:
            table.add_row(escape(t.key), t.a or "-", t.b or "-", escape(_diff_detail(t)))
        out.print(table)
    if d.values:
        table = simple_table("value", "A", "B")
        for v in d.values:
            table.add_row(escape(v.key), escape(render_node(v.a)), escape(render_node(v.b)))
        out.print(table)
    equal = (f"{plural(d.equal_by_checksums + d.equal_by_data, 'tensor')} equal "
             f"({d.equal_by_checksums} by checksums, {d.equal_by_data} by reading); {human_bytes(d.bytes_read)} read")
    if d.verified:
        equal += f"; both verified ({human_bytes(d.bytes_verified)})"
    if d.identical:
        out.print(f"[bold green]SAME[/bold green] {equal}", soft_wrap=True)
    else:
        out.print(f"[bold red]DIFFERENT[/bold red] {plural(len(d.fields), 'field')}, "
                  f"{plural(len(d.tensors), 'tensor')}, {plural(len(d.values), 'value')} differ; {equal}",
                  soft_wrap=True)
