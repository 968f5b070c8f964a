"""``resurgo import``: a DCP directory, a Hugging Face directory, a torch.save file or a spec
applied to any files, as a resurgo checkpoint (:func:`resurgo.interop.api.import_checkpoint`);
``--emit-spec`` writes the spec an importer produces instead, as a starting point to edit."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from resurgo.cli.app import EXIT_USAGE, OLD_BUFFER_HELP, buffer_option, fail_cleanly
from resurgo.cli.render import console, error, human_bytes, plural, print_json

FROM = ("dcp", "hf", "peft", "torch", "spec", "deepspeed", "megatron")


def import_(
    src: str = typer.Argument(..., metavar="SRC", help="dcp: a torch.distributed.checkpoint directory; deepspeed: a DeepSpeed checkpoint directory; megatron: a Megatron-LM checkpoint directory; hf: a model directory; peft: a PEFT adapter folder; torch: a torch.save file; "
                                                         "spec: the directory the spec's file names are relative to."),
    dst: Optional[str] = typer.Argument(None, metavar="DST", help="The new checkpoint (must not exist)."),
    source: str = typer.Option(..., "--from", metavar="FORMAT", help="dcp | deepspeed | megatron | hf | peft | torch | spec."),
    spec: Optional[Path] = typer.Option(None, "--spec", metavar="FILE", help="A spec JSON file (needed with --from spec)."),
    emit_spec: Optional[Path] = typer.Option(
        None, "--emit-spec", metavar="FILE", help="Write the spec the importer produces to FILE and import nothing."),
    buffer: Optional[str] = typer.Option(
        None, "--buffer", metavar="SIZE", help="The most bytes of buffers held at once, e.g. 2GB (default 1GiB)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", metavar="SIZE", hidden=True, help=OLD_BUFFER_HELP),
    allow_pickle: bool = typer.Option(
        False, "--allow-pickle", help="Also import items that only full unpickling builds (runs the source's code: "
                                      "trusted sources only)."),
    only: Optional[list[str]] = typer.Option(
        None, "--only", metavar="PATTERN", help="Import only the keys matching PATTERN: a glob ('model.*') or a key "
                                                "prefix ('model'); repeat for several. A pattern matching nothing is refused."),
    allow_expansion: bool = typer.Option(
        False, "--allow-expansion", help="Write tensors larger than 4 times the source files they are read from "
                                         "(stride-0 tensors); refused otherwise."),
    in_place: bool = typer.Option(
        False, "--in-place", help="Copy no tensor bytes that lie contiguous in the source: the checkpoint points into "
                                  "its files, which must then stay where they are, unchanged. Tensors that cannot "
                                  "be referenced are copied and listed."),
    vocab_size: Optional[int] = typer.Option(
        None, "--vocab-size", metavar="N", help="megatron, deepspeed (tensor-parallel): the true vocabulary size; "
                                                "the padding rows of the word embeddings and output layer are dropped."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable report."),
) -> None:
    """Import a foreign checkpoint (DCP, DeepSpeed ZeRO, Megatron-LM, Hugging Face, PEFT adapters, torch.save, or any files a spec describes).

    Exit 0 done, 2 refused (bad spec, DST exists, pickled code), 3 damaged source (truncated
    file, replicas that differ), 4 source not found."""
    if source not in FROM:
        error(f"--from must be one of {', '.join(FROM)}, not {source!r}")
        raise typer.Exit(EXIT_USAGE)
    if source == "spec" and spec is None:
        error("--from spec needs --spec FILE")
        raise typer.Exit(EXIT_USAGE)
    if (dst is None) == (emit_spec is None):
        error("give DST to import, or --emit-spec FILE to write the spec only")
        raise typer.Exit(EXIT_USAGE)
    budget = buffer_option(buffer, memory_budget)
    from resurgo.interop import spec as spec_lang
    from resurgo.interop.api import import_checkpoint, select, spec_of

    with fail_cleanly():
        if emit_spec is not None:
            produced, _ = spec_of(src, source, vocab_size)
            if only:
                produced = select(produced, only)
            if emit_spec.exists():
                from resurgo.errors import CheckpointExistsError

                raise CheckpointExistsError(f"{emit_spec}: exists; choose another file for --emit-spec")
            emit_spec.write_text(spec_lang.dumps(produced))
            console().print(f"spec of {escape(src)} ({plural(len(produced.tensors), 'tensor')}) written to "
                            f"{escape(str(emit_spec))}", soft_wrap=True)
            return
        assert dst is not None
        report = import_checkpoint(src, dst, source=source, spec=spec, buffer_bytes=budget, allow_pickle=allow_pickle,
                                    only=only or None, allow_expansion=allow_expansion, in_place=in_place,
                                    vocab_size=vocab_size)
    if as_json:
        print_json(asdict(report))
        return
    console().print(f"[bold green]OK[/bold green] {escape(src)} -> {escape(dst)} ({source}): "
                    f"{plural(report.num_tensors, 'tensor')}, {human_bytes(report.tensor_bytes)}, "
                    f"{plural(report.num_values, 'value')}, {report.seconds['total']:.2f} s", soft_wrap=True)
    if in_place:
        console().print(f"in place: {human_bytes(report.in_place_bytes)} referenced in the source files, "
                        f"{human_bytes(report.bytes_written)} written", soft_wrap=True)
        for key, why in sorted(report.copied.items()):
            console().print(f"  copied {escape(key)}: {escape(why)}", soft_wrap=True)
