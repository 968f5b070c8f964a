"""The share plan (resurgo.plan.share_plan): every needed piece reaches every rank that needs it
exactly once, reads are spread evenly, large pieces travel alone and small ones are grouped by
sender and receivers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.plan.share_plan import fingerprint, groups_of, plan_shares

PIECES = [(f"t{i}", "data/rank00000.safetensors", i * 1000, 0) for i in range(12)]


@st.composite
def groups(draw):
    world = draw(st.integers(1, 8))
    sizes = {p: draw(st.integers(1, 5000)) for p in PIECES}
    kinds = draw(st.lists(st.sets(st.sampled_from(PIECES)), min_size=1, max_size=3))
    owner = [draw(st.integers(0, len(kinds) - 1)) for _ in range(world)]
    needs = [{p: sizes[p] for p in kinds[owner[r]]} for r in range(world)]
    return needs


@settings(max_examples=200, deadline=None)
@given(groups(), st.integers(1, 12000), st.integers(1, 6000))
def test_every_needed_piece_reaches_every_rank_that_needs_it_once(needs, message_bytes, alone_bytes):
    grouped = [(g, needs[g[0]]) for g in groups_of([fingerprint(n) for n in needs])]
    plan = plan_shares(grouped, message_bytes, alone_bytes)
    got: dict[int, list] = {r: [] for r in range(len(needs))}
    for m in plan.messages:
        assert m.reader not in m.receivers and m.receivers == tuple(sorted(set(m.receivers)))
        assert len(m.chunks) == 1 or (m.nbytes <= message_bytes and all(c.nbytes < alone_bytes for c in m.chunks))
        for c in m.chunks:
            assert (c.reader, c.receivers) == (m.reader, m.receivers)
            for r in (m.reader, *m.receivers):
                got[r].append(c.chunk)
    for r, need in enumerate(needs):
        wanted = [p for p in need if sum(p in n for n in needs) > 1]  # needed elsewhere too: shared
        assert sorted(got[r]) == sorted(wanted)  # each once, nothing it does not need
    # identical needs (one group): reads differ by at most the largest piece
    if len(grouped) == 1 and len(needs) > 1:
        loads = [plan.read_bytes(r) for r in range(len(needs))]
        assert max(loads) - min(loads) <= max(needs[0].values(), default=0)
        assert sum(loads) == sum(needs[0].values())
        assert all(plan.received_bytes(r) + plan.read_bytes(r) == sum(needs[0].values()) for r in range(len(needs)))


def test_ranks_with_the_same_needs_form_one_group_and_order_does_not_matter():
    a = {PIECES[0]: 10, PIECES[1]: 20}
    b = {PIECES[1]: 20, PIECES[0]: 10}
    assert fingerprint(a) == fingerprint(b) != fingerprint({PIECES[0]: 10})
    assert groups_of([fingerprint(a), fingerprint({}), fingerprint(b)]) == [(0, 2), (1,)]


def test_a_piece_one_rank_needs_is_not_shared():
    plan = plan_shares([((0,), {PIECES[0]: 10}), ((1,), {PIECES[1]: 10})])
    assert plan.messages == ()


def test_large_pieces_travel_alone_and_small_ones_together():
    need = dict(zip(PIECES, [5000, 5000, 5000, 10, 20]))

    def messages(alone_bytes: int) -> list[tuple[int, list[int]]]:
        plan = plan_shares([((0, 1), need)], message_bytes=20000, alone_bytes=alone_bytes)
        return sorted((m.reader, [c.nbytes for c in m.chunks]) for m in plan.messages)

    # reads: rank 0 two pieces of 5000, rank 1 one of 5000 and the small ones
    assert messages(1000) == [(0, [5000]), (0, [5000]), (1, [10, 20]), (1, [5000])]
    assert messages(10**6) == [(0, [5000, 5000]), (1, [5000, 10, 20])]
