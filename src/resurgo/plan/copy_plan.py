"""Copy plan: which rank copies (and verifies) which data files of a checkpoint. Pure data."""

from __future__ import annotations

import heapq


def assign_files(files: list[tuple[str, int]], ranks: int) -> list[list[str]]:
    """Each rank's share of ``(name, size)`` files: largest first, to the rank with the fewest bytes
    so far (ties to the lowest rank), so no rank gets more than the average plus one file. Each
    share is sorted by name. Deterministic: every rank computes the same shares."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, not {ranks}")
    loads = [(0, r) for r in range(ranks)]
    shares: list[list[str]] = [[] for _ in range(ranks)]
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        load, r = heapq.heappop(loads)
        shares[r].append(name)
        heapq.heappush(loads, (load + size, r))
    return [sorted(share) for share in shares]
