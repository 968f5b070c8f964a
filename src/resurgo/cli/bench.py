"""``resurgo bench``: what a checkpoint costs on a given storage, and how often to save (Daly)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import typer
from rich.markup import escape

from resurgo.cli.app import EXIT_USAGE, fail_cleanly, size_option
from resurgo.cli.render import console, error, human_bytes, human_seconds, plural, print_json, simple_table


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


_BENCH_LABELS = {"save": "resurgo.save (until committed)", "async_stall": "resurgo.async_save: stall",
                 "async_durable": "resurgo.async_save: until committed", "load": "resurgo.load (verified)",
                 "torch_save": "torch.save + fsync (reference)", "torch_load": "torch.load (reference)"}


def bench(
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
    nbytes = size_option(size, "--size")
    try:
        mtbf_seconds = parse_duration(mtbf) if mtbf is not None else None
    except ValueError as e:
        error(f"--mtbf: {e}")
        raise typer.Exit(EXIT_USAGE) from None
    with fail_cleanly():
        from resurgo.bench import bench_storage

        report = bench_storage(location, size=nbytes or (1 << 30), tensors=tensors, repeats=repeats,
                               mtbf_seconds=mtbf_seconds, reference=reference, create=create)
    if as_json:
        print_json(asdict(report))
        return
    out = console()
    out.print(f"[bold]{human_bytes(report.state_bytes)}[/bold] in {plural(report.tensors, 'tensor')} at "
              f"{escape(report.location)}, medians of {report.repeats}", soft_wrap=True)
    table = simple_table("", "median s", "GB/s", "each run s")
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
        out.print(f"With a failure every {human_seconds(report.mtbf_seconds)} on average, save every "
                  f"{human_seconds(iv['async_save'])} of training with async_save "
                  f"({human_seconds(iv['save'])} with save), by Daly's estimate.", soft_wrap=True)
