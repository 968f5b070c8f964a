"""The optimal checkpoint interval: Daly's higher-order estimate.

J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22 (2006): with δ the time one checkpoint costs the job and M
the mean time between failures, the compute time between checkpoints that minimises the expected
total run time is

    τ = √(2δM) · [1 + ⅓·√(δ/2M) + ⅑·(δ/2M)] − δ     for δ < 2M,
    τ = M                                            otherwise.

Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math


def daly_interval(cost_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of compute between checkpoints that minimise the expected run time.

    ``cost_seconds`` (δ): what one checkpoint costs the job (the stall of an asynchronous save,
    the whole of a synchronous one). ``mtbf_seconds`` (M): the mean time between failures.
    """
    for name, value in (("cost_seconds", cost_seconds), ("mtbf_seconds", mtbf_seconds)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
    if cost_seconds < 0:
        raise ValueError(f"cost_seconds must be >= 0, not {cost_seconds!r}")
    if mtbf_seconds <= 0:
        raise ValueError(f"mtbf_seconds must be > 0, not {mtbf_seconds!r}")
    if cost_seconds >= 2 * mtbf_seconds:
        return float(mtbf_seconds)
    ratio = cost_seconds / (2 * mtbf_seconds)
    return math.sqrt(2 * cost_seconds * mtbf_seconds) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_seconds
