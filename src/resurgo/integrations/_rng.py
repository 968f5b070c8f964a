"""The RNG part of a framework's checkpoint, set when it is loaded and, once armed, set again
later: a resumed run builds a new data iterator (which draws from the RNG) where the
uninterrupted run kept its own, so the states must be set again after that draw."""

from __future__ import annotations

from collections.abc import Iterable
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


def replay_before_forward(rng: ReplayableRng, modules: Iterable[Any]) -> None:
    """Arm ``rng`` and replay it right before the next forward of any of ``modules`` (a forward
    pre-hook, removed once it has run): where a resumed run has drawn for a new data iterator
    that the uninterrupted run did not build."""
    rng.arm()
    handles: list[Any] = []

    def replay(module: Any, args: Any) -> None:
        rng.replay()
        for handle in handles:
            handle.remove()

    handles.extend(m.register_forward_pre_hook(replay) for m in modules)
