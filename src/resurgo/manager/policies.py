"""When to save: small composable save-decision policies (in the style of Orbax's).

A policy is any object with ``should_save(ctx: SaveContext) -> bool``. Everything a policy may
look at is in the :class:`SaveContext` the manager builds at each ``maybe_save`` call (the step,
the clock, the last save, a pending preemption, the measured save cost), so policies are pure
functions of it and testable without a clock or a disk. ``AnyOf`` / ``AllOf`` combine them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from resurgo.manager.checks import positive_int, positive_seconds
from resurgo.manager.daly import daly_interval


@dataclass(frozen=True)
class SaveContext:
    """What the manager knows when ``maybe_save(state, step)`` is called."""

    step: int
    now: float  # time.monotonic() seconds
    last_save_step: int | None  # the step saved (or restored) last; None before any
    last_save_time: float  # monotonic time the last save returned (or the manager started / restored)
    preempted: bool = False  # a preemption signal arrived (on this rank or, agreed, on any)
    save_cost: float | None = None  # running estimate of one checkpoint's cost δ, seconds; None: unmeasured


@runtime_checkable
class SavePolicy(Protocol):
    def should_save(self, ctx: SaveContext) -> bool: ...


@dataclass(frozen=True)
class EveryNSteps:
    """Save at every multiple of ``n`` (steps 0, n, 2n, ...)."""

    n: int

    def __post_init__(self) -> None:
        positive_int("EveryNSteps.n", self.n)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0


@dataclass(frozen=True)
class EverySeconds:
    """Save once ``seconds`` have passed since the last save (or the start)."""

    seconds: float

    def __post_init__(self) -> None:
        positive_seconds("EverySeconds.seconds", self.seconds)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.now - ctx.last_save_time >= self.seconds


@dataclass(frozen=True)
class AtSteps:
    """Save at the listed steps."""

    steps: frozenset[int]

    def __init__(self, steps: Iterable[int]):
        checked = frozenset(steps)
        for s in checked:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"AtSteps: steps must be ints >= 0, not {s!r}")
        object.__setattr__(self, "steps", checked)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps


@dataclass(frozen=True)
class OnPreemption:
    """Save when a preemption signal arrived. The manager honours preemption whatever its policy;
    this object exists so that composed policies can say it too."""

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.preempted


@dataclass(frozen=True)
class DalyInterval:
    """Save when the compute time since the last save reaches Daly's optimum for the measured
    save cost and ``mtbf_seconds`` (see :func:`resurgo.daly_interval`). Until a save has been
    measured, it says save, so that the first save measures the cost."""

    mtbf_seconds: float

    def __post_init__(self) -> None:
        positive_seconds("DalyInterval.mtbf_seconds", self.mtbf_seconds)

    def interval(self, save_cost: float) -> float:
        return daly_interval(save_cost, self.mtbf_seconds)

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.save_cost is None:
            return True
        return ctx.now - ctx.last_save_time >= self.interval(ctx.save_cost)


@dataclass(frozen=True)
class AnyOf:
    """Save when any of ``policies`` says so."""

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy):
        object.__setattr__(self, "policies", _checked(policies, "AnyOf"))

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)


@dataclass(frozen=True)
class AllOf:
    """Save when every one of ``policies`` says so (e.g. every 100 steps, but at most every 10 min)."""

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy):
        checked = _checked(policies, "AllOf")
        if not checked:
            raise ValueError("AllOf needs at least one policy")
        object.__setattr__(self, "policies", checked)

    def should_save(self, ctx: SaveContext) -> bool:
        return all(p.should_save(ctx) for p in self.policies)


def _checked(policies: tuple, who: str) -> tuple[SavePolicy, ...]:
    for p in policies:
        if not isinstance(p, SavePolicy):
            raise TypeError(f"{who}: {p!r} is not a save policy (it needs should_save(ctx) -> bool)")
    return tuple(policies)
