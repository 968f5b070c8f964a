"""Counted nouns in messages: ``1 rank``, ``2 ranks`` (never ``1 ranks``)."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1 (``many``: an irregular plural)."""
    return f"{n} {word if n == 1 else many or word + 's'}"
