"""The ``resurgo`` command: the typer app, its help layout, ``--version``, the exit codes, and the
registration of one command per module of this package.

Exit codes, the same for every command (:data:`EXIT_CODES` maps errors to them, in one place):
0 success; 1 ``diff`` only: the checkpoints differ; 2 usage: a bad command line or a refused
request; 3 damaged: a checkpoint whose bytes do not match what it declares; 4 unavailable: not
found, not a checkpoint, never committed, or a storage error.

Only typer and rich are imported at module level: torch and the rest of resurgo are imported
inside the commands, so that ``resurgo --help`` starts at once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from resurgo.cli.render import error, note
from resurgo.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ExpansionError,
    ManifestError,
    MemoryBudgetError,
    NotACheckpointError,
    ResurgoError,
    StorageError,
)
from resurgo.version import __version__

if TYPE_CHECKING:
    from resurgo.format.manifest import Manifest

EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE, EXIT_DAMAGED, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4

# Every error a command can end with, and its exit code: the first class that matches wins, so
# the refusals that are also OS errors (FileExistsError) come before OSError.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (CorruptCheckpointError, EXIT_DAMAGED),
    (ManifestError, EXIT_DAMAGED),
    (CheckpointExistsError, EXIT_USAGE),
    (MemoryBudgetError, EXIT_USAGE),
    (ExpansionError, EXIT_USAGE),  # an output many times its input, without --allow-expansion
    (CheckpointNotFoundError, EXIT_UNAVAILABLE),
    (NotACheckpointError, EXIT_UNAVAILABLE),  # and IncompleteCheckpointError
    (StorageError, EXIT_UNAVAILABLE),
    (OSError, EXIT_UNAVAILABLE),
    (ResurgoError, EXIT_USAGE),  # refused: pickled values, foreign files, unsupported values
    (ValueError, EXIT_USAGE),  # arguments that do not fit
)


def exit_code_of(err: BaseException) -> int:
    """The exit code a command ends with when ``err`` stops it (see :data:`EXIT_CODES`)."""
    for cls, code in EXIT_CODES:
        if isinstance(err, cls):
            return code
    raise err


@contextmanager
def fail_cleanly() -> Iterator[None]:
    """An error that stops a command becomes one red line and its exit code, never a traceback."""
    try:
        yield
    except (ResurgoError, OSError, ValueError) as e:
        code = exit_code_of(e)
        if isinstance(e, OSError) and not isinstance(e, ResurgoError):
            error(f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
        else:
            error(str(e))
        raise typer.Exit(code) from None


def size_option(value: Optional[str], what: str) -> Optional[int]:
    """The bytes of a size option (``2GB``, ``512MiB``); exit 2 with a message when it is not one."""
    if value is None:
        return None
    from resurgo.conversion import parse_size

    try:
        return parse_size(value, what)
    except ValueError as e:
        error(str(e))
        raise typer.Exit(EXIT_USAGE) from None


def buffer_option(value: Optional[str], old_value: Optional[str]) -> Optional[int]:
    """The bytes of ``--buffer``, or of ``--memory-budget``, its old name: hidden, it still works
    for one release, with a warning on stderr; both given: exit 2."""
    if old_value is None:
        return size_option(value, "--buffer")
    if value is not None:
        error("--memory-budget is the old name of --buffer; give --buffer only")
        raise typer.Exit(EXIT_USAGE)
    note("warning: --memory-budget is deprecated: use --buffer (the same size); --memory-budget goes in the next "
         "release", style="yellow")
    return size_option(old_value, "--memory-budget")


OLD_BUFFER_HELP = "Deprecated: --buffer."


def load_manifest(path: str | os.PathLike) -> tuple[Manifest, int]:
    """The validated manifest of ``path`` and its size in bytes."""
    from resurgo.pipeline.manifest_read import read_manifest_and_bytes
    from resurgo.storage.open import open_checkpoint

    # a URL: credentials from the environment / ~/.aws (s3fs)
    manifest, raw = read_manifest_and_bytes(open_checkpoint(path))
    return manifest, len(raw)


# -- help layout ------------------------------------------------------------------------------
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


def _version_callback(value: bool) -> None:
    if value:
        print(f"resurgo {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Inspect, verify, list, garbage-collect and convert resurgo checkpoints; run the checkpointing study.

    Exit codes: 0 success, 1 diff found differences, 2 usage error or refused, 3 damaged
    checkpoint, 4 not found, not a checkpoint, incomplete, or storage error."""


def _register() -> None:
    """Each command module holds one function; its name on the command line is given here, in
    the order ``--help`` lists them. (Imported last: those modules use the helpers above.)"""
    from resurgo.cli import bench, convert, diff, gc, import_, inspect, ls, study, verify

    for name, command in (("inspect", inspect.inspect), ("diff", diff.diff), ("verify", verify.verify),
                          ("ls", ls.ls), ("gc", gc.gc), ("convert", convert.convert),
                          ("import", import_.import_), ("bench", bench.bench),
                          ("study", study.study)):
        app.command(name, cls=_Command)(command)


_register()


def main() -> None:
    """Entry point of the ``resurgo`` script and of ``python -m resurgo``."""
    app(prog_name="resurgo")
