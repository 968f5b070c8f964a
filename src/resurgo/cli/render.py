"""How the command line shows things: consoles, errors on stderr, JSON, sizes, durations, times,
clipped text, tables of checkpoints, progress bars, and the manifest tree's non-tensor values.

Only rich is imported at module level (``resurgo --help`` must not import torch); the rest of
resurgo is imported where it is needed.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Optional

from rich import box
from rich.console import Console
from rich.table import Table

from resurgo.errors import ResurgoError
from resurgo.wording import plural  # re-exported: the commands count their nouns through render

PROGRESS_THRESHOLD_BYTES = 64 << 20  # verify and convert show a progress bar above this much tensor data
MAX_VALUE_CHARS = 72  # non-tensor values are clipped to this many characters

STATUS_STYLE = {"committed": "green", "incomplete": "yellow", "temporary": "yellow", "corrupt": "bold red"}


def console(stderr: bool = False) -> Console:
    """A console on the current stdout/stderr; not squeezed to 80 columns when piped."""
    out = Console(stderr=stderr, highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, highlight=False, width=200)
    return out


def error(message: str) -> None:
    """``error: message`` in red on stderr."""
    console(stderr=True).print(f"error: {message}", style="bold red", markup=False, soft_wrap=True)


def note(message: str, style: Optional[str] = None) -> None:
    """A line on stderr, printed as it is (no markup)."""
    console(stderr=True).print(message, style=style, markup=False, soft_wrap=True)


def print_json(doc: Any) -> None:
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


def human_seconds(s: float) -> str:
    """``42.0 s``, ``1.5 min``, ``2.0 h``, ``7.0 d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.1f} {unit}"
    return f"{s:.1f} s"


def clip(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def format_time(iso: Optional[str]) -> str:
    """An ISO timestamp as ``YYYY-MM-DD HH:MM:SS`` UTC; unparsable ones as they are."""
    if not iso:
        return "-"
    try:
        t = datetime.fromisoformat(iso)
    except ValueError:
        return clip(iso, 40)
    if t.tzinfo is not None:
        t = t.astimezone(timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def format_metrics(metrics: dict) -> str:
    return ", ".join(f"{k}={'-' if v is None else format(v, '.6g') if isinstance(v, (int, float)) else v}"
                     for k, v in metrics.items())


def simple_table(*columns: str) -> Table:
    """A table with a header rule and the given columns, each folding long text."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for name in columns:
        table.add_column(name, overflow="fold")
    return table


def listing_table(columns: list[str], note_column: str) -> Table:
    """A table of checkpoints: path, step, size, then ``columns``, then a dim note column."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("path", overflow="fold")
    table.add_column("step", justify="right")
    table.add_column("size", justify="right")
    for name in columns:
        table.add_column(name, overflow="fold")
    table.add_column(note_column, overflow="fold", style="dim")
    return table


@contextmanager
def progress_bar(label: str, total: int, wanted: Optional[bool], quiet: bool = False
                 ) -> Iterator[Optional[Callable[[int], None]]]:
    """A transient transfer bar on stderr while the block runs; yields the callback that advances
    it by a number of bytes, or None when no bar is shown. ``wanted``: the --progress option;
    unset, a bar is shown on a terminal above :data:`PROGRESS_THRESHOLD_BYTES` unless ``quiet``."""
    err = console(stderr=True)
    show = wanted if wanted is not None else total > PROGRESS_THRESHOLD_BYTES and err.is_terminal and not quiet
    if not show:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn(label), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


# -- the tree's non-tensor values, decoded without reading data or unpickling ------------------
EMPTY = {"dict": "{}", "ordered_dict": "OrderedDict()", "list": "[]", "tuple": "()"}


def render_scalar(node: dict) -> str:
    """A short readable form of one tagged scalar node; pickled values are never loaded."""
    from resurgo.format import values

    t = node.get("type")
    if t == "pickle":
        return f"<pickled {clip(str(node.get('class')), 100)}>"
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
        return clip(repr(v))
    except ValueError:  # an int too long for str() (sys.set_int_max_str_digits)
        return f"<int of {v.bit_length()} bits>"


def render_node(node: Optional[dict]) -> str:
    """A value node of the tree in one short line; ``-`` for an absent one."""
    if node is None:
        return "-"
    t = node.get("type")
    if t in EMPTY:
        return EMPTY[t]
    if t == "torch_size":
        return clip(f"torch.Size({node.get('items')!r})")
    return render_scalar(node)


def _scalar_sequence(node: dict) -> bool:
    from resurgo.format import values

    return node["type"] in ("list", "tuple") and all(n["type"] in values.SCALAR_TYPES for n in node["items"])


def tree_values(tree: dict) -> list[tuple[str, str, str]]:
    """(key, type, short text) of every non-tensor leaf of a validated manifest tree, in tree order.

    Keys are made as tensor keys are (:mod:`resurgo.format.tree`). A list or tuple of scalars is
    shown on one line; empty containers appear as ``{}``/``[]``.
    """
    from resurgo.format.tree import iter_values

    out = []
    for leaf in iter_values(tree, whole=_scalar_sequence):
        node, t = leaf.node, leaf.node["type"]
        if t in ("list", "tuple") and node["items"]:
            inner = ", ".join(render_scalar(n) for n in node["items"])
            text = clip(f"({inner},)" if t == "tuple" and len(node["items"]) == 1
                        else f"({inner})" if t == "tuple" else f"[{inner}]")
        else:
            text = render_node(node)
        out.append((leaf.key, t, text))
    return out
