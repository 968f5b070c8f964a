"""The fault-injection hook: parsing, once-only firing, rank selection, errno faults."""

from __future__ import annotations

import errno

import pytest

from resurgo import faults


@pytest.fixture(autouse=True)
def disarmed(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    yield
    faults.arm("")


def test_unarmed_point_does_nothing():
    faults.point("save.write")


def test_raise_fires_once_on_its_rank_only():
    faults.arm("0:save.write:raise,1:save.commit:raise")
    faults.point("save.write")  # armed for rank 0, this is rank 1
    with pytest.raises(faults.InjectedFault, match="save.commit on rank 1"):
        faults.point("save.commit")
    faults.point("save.commit")  # fired already


def test_errno_faults_raise_oserror_of_that_errno():
    faults.arm("*:load.read:enospc")
    with pytest.raises(OSError) as info:
        faults.point("load.read")
    assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize("spec", ["0:save.write", "0:save.write:explode", ":save.write:kill"])
def test_malformed_specs_are_refused(spec):
    with pytest.raises(ValueError, match="RESURGO_FAULT"):
        faults.arm(spec)
