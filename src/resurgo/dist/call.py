"""What the ranks of one collective call must pass alike, and the refusal when they do not.

A collective save or load goes wrong silently when its ranks pass different arguments (one rank
saves ``c3`` while another saves ``c4``: their collectives pair up across two checkpoints). Each
rank therefore carries a small note of the arguments that must match with a message it sends
anyway (the plan gather, the load plan's agreement); whoever holds every rank's note checks them
here before anything is written. No collective of its own: the note rides on existing ones.
"""

from __future__ import annotations

from typing import Any

from resurgo.errors import UnsupportedValueError
from resurgo.wording import on_ranks


def call_note(**values: Any) -> tuple[tuple[str, ...], tuple]:
    """(names, values) of the arguments every rank must pass alike: only the values travel (the
    names are the same code's on every rank), to keep the note small."""
    return tuple(values), tuple(values.values())


def ranks_by_value(values: list[Any]) -> str:
    """``values`` (one per rank, in rank order) as "'a' on ranks 0, 2; 'b' on rank 1"."""
    return on_ranks([repr(v) for v in values])


def check_same(what: str, source: str, names: tuple[str, ...], notes: list[tuple]) -> None:
    """Raise UnsupportedValueError naming each rank's value of every argument that differs between
    the ``notes`` (every rank's values, of the arguments ``names``, from :func:`call_note`) of one
    ``what`` ("save", "load") of ``source``; nothing when they are all equal."""
    if all(n == notes[0] for n in notes[1:]):
        return
    parts = []
    for i, name in enumerate(names):
        values = [n[i] for n in notes]
        if any(v != values[0] for v in values[1:]):
            parts.append(f"{name}: {ranks_by_value(values)}")
    raise UnsupportedValueError(f"{source}: the ranks of one {what} passed different arguments "
                                f"({' | '.join(parts)}); every rank must pass the same value")
