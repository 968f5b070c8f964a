"""How messages word counts and per-rank values: ``1 rank``, ``2 ranks`` (never ``1 ranks``);
``'a' on ranks 0, 2; 'b' on rank 1``."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1 (``many``: an irregular plural)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def on_ranks(texts: list[str]) -> str:
    """``texts`` (one per rank, in rank order) grouped: "'a' on ranks 0, 2; 'b' on rank 1", in
    the order each text first appears."""
    groups: dict[str, list[int]] = {}
    for rank, text in enumerate(texts):
        groups.setdefault(text, []).append(rank)
    return "; ".join(f"{text} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                     for text, ranks in groups.items())
