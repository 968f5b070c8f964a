"""RNGState: capture, scramble, restore; the following draws must be identical bit for bit."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _state_roundtrip as core  # noqa: E402

from resurgo.errors import TypeMismatchError  # noqa: E402
from resurgo.state.rng import RNGState, capture_rng_state, restore_rng_state  # noqa: E402


def draws() -> tuple:
    """A bit of every stream, including the cached-Gaussian paths of Python and NumPy."""
    return (
        [random.random() for _ in range(5)],
        random.gauss(0.0, 1.0),
        random.getrandbits(64),
        np.random.rand(7),
        np.random.standard_normal(3),
        np.random.randint(0, 1 << 30, size=4),
        torch.rand(6),
        torch.randn(5),
        torch.randperm(20),
        torch.nn.functional.dropout(torch.ones(16), p=0.5, training=True),
    )


def assert_draws_equal(a: tuple, b: tuple) -> None:
    assert a[0] == b[0] and a[2] == b[2]
    # Compare floats by bits: == would also accept -0.0 for 0.0.
    assert np.float64(a[1]).tobytes() == np.float64(b[1]).tobytes()
    for x, y in zip(a[3:6], b[3:6]):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    for x, y in zip(a[6:], b[6:]):
        assert torch.equal(x, y)


def scramble() -> None:
    random.seed(987)
    np.random.seed(987)
    torch.manual_seed(987)


@pytest.mark.parametrize("gauss_pending", [False, True])
def test_roundtrip_reproduces_streams(gauss_pending: bool) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    if gauss_pending:
        # Leaves a cached second Gaussian in Python, NumPy and torch: part of the state too.
        random.gauss(0, 1)
        np.random.standard_normal()
        torch.randn(1, dtype=torch.float64)
    saved = core.save(RNGState())
    expected = draws()
    scramble()
    core.load(RNGState(), saved)
    assert_draws_equal(draws(), expected)


def test_state_is_plain_with_fixed_shapes() -> None:
    sd = RNGState().state_dict().value
    core.assert_plain(sd)
    assert set(sd) == {"python", "numpy", "torch", "cuda"}
    assert sd["python"]["state"].dtype == np.uint32 and sd["python"]["state"].shape == (625,)
    assert sd["numpy"]["keys"].dtype == np.uint32 and sd["numpy"]["keys"].shape == (624,)
    assert sd["torch"].dtype == torch.uint8
    random.gauss(0, 1)  # computes two values: one returned, one kept in gauss_next ...
    if random.getstate()[2] is None:
        random.gauss(0, 1)  # ... unless one was already kept, which this call used up
    sd2 = RNGState().state_dict().value  # gauss_next now set: the leaf kinds must not change
    assert type(sd2["python"]["gauss_next"]) is float and sd2["python"]["has_gauss_next"] is True
    assert type(sd["python"]["gauss_next"]) is float
    if not torch.cuda.is_available():
        assert sd["cuda"] == []


def test_captured_state_is_a_snapshot() -> None:
    sd = capture_rng_state()
    torch_before, np_before = sd["torch"].clone(), sd["numpy"]["keys"].copy()
    torch.rand(1000)
    np.random.rand(1000)  # > 624 draws: regenerates NumPy's whole key array
    assert torch.equal(sd["torch"], torch_before)
    assert np.array_equal(sd["numpy"]["keys"], np_before)
    restore_rng_state(sd)
    assert torch.equal(torch.get_rng_state(), torch_before)
    assert np.array_equal(np.random.get_state()[1], np_before)


def test_partial_state_leaves_other_generators_alone() -> None:
    sd = capture_rng_state()
    torch.rand(3)
    after_torch = torch.get_rng_state()
    restore_rng_state({"python": sd["python"]})
    assert torch.equal(torch.get_rng_state(), after_torch)


def test_bad_python_version_rejected() -> None:
    sd = capture_rng_state()
    sd["python"]["version"] = 2
    with pytest.raises(TypeMismatchError, match="version"):
        restore_rng_state(sd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_roundtrip() -> None:
    torch.cuda.manual_seed_all(4)
    saved = core.save(RNGState())
    expected = torch.rand(8, device="cuda")
    torch.cuda.manual_seed_all(5)
    core.load(RNGState(), saved)
    assert torch.equal(torch.rand(8, device="cuda"), expected)


def test_carry_over_keeps_existing_ranks_and_derives_distinct_new_ones() -> None:
    import warnings as _warnings

    from resurgo.state.rng import capture_rng_state, carry_over_rng

    saved = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        saved.append(capture_rng_state())
    before = capture_rng_state()
    assert carry_over_rng(saved, 1, 4) is saved[1]  # an existing rank keeps its own stream
    new2, new3 = carry_over_rng(saved, 2, 4), carry_over_rng(saved, 3, 4)
    again = carry_over_rng(saved, 2, 4)
    assert torch.equal(new2["torch"], again["torch"])  # deterministic
    assert not torch.equal(new2["torch"], new3["torch"])  # distinct per rank
    assert all(not torch.equal(new2["torch"], s["torch"]) for s in saved)  # never a saved stream
    assert new2["python"]["state"].tolist() != new3["python"]["state"].tolist() and set(new2) == {"python", "numpy", "torch"}
    after = capture_rng_state()  # deriving does not disturb this process's streams
    assert torch.equal(before["torch"], after["torch"]) and before["python"]["state"].tolist() == after["python"]["state"].tolist()
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        carry_over_rng(saved + saved, 0, 2)
    assert any("ranks 2..3 are not used" in str(w.message) for w in caught)
