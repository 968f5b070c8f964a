"""The RNG part of a framework's checkpoint, set when it is loaded and, once armed, set again
later: a resumed run builds a new data iterator (which draws from the RNG) where the
uninterrupted run kept its own, so the states must be set again after that draw."""

from __future__ import annotations

from typing import Any

from resurgo.state.per_rank import PerRank
from resurgo.state.rng import RNGState, restore_rng_state


class ReplayableRng:
    """A Stateful: ``state_dict()`` captures this process's RNG states (per rank, as RNGState);
    ``load_state_dict`` sets them and keeps them; after ``arm()``, the first ``replay()`` sets
    them once more."""

    def __init__(self) -> None:
        self._saved: dict[str, Any] | None = None
        self._armed = False

    def state_dict(self) -> PerRank:
        return RNGState().state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        RNGState().load_state_dict(state_dict)
        self._saved = state_dict.value if isinstance(state_dict, PerRank) else state_dict

    def arm(self) -> None:
        self._armed = self._saved is not None

    def replay(self) -> None:
        if self._armed and self._saved is not None:
            restore_rng_state(self._saved)
            self._armed = False
