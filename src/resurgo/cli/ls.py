"""``resurgo ls``: every checkpoint at or below a directory or URL prefix
(:func:`resurgo.manager.catalog.list_checkpoints`), as a table or JSON."""

from __future__ import annotations

import typer
from rich.markup import escape

from resurgo.cli.app import EXIT_DAMAGED, EXIT_OK, fail_cleanly
from resurgo.cli.render import STATUS_STYLE, clip, console, format_metrics, format_time, human_bytes, listing_table, print_json


def ls(
    directory: str = typer.Argument(".", metavar="DIRECTORY", help="The directory or URL prefix to search (recursively)."),
    verify_all: bool = typer.Option(False, "--verify", help="Also verify every checksum of committed checkpoints."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable list."),
) -> None:
    """Every checkpoint at or below DIRECTORY: path, step, size, creation time, status and metrics.

    Exit 0, or 3 when a checkpoint is damaged (its manifest does not verify, or a data file has
    another size; with --verify, also a block that does not match its checksum).
    """
    with fail_cleanly():
        from resurgo.manager.catalog import COMMITTED, CORRUPT, list_checkpoints

        entries = list_checkpoints(directory, verify=verify_all)
    exit_code = EXIT_DAMAGED if any(e.status == CORRUPT for e in entries) else EXIT_OK
    if as_json:
        docs = [{"path": e.path.as_posix(), "status": e.status, "step": e.step, "bytes": e.nbytes,
                 "created_at": e.created_at, "detail": e.detail, "metrics": e.metrics} for e in entries]
        if verify_all:
            for doc in docs:
                doc["verified"] = doc["status"] == COMMITTED
        print_json({"root": str(directory), "checkpoints": docs})
        raise typer.Exit(exit_code)
    out = console()
    if not entries:
        out.print(f"no checkpoints at or below {escape(str(directory))}")
        return
    show_metrics = any(e.metrics for e in entries)  # checkpoints of a CheckpointManager
    table = listing_table(["created (UTC)", "status"] + (["metrics"] if show_metrics else []), "detail")
    for e in entries:
        status = e.status + (" (verified)" if verify_all and e.status == COMMITTED else "")
        metrics = [escape(clip(format_metrics(e.metrics), 80))] if show_metrics else []
        table.add_row(escape(e.path.as_posix()), "-" if e.step is None else str(e.step), human_bytes(e.nbytes),
                      format_time(e.created_at), f"[{STATUS_STYLE[e.status]}]{status}[/]", *metrics,
                      escape(clip(e.detail, 160)))
    out.print(table)
    raise typer.Exit(exit_code)
