"""Summary statistics of the study's repeated timings: spreads, distribution-free intervals for a
median, and overheads from paired runs.

This module owns the arithmetic only (pure functions, no I/O, no torch), so that what the report
shows can be checked on its own. An overhead comes from PAIRS: repetition ``i`` trains once
without and once with checkpoints, back to back, and its difference ``with_i - without_i`` sees
one machine load. The overhead is the median of those differences over the median time without
checkpoints, so a reader can derive the overhead column from the two columns shown beside it.

Intervals are order statistics of the sample, ``[x_(k), x_(n+1-k)]``, which hold the true median
with probability ``1 - 2 P(Binomial(n, 1/2) < k)`` whatever the distribution of the noise (no
normality assumed): the largest ``k`` that keeps that coverage at least 95% is used. With fewer
than 6 values even ``[min, max]`` falls short of 95%; it is then the interval, and the coverage
it does have is reported with it (75% for 3 values).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from math import comb
from typing import Any

from resurgo.errors import StudyError

__all__ = ["spread", "median_interval", "coverage", "paired_overhead", "pair_timings", "LEVEL"]

LEVEL = 0.95


def spread(values: Sequence[float]) -> dict[str, Any]:
    """``{"n", "min", "median", "max"}`` of a non-empty sample."""
    if not values:
        raise StudyError("a timing needs at least one measurement, got none")
    return {"n": len(values), "min": min(values), "median": statistics.median(values), "max": max(values)}


def coverage(n: int, k: int) -> float:
    """Probability that ``[x_(k), x_(n+1-k)]`` of ``n`` values holds their distribution's median."""
    return 1.0 - 2.0 * sum(comb(n, i) for i in range(k)) / 2**n


def median_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """``(low, high, coverage)``: the narrowest order-statistic interval for the median whose
    coverage is at least ``level``, or ``[min, max]`` with its smaller coverage when none is."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise StudyError("an interval needs at least one measurement, got none")
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(n, k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(n, k)


def paired_overhead(without: Sequence[float], with_ckpt: Sequence[float]) -> dict[str, Any]:
    """The overhead of checkpointing from paired runs: ``without[i]`` and ``with_ckpt[i]`` are the
    same repetition, run back to back.

    ``extra_s`` is the median of the paired differences, with its interval; ``overhead_pct`` is
    ``100 * extra_s / median(without)`` and its interval is the extra time's, scaled the same way.
    ``noise`` is True when that interval holds 0: the overhead is not distinguishable from noise.
    """
    if len(without) != len(with_ckpt) or not without:
        raise StudyError(f"paired runs need as many runs without checkpoints as with them, and at least one: "
                         f"got {len(without)} and {len(with_ckpt)}")
    diffs = [w - b for b, w in zip(without, with_ckpt)]
    low, high, cover = median_interval(diffs)
    base = statistics.median(without)
    extra = statistics.median(diffs)
    return {"pairs": len(diffs), "extra_s": extra, "extra_low_s": low, "extra_high_s": high,
            "coverage": cover, "overhead_pct": 100.0 * extra / base, "overhead_low_pct": 100.0 * low / base,
            "overhead_high_pct": 100.0 * high / base, "noise": low <= 0.0 <= high}


def pair_timings(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The summaries of one mechanism's paired runs, each ``{"baseline_s", "seconds", "stall_s",
    ...}``: spreads of both times and of the time blocked per checkpoint, and the paired overhead."""
    without, with_ckpt = [r["baseline_s"] for r in pairs], [r["seconds"] for r in pairs]
    stalls = [s for r in pairs for s in r["stall_s"]]
    return {"repeats": len(pairs), "baseline": spread(without), "with_ckpt": spread(with_ckpt),
            "stall": spread(stalls) if stalls else None, "stall_s": stalls,
            "stall_interval": list(median_interval(stalls)) if stalls else None,
            **paired_overhead(without, with_ckpt), "runs": pairs}
