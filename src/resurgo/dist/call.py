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


def call_note(**values: Any) -> tuple[tuple[str, Any], ...]:
    """This rank's note: the (name, value) pairs every rank must pass alike (small, picklable)."""
    return tuple(values.items())


def ranks_by_value(values: list[Any]) -> str:
    """``values`` (one per rank, in rank order) as "'a' on ranks 0, 2; 'b' on rank 1"."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), []).append(rank)
    return "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                     for value, ranks in groups.items())


def check_same(what: str, source: str, notes: list[tuple[tuple[str, Any], ...]]) -> None:
    """Raise UnsupportedValueError naming each rank's value of every argument that differs between
    the ``notes`` (one per rank, from :func:`call_note`) of one ``what`` ("save", "load") of
    ``source``; nothing when they are all equal."""
    if all(n == notes[0] for n in notes[1:]):
        return
    parts = []
    for name, _ in notes[0]:
        values = [dict(n).get(name) for n in notes]
        if any(v != values[0] for v in values[1:]):
            parts.append(f"{name}: {ranks_by_value(values)}")
    raise UnsupportedValueError(f"{source}: the ranks of one {what} passed different arguments "
                                f"({' | '.join(parts)}); every rank must pass the same value")
