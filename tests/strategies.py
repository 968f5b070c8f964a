"""Hypothesis strategies shared by the geometry tests."""

from hypothesis import strategies as st

from resurgo.layout.box import ChunkBox


@st.composite
def boxes_in(draw, shape):
    """Any box (empty ones included) inside ``shape``."""
    offsets, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d))
        offsets.append(o)
        sizes.append(draw(st.integers(0, d - o)))
    return ChunkBox(tuple(offsets), tuple(sizes))
