"""Pure logic of the manager: Daly's interval, save-decision policies, retention, the gc plan."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import resurgo
from resurgo.manager import (
    AllOf,
    AnyOf,
    AtSteps,
    DalyInterval,
    EveryNSteps,
    EverySeconds,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    Kept,
    OnPreemption,
    SaveContext,
    steps_to_delete,
)
from resurgo.manager.catalog import COMMITTED, CORRUPT, INCOMPLETE, TEMPORARY, Entry, checkpoint_name, step_of
from resurgo.manager.gc import DELETE, KEEP, plan_gc
from resurgo.manager.retention import shortcut_policy


# -- Daly ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mtbf_minutes, expected_minutes", [(24 * 60, 116.69), (6 * 60, 56.71), (15, 9.14)])
def test_daly_reproduces_the_published_cases(mtbf_minutes, expected_minutes):
    # Daly (2006), delta = 5 minutes; the formula is unit-free, so minutes in, minutes out, and
    # seconds in, seconds out must agree.
    assert resurgo.daly_interval(5, mtbf_minutes) == pytest.approx(expected_minutes, abs=0.05)
    assert resurgo.daly_interval(5 * 60, mtbf_minutes * 60) / 60 == pytest.approx(expected_minutes, abs=0.05)


def test_daly_at_and_beyond_twice_the_mtbf_is_the_mtbf():
    assert resurgo.daly_interval(20.0, 10.0) == 10.0
    assert resurgo.daly_interval(100.0, 10.0) == 10.0
    assert resurgo.daly_interval(0.0, 50.0) == 0.0
    # just below 2M the formula still applies: 2M * (1 + 1/3 + 1/9) - 2M = 8M/9
    assert resurgo.daly_interval(2 * 10.0 - 1e-9, 10.0) == pytest.approx(80 / 9, rel=1e-6)


@given(st.floats(1e-3, 1e4), st.floats(1.0, 1e7))
def test_daly_is_positive_and_grows_with_the_mtbf(cost, mtbf):
    tau = resurgo.daly_interval(cost, mtbf)
    assert tau > 0
    assert resurgo.daly_interval(cost, mtbf * 2) >= tau
    if cost < 2 * mtbf:
        assert tau >= math.sqrt(2 * cost * mtbf) - cost  # the first-order (Young) term is a lower bound


@pytest.mark.parametrize("cost, mtbf, message", [
    (-1, 10, "cost_seconds must be >= 0"), (1, 0, "mtbf_seconds must be > 0"),
    (float("nan"), 10, "cost_seconds must be a finite"), (1, float("inf"), "mtbf_seconds must be a finite"),
    (True, 10, "cost_seconds must be a finite"), ("1", 10, "cost_seconds must be a finite"),
])
def test_daly_refuses_bad_input(cost, mtbf, message):
    with pytest.raises(ValueError, match=message):
        resurgo.daly_interval(cost, mtbf)


# -- save policies ---------------------------------------------------------------------------------
def ctx(step=0, now=100.0, last_step=None, last_time=0.0, preempted=False, cost=None) -> SaveContext:
    return SaveContext(step=step, now=now, last_save_step=last_step, last_save_time=last_time,
                       preempted=preempted, save_cost=cost)


def test_every_n_steps():
    p = EveryNSteps(5)
    assert [s for s in range(0, 21) if p.should_save(ctx(step=s))] == [0, 5, 10, 15, 20]


def test_every_seconds_counts_from_the_last_save():
    p = EverySeconds(60)
    assert not p.should_save(ctx(now=159.9, last_time=100.0))
    assert p.should_save(ctx(now=160.0, last_time=100.0))


def test_at_steps_and_on_preemption():
    assert [s for s in range(10) if AtSteps([2, 7]).should_save(ctx(step=s))] == [2, 7]
    assert OnPreemption().should_save(ctx(preempted=True))
    assert not OnPreemption().should_save(ctx(preempted=False))


def test_daly_policy_saves_first_to_measure_then_at_the_optimal_interval():
    p = DalyInterval(mtbf_seconds=6 * 3600)
    assert p.should_save(ctx(cost=None))  # unmeasured: the first save measures the cost
    tau = resurgo.daly_interval(300.0, 6 * 3600)
    assert tau / 60 == pytest.approx(56.71, abs=0.05)
    assert not p.should_save(ctx(now=1000.0 + tau - 0.5, last_time=1000.0, cost=300.0))
    assert p.should_save(ctx(now=1000.0 + tau, last_time=1000.0, cost=300.0))


def test_composition():
    every5, after_60s = EveryNSteps(5), EverySeconds(60)
    either, both = AnyOf(every5, after_60s), AllOf(every5, after_60s)
    assert either.should_save(ctx(step=5, now=10, last_time=0))
    assert either.should_save(ctx(step=3, now=70, last_time=0))
    assert not either.should_save(ctx(step=3, now=10, last_time=0))
    assert both.should_save(ctx(step=5, now=70, last_time=0))
    assert not both.should_save(ctx(step=5, now=10, last_time=0))
    assert not AnyOf().should_save(ctx(step=0))


@pytest.mark.parametrize("make, message", [
    (lambda: EveryNSteps(0), "EveryNSteps.n must be a positive int"),
    (lambda: EveryNSteps(2.5), "EveryNSteps.n must be a positive int"),
    (lambda: EverySeconds(-1), "EverySeconds.seconds must be a positive finite"),
    (lambda: AtSteps([-1]), "AtSteps: steps must be ints >= 0"),
    (lambda: DalyInterval(0), "DalyInterval.mtbf_seconds must be a positive"),
    (lambda: AllOf(), "AllOf needs at least one policy"),
    (lambda: KeepLast(0), "KeepLast.n must be a positive int, not 0"),
    (lambda: KeepEvery(True), "KeepEvery.n must be a positive int, not True"),
])
def test_policies_refuse_bad_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_composition_refuses_what_is_not_a_policy():
    with pytest.raises(TypeError, match="is not a save policy"):
        AnyOf(EveryNSteps(2), 5)  # type: ignore[arg-type]


# -- retention -------------------------------------------------------------------------------------
def kept(*steps, metrics=None):
    return [Kept(s, (metrics or {}).get(s, {})) for s in steps]


def test_keep_last_keeps_the_newest_by_step_whatever_the_order():
    assert KeepLast(2).keep(kept(30, 10, 40, 20)) == {30, 40}
    assert steps_to_delete(kept(10, 20, 30, 40), KeepLast(2)) == [10, 20]
    assert steps_to_delete(kept(10), KeepLast(3)) == []


def test_keep_every_and_composition():
    policy = KeepAny(KeepLast(1), KeepEvery(100))
    assert steps_to_delete(kept(50, 100, 150, 200, 250), policy) == [50, 150]
    assert str(policy) == "keep_last 1 or keep_every 100"
    assert policy.to_spec() == {"type": "keep_any", "policies": [{"type": "keep_last", "n": 1},
                                                                 {"type": "keep_every", "n": 100}]}


def test_keep_best_min_and_max_with_ties_and_missing_metrics():
    metrics = {10: {"loss": 0.5}, 20: {"loss": 0.2}, 30: {"loss": 0.2}, 40: {"loss": None}, 50: {}, 60: {"loss": 0.9}}
    cps = kept(10, 20, 30, 40, 50, 60, metrics=metrics)
    assert KeepBest("loss", "min", 1).keep(cps) == {30}  # a tie goes to the newer step
    assert KeepBest("loss", "min", 2).keep(cps) == {20, 30}
    assert KeepBest("loss", "max", 2).keep(cps) == {60, 10}
    # without a value a checkpoint is no candidate; the newest (60) is kept by the rule anyway
    assert steps_to_delete(cps, KeepBest("loss", "min", 1)) == [10, 20, 40, 50]


def test_newest_and_protected_are_never_deleted_and_no_policy_keeps_all():
    assert steps_to_delete(kept(1, 2, 3), KeepBest("acc", "max", 1)) == [1, 2]
    assert steps_to_delete(kept(1, 2, 3), KeepLast(1), protect=[1]) == [2]
    assert steps_to_delete(kept(1, 2, 3), None) == []
    assert steps_to_delete([], KeepLast(1)) == []


@given(st.sets(st.integers(0, 10_000), max_size=40), st.integers(1, 10), st.integers(1, 50))
def test_retention_properties(steps, n, every):
    cps = kept(*sorted(steps))
    doomed = steps_to_delete(cps, KeepAny(KeepLast(n), KeepEvery(every)))
    survivors = set(steps) - set(doomed)
    assert set(doomed) <= set(steps) and doomed == sorted(doomed)
    if steps:
        assert max(steps) in survivors
        assert set(sorted(steps)[-n:]) <= survivors
        assert {s for s in steps if s % every == 0} <= survivors
        assert survivors == set(sorted(steps)[-n:]) | {s for s in steps if s % every == 0}


def test_shortcuts():
    assert shortcut_policy() is None
    assert shortcut_policy(keep_last=3) == KeepLast(3)
    assert shortcut_policy(keep_last=2, keep_best=("loss", "min")) == KeepAny(KeepLast(2), KeepBest("loss", "min", 1))
    with pytest.raises(ValueError, match="keep_best must be"):
        shortcut_policy(keep_best="loss")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="KeepBest.mode must be 'min' or 'max'"):
        shortcut_policy(keep_best=("loss", "lowest"))


# -- naming and the gc plan ------------------------------------------------------------------------
def test_checkpoint_names_sort_by_step_and_parse_back():
    steps = [0, 7, 42, 999, 123456789]
    names = [checkpoint_name(s) for s in steps]
    assert names == sorted(names) and names[2] == "step_000000042"
    assert [step_of(n) for n in names] == steps
    assert step_of("step_42") is None and step_of("step_00000004x") is None and step_of("other") is None
    with pytest.raises(ValueError, match="a checkpoint step must be an int >= 0"):
        checkpoint_name(-1)


def test_gc_plan():
    root = Path("/r")

    def e(step, status):
        return Entry(root / f"{step}-{status}", status, step, None, "")

    entries = [e(1, COMMITTED), e(2, COMMITTED), e(3, INCOMPLETE), e(4, CORRUPT), e(5, COMMITTED), e(6, TEMPORARY),
               e(7, TEMPORARY)]
    mtimes = {root / "3-incomplete": 0.0, root / "6-temporary": 0.0, root / "7-temporary": 990.0}
    plan = plan_gc(entries, KeepLast(2), now=1000.0, stale_after=60.0, mtime=mtimes.__getitem__)
    assert [(i.entry.step, i.action) for i in plan] == [
        (1, DELETE), (2, KEEP), (3, DELETE), (4, KEEP), (5, KEEP), (6, DELETE), (7, KEEP)]
    reasons = {i.entry.step: i.reason for i in plan}
    assert reasons[5] == "the newest committed checkpoint; kept by keep_last 2"
    assert reasons[2] == "kept by keep_last 2" and reasons[1] == "kept by no retention rule"
    assert "corrupt" in reasons[4] and "never removes it" in reasons[4]
    assert "changed 10 s ago" in reasons[7]
