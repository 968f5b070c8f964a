"""``resurgo gc``: delete what a manager root's retention rules do not keep
(:func:`resurgo.manager.gc.run_gc`), and show the plan."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape

from resurgo.cli.app import EXIT_DAMAGED, EXIT_OK, fail_cleanly
from resurgo.cli.render import STATUS_STYLE, console, human_bytes, listing_table, note, print_json


def _parse_keep_best(text: str) -> tuple:
    """``loss:min`` -> ("loss", "min"); ``acc:max:3`` -> ("acc", "max", 3)."""
    parts = text.rsplit(":", 2) if text.count(":") >= 2 else text.rsplit(":", 1)
    if len(parts) == 3 and parts[2].isdigit():
        return parts[0], parts[1], int(parts[2])
    if len(parts) == 2 and parts[0] and parts[1] in ("min", "max"):
        return parts[0], parts[1]
    raise typer.BadParameter(f"expected METRIC:min or METRIC:max (optionally :K), got {text!r}",
                             param_hint="--keep-best")


def gc(
    root: str = typer.Argument(..., metavar="ROOT",
                               help="A CheckpointManager root, or any directory or URL of step_<digits> checkpoints."),
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
    with fail_cleanly():
        from resurgo.manager.catalog import CORRUPT
        from resurgo.manager.gc import DELETE, run_gc

        run = run_gc(root, keep_last=keep_last, keep_every=keep_every, keep_best=best, no_keep_best=no_keep_best,
                     ignore_recorded=ignore_recorded, stale_after=stale_after, dry_run=dry_run)
    for refusal in run.refused:
        note(f"warning: {refusal}")
    exit_code = EXIT_DAMAGED if any(item.entry.status == CORRUPT for item in run.plan) else EXIT_OK
    freed = sum(item.nbytes for item in run.deleted)
    verb = "would delete" if dry_run else "deleted"
    if as_json:
        print_json({"root": str(root), "dry_run": dry_run, "bytes_freed": 0 if dry_run else freed,
                    "retention": {"rules": run.rules, "source": run.source}, "items": [
            {"path": item.entry.path.name, "step": item.entry.step, "status": item.entry.status,
             "action": item.action, "bytes": item.nbytes, "reason": item.reason} for item in run.plan]})
        raise typer.Exit(exit_code)
    out = console()
    if not run.plan:
        out.print(f"no checkpoints in {escape(str(root))}")
        return
    out.print(f"retention: {escape(run.rules)} ({escape(run.source)})", soft_wrap=True)
    table = listing_table(["status", "action"], "why")
    for item in run.plan:
        e = item.entry
        action = verb if item.action == DELETE else "keep"
        table.add_row(escape(e.path.name), "-" if e.step is None else str(e.step), human_bytes(item.nbytes),
                      f"[{STATUS_STYLE[e.status]}]{e.status}[/]",
                      f"[bold red]{action}[/]" if item.action == DELETE else action, escape(item.reason))
    out.print(table)
    out.print(f"{verb} {len(run.deleted)} of {len(run.plan)}, {human_bytes(freed)}"
              + (" (dry run: nothing was deleted)" if dry_run else ""))
    raise typer.Exit(exit_code)
