"""``resurgo verify``: check every data file's size, header and block checksums."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from resurgo.cli.app import EXIT_DAMAGED, EXIT_OK, fail_cleanly, load_manifest
from resurgo.cli.render import PROGRESS_THRESHOLD_BYTES, console, human_bytes, plural, print_json, progress_bar
from resurgo.errors import CorruptCheckpointError, ManifestError

if TYPE_CHECKING:
    from resurgo.format.manifest import Manifest


def verify(
    path: str = typer.Argument(..., metavar="PATH", help="A checkpoint directory or URL (s3://bucket/run/step_100)."),
    progress: Optional[bool] = typer.Option(
        None, "--progress/--no-progress",
        help=f"Show a progress bar (default: on a terminal, above {human_bytes(PROGRESS_THRESHOLD_BYTES)} of data).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """Check every file size, header and block checksum. Exit 0 clean, 3 damaged, 4 unreadable."""
    from resurgo.pipeline.verify import VerifyReport, verify_checkpoint

    with fail_cleanly():
        manifest: Manifest | None
        try:
            manifest = load_manifest(path)[0]
        except (CorruptCheckpointError, ManifestError) as e:  # an edited or broken manifest: damaged
            manifest, report, seconds = None, VerifyReport(str(path), problems=[str(e)]), 0.0
        if manifest is not None:
            t0 = time.perf_counter()
            with progress_bar("verifying", manifest.tensor_bytes, progress, quiet=as_json) as advance:
                report = verify_checkpoint(path, progress=advance)
            seconds = time.perf_counter() - t0
    n_files = len(manifest.files) + len(manifest.references) if manifest else 0  # referenced files are read too
    if as_json:
        print_json({"path": str(path), "ok": report.ok, "tensor_bytes": manifest.tensor_bytes if manifest else None,
                     "bytes_checked": report.bytes_checked, "chunks_checked": report.chunks_checked,
                     "data_files": n_files if manifest else None, "problems": report.problems})
    else:
        out = console()
        for p in report.problems:
            out.print(f"  - {p}", style="red", markup=False, soft_wrap=True)
        counts = (f"{plural(report.chunks_checked, 'chunk')} in {plural(n_files, 'file')}, "
                  f"{human_bytes(report.bytes_checked)} checked in {seconds:.2f} s")
        if report.ok:
            out.print(f"[bold green]OK[/bold green] {escape(str(path))}: {counts}", soft_wrap=True)
        else:
            out.print(f"[bold red]CORRUPT[/bold red] {escape(str(path))}: {plural(len(report.problems), 'problem')} "
                      f"({counts})", soft_wrap=True)
    raise typer.Exit(EXIT_OK if report.ok else EXIT_DAMAGED)
