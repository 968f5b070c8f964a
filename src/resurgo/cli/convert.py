"""``resurgo convert``: a checkpoint to one safetensors file, Hugging Face shards, a torch.save
file, a DCP directory or PEFT adapters (:func:`resurgo.conversion.convert`)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from resurgo.cli.app import EXIT_USAGE, OLD_BUFFER_HELP, buffer_option, fail_cleanly, load_manifest, size_option
from resurgo.cli.render import PROGRESS_THRESHOLD_BYTES, clip, console, error, human_bytes, note, plural, print_json, progress_bar


def convert(
    src: str = typer.Argument(..., metavar="SRC", help="A checkpoint directory or URL (s3://bucket/run/step_100; credentials "
                                        "from the environment or ~/.aws, as for s3fs)."),
    dst: Path = typer.Argument(..., metavar="DST", help="The output, local: a file (safetensors, torch) or a directory (hf, dcp)."),
    to: str = typer.Option(..., "--to", metavar="FORMAT", help="safetensors (one file) | hf (sharded, with index) | torch (torch.save) | dcp (torch.distributed.checkpoint) | peft (the adapters of a PEFT model, as PeftModel.save_pretrained writes them)."),
    max_shard_size: Optional[str] = typer.Option(
        None, "--max-shard-size", metavar="SIZE", help="hf: the most tensor bytes per shard, e.g. 5GB (the default) or 500MB."),
    buffer: Optional[str] = typer.Option(
        None, "--buffer", metavar="SIZE",
        help="The most tensor bytes held in memory at once, e.g. 2GB (safetensors/hf default: 1GiB; torch, dcp: the whole state must fit)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", metavar="SIZE", hidden=True, help=OLD_BUFFER_HELP),
    only: Optional[str] = typer.Option(
        None, "--only", metavar="PREFIX", help="Keep the tensors whose key starts with this prefix, without it (e.g. 'model.'); peft: the key of the adapters' model, where there are several."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output (atomically)."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="torch, dcp: load pickled values (trusted checkpoints only)."),
    allow_expansion: bool = typer.Option(
        False, "--allow-expansion", help="Convert even if the tensors take more than 4 times the distinct bytes "
                                         "stored (chunks sharing bytes); refused otherwise."),
    progress: Optional[bool] = typer.Option(
        None, "--progress/--no-progress",
        help=f"Show a progress bar (default: on a terminal, above {human_bytes(PROGRESS_THRESHOLD_BYTES)} of data)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """Convert a checkpoint to one safetensors file, Hugging Face shards, a torch.save file, a DCP directory or PEFT adapters.

    Exit 0 done, 2 refused (the output exists, pickled values), 3 damaged checkpoint (nothing
    written), 4 unreadable."""
    from resurgo.conversion import TARGETS, convert as convert_checkpoint

    if to not in TARGETS:
        error(f"--to must be one of {', '.join(TARGETS)}, not {to!r}")
        raise typer.Exit(EXIT_USAGE)
    shard_bytes = size_option(max_shard_size, "--max-shard-size")
    budget = buffer_option(buffer, memory_budget)
    with fail_cleanly():
        total = read_tensor_bytes(src, only, adapters=(to == "peft"))
        with progress_bar(f"converting to {to}", total, progress, quiet=as_json) as advance:
            report = convert_checkpoint(src, dst, to=to, buffer_bytes=budget, max_shard_bytes=shard_bytes, only=only,
                                        overwrite=overwrite, allow_pickle=allow_pickle, progress=advance,
                                        allow_expansion=allow_expansion)
    if as_json:
        print_json(asdict(report))
        return
    out = console()
    out.print(f"[bold green]OK[/bold green] {escape(str(src))} -> {escape(str(dst))} ({to}): "
              f"{plural(report.num_tensors, 'tensor')}, {human_bytes(report.tensor_bytes)} in "
              f"{plural(len(report.files), 'file')}, {report.seconds['total']:.2f} s", soft_wrap=True)
    if report.tensors_skipped:
        note(f"note: {plural(len(report.tensors_skipped), 'tensor')} outside --only {only!r} not converted")
    if report.raw_dtype_keys:
        note(f"note: stored as raw bytes (U8; dtype and shape under __metadata__ 'resurgo.raw_dtypes'): "
             f"{clip(', '.join(report.raw_dtype_keys), 400)}")
    if report.values_dropped:
        note(f"warning: {plural(len(report.values_dropped), 'non-tensor value')} not kept by {to}: "
             f"{clip(', '.join(k or '(root)' for k in report.values_dropped), 400)}", style="yellow")


def read_tensor_bytes(src: str | os.PathLike, only: Optional[str], adapters: bool = False) -> int:
    """Tensor bytes a conversion of ``src`` writes (for the progress bar): from the manifest.
    ``adapters``: those of the adapters a conversion to peft writes (under ``only``, if given)."""
    manifest, _ = load_manifest(src)
    if adapters:
        from resurgo.format.adapter import find_adapters

        found = [f for f in find_adapters(manifest.tree) if only is None or f.prefix == only.rstrip(".")]
        keys = {k for f in found[:1] for a in f.adapters.values() for k in a.tensors.values()}
        return sum(sum(c.nbytes for c in manifest.tensors[k].chunks) for k in keys)
    return sum(sum(c.nbytes for c in t.chunks) for k, t in manifest.tensors.items()
               if only is None or k.startswith(only))
