"""Fingerprint-only gathers (pure): the layout fingerprint changes with every field a plan depends
on (its equality across processes: tests/test_plan_fingerprint_dist.py); a save planned from the ranks' summaries is the plan that full
declarations give (plan_global), and anything that may change it makes the coordinator ask for
the declarations."""

from __future__ import annotations

import dataclasses
import json
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.format import checksum
from resurgo.layout.box import ChunkBox, FlatRange
from resurgo.plan.global_plan import (SMALL_VALUES_BYTES, GlobalPlan, PlanCache, RankDecl, TensorDecl,
                                      layout_fingerprint, merge_trees, plan_global)

RULE = checksum.block_bytes_for

# -- the fingerprint -----------------------------------------------------------------------------
places = st.one_of(
    st.builds(lambda o, s: ChunkBox(tuple(o), tuple(s)), st.lists(st.integers(0, 9), min_size=2, max_size=2),
              st.lists(st.integers(0, 9), min_size=2, max_size=2)),
    st.builds(lambda a, n: FlatRange(a, a + n), st.integers(0, 50), st.integers(0, 50)))
decls = st.builds(TensorDecl, st.text(min_size=1, max_size=6), st.sampled_from(["torch", "numpy"]),
                  st.sampled_from(["float32", "bfloat16", "int64"]), st.lists(st.integers(0, 9), max_size=3).map(tuple),
                  st.lists(places, min_size=1, max_size=3).map(tuple), st.booleans(),
                  st.one_of(st.none(), st.just("a" * 32)))


def _moved(p: ChunkBox | FlatRange) -> ChunkBox | FlatRange:
    if isinstance(p, ChunkBox):
        return ChunkBox(tuple(o + 1 for o in p.offsets), p.shape)
    return FlatRange(p.start + 1, p.stop + 1)


def _changed(t: TensorDecl, field: str, grow: bool) -> TensorDecl:
    new = {"key": lambda: t.key + "x", "kind": lambda: "numpy" if t.kind == "torch" else "torch",
           "dtype": lambda: t.dtype + "x", "shape": lambda: t.shape + (1,),
           "places": lambda: t.places + (ChunkBox((0,), (1,)),) if grow else (_moved(t.places[0]),) + t.places[1:],
           "sharded": lambda: not t.sharded, "digest": lambda: None if t.digest else "b" * 32}[field]()
    return dataclasses.replace(t, **{field: new})


@settings(max_examples=100)
@given(st.lists(decls, min_size=1, max_size=5), st.data())
def test_any_field_a_plan_depends_on_changes_the_fingerprint(tensors, data):
    i = data.draw(st.integers(0, len(tensors) - 1))
    field = data.draw(st.sampled_from(["key", "kind", "dtype", "shape", "places", "sharded", "digest"]))
    changed = list(tensors)
    changed[i] = _changed(tensors[i], field, data.draw(st.booleans()))
    assert layout_fingerprint(tuple(changed)) != layout_fingerprint(tuple(tensors)), field
    assert layout_fingerprint(tuple(tensors)) == layout_fingerprint(tuple(dataclasses.replace(t) for t in tensors))
    if len(tensors) > 1:  # one tensor fewer (a per-rank key set that changed)
        assert layout_fingerprint(tuple(tensors[1:])) != layout_fingerprint(tuple(tensors))


def test_a_compared_value_is_not_layout():
    t = TensorDecl("s", "torch", "float32", (), (ChunkBox((), ()),), False, "a" * 32)
    assert layout_fingerprint((t,)) == layout_fingerprint((dataclasses.replace(t, digest="b" * 32),))


# -- the protocol, simulated: rank r's PlanCache is caches[r], rank 0 coordinates ----------------
def save(caches: list[PlanCache], decls: list[RankDecl], rule=RULE, rule_id=None) -> tuple[GlobalPlan, bool, int]:  # type: ignore[no-untyped-def]
    """One save as prepare_save runs it: (the plan every rank got, whether it was reused, the most
    pickled bytes one rank gathered)."""
    summaries = [c.summarize(d) for c, d in zip(caches, decls)]
    merged = caches[0].reuse(decls[0].tree, summaries, rule_id)
    if merged is not None:
        plans = [c.reused(merged) for c in caches]
        sent = max(len(pickle.dumps(s)) for s in summaries)
    else:
        plan = caches[0].plan(decls, rule, rule_id)
        plan_id, per_rank = caches[0].ticket()
        for c in caches:
            c.hold(plan_id, plan, per_rank)
        plans = [plan] * len(caches)
        sent = max(len(pickle.dumps(d)) for d in decls)
    assert all(p == plans[0] for p in plans)
    return plans[0], merged is not None, sent


def _tree(keys, extra=()):  # type: ignore[no-untyped-def]
    return {"type": "dict", "items": [[k, {"type": "tensor", "key": k}] for k in keys] + list(extra)}


def job(world: int, step: int, *, rng_of=lambda r, step: r * 1000 + step, seen=lambda r: "a" * 32,
        halves=lambda r: False, extra_key=lambda r: False) -> list[RankDecl]:  # type: ignore[no-untyped-def]
    """A job of ``world`` ranks: ``w`` sharded by rows (``halves(r)``: rank r holds its rows as two
    shards), a replicated ``s`` compared across ranks (``seen(r)``: its digest), a per-rank ``rng``
    value and tensor, a step counter (``extra_key(r)``: and a tensor of its own)."""
    out = []
    for r in range(world):
        rows = (ChunkBox((8 * r, 0), (3, 4)), ChunkBox((8 * r + 3, 0), (5, 4))) if halves(r) else (ChunkBox((8 * r, 0), (8, 4)),)
        tensors = [TensorDecl("w", "torch", "float32", (8 * world, 4), rows, True),
                   TensorDecl("s", "torch", "float32", (3,), (ChunkBox.whole((3,)),), False, seen(r)),
                   TensorDecl("rng.t", "torch", "uint8", (8,), (ChunkBox.whole((8,)),), False, str(r) * 32)]
        if extra_key(r):
            tensors.append(TensorDecl("rng.mine", "torch", "float32", (2,), (ChunkBox.whole((2,)),), False, "c" * 32))
        seed = rng_of(r, step)
        seed = seed if isinstance(seed, dict) else {"type": "int", "value": seed}
        own = [["mine", {"type": "tensor", "key": "rng.mine"}]] if extra_key(r) else []
        rng = {"type": "per_rank", "items": [{"type": "dict", "items": [
            ["seed", seed], ["t", {"type": "tensor", "key": "rng.t"}]] + own}]}
        extra = [["step", {"type": "int", "value": step}], ["rng", rng]]
        out.append(RankDecl(_tree(["w", "s"], extra), tuple(tensors)))
    return out


def test_repeated_saves_reuse_from_summaries_and_equal_fresh_plans():
    caches = [PlanCache() for _ in range(4)]
    for step in (1, 2, 3):
        decls = job(4, step)
        plan, reused, sent = save(caches, decls)
        assert plan == plan_global(decls, RULE)
        assert reused == (step > 1)
        assert sent < 400 if reused else sent > 650  # a summary, or the declarations (3 tensors)
    assert caches[0].hits == 2 and caches[1].hits == 0


def test_a_summary_is_bounded_whatever_the_number_of_tensors():
    tensors = tuple(TensorDecl(f"layer.{i}.weight", "torch", "bfloat16", (4096, 1024), (ChunkBox((0, 0), (64, 1024)),),
                               True) for i in range(1000))
    decl = RankDecl(_tree([t.key for t in tensors], [["rng", {"type": "per_rank", "items": [{"type": "int", "value": 7}]}]]),
                    tensors)
    cache = PlanCache()
    cache.hold("p" * 32, GlobalPlan(merge_trees([decl.tree], set())[0], {}, ()), frozenset())
    summary = cache.summarize(decl)
    assert summary.basis and summary.values == ({"type": "per_rank", "items": [{"type": "int", "value": 7}]},)
    assert len(pickle.dumps(summary)) < 400 < len(pickle.dumps(decl)) // 100


def _primed(world: int = 3) -> list[PlanCache]:
    caches = [PlanCache() for _ in range(world)]
    save(caches, job(world, 1))
    return caches


def test_a_layout_change_on_one_rank_alone_replans():
    changes = {
        "rank 1 holds its rows of w as two shards": dict(halves=lambda r: r == 1),
        "rank 2 holds a per-rank tensor the others do not": dict(extra_key=lambda r: r == 2),
        "a replica that now differs on one rank (kept per rank)": dict(seen=lambda r: "b" * 32 if r == 1 else "a" * 32),
    }
    for what, change in changes.items():
        caches = _primed()
        decls = job(3, 2, **change)  # type: ignore[arg-type]
        plan, reused, _ = save(caches, decls)
        assert not reused, what
        assert plan == plan_global(decls, RULE), what
        _, reused, _ = save(caches, job(3, 3, **change))  # type: ignore[arg-type]
        assert reused, what  # and the new layout is reused in turn


def test_values_that_now_agree_and_new_values_give_the_fresh_tree():
    caches = _primed()
    same_rng = job(3, 2, rng_of=lambda r, step: step)  # the per-rank values happen to be equal now
    plan, reused, _ = save(caches, same_rng)
    assert reused and plan == plan_global(same_rng, RULE)
    digest_same = job(3, 3, seen=lambda r: "d" * 32)  # the replica's value changed, equal everywhere
    plan, reused, _ = save(caches, digest_same)
    assert reused and plan == plan_global(digest_same, RULE)


def test_a_changed_block_rule_world_or_lost_plan_asks_for_declarations():
    caches = _primed()
    _, reused, _ = save(caches, job(3, 2), rule=lambda n, row: 4096, rule_id=4096)
    assert not reused
    caches = _primed()
    _, reused, _ = save(caches + [PlanCache()], job(4, 2))  # a fourth rank joins
    assert not reused
    caches = _primed()
    caches[2] = PlanCache()  # rank 2 restarted: it holds no plan
    plan, reused, _ = save(caches, job(3, 2))
    assert not reused and plan == plan_global(job(3, 2), RULE)


def test_values_over_the_bound_send_declarations():
    caches = _primed()
    big = {"type": "str", "value": "x" * SMALL_VALUES_BYTES}
    decls = job(3, 2, rng_of=lambda r, step: big if r == 1 else r)
    assert [bool(c.summarize(d).basis) for c, d in zip(caches, decls)] == [True, False, True]
    _, reused, _ = save(caches, decls)
    assert not reused


@settings(max_examples=60)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(0, 1)), min_size=1,
                                   max_size=5))
def test_any_sequence_of_saves_plans_as_full_declarations_do(world, steps):
    caches = [PlanCache() for _ in range(world)]
    for step, (halved, seen_of, extra) in enumerate(steps):
        decls = job(world, step, halves=lambda r: r == halved, seen=lambda r: str(r % (seen_of + 1)) * 32,
                    extra_key=lambda r: bool(extra) and r == world - 1, rng_of=lambda r, s: s if seen_of == 0 else r)
        plan, _, _ = save(caches, decls)
        assert plan == plan_global(decls, RULE)
