"""Renamed keyword arguments: the new name does what the old one did; the old one still works for
one release, warning (DeprecationWarning naming the new name, pointing at the caller's line) and
doing exactly the same; both names in one call raise UnsupportedValueError naming both."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch

import resurgo
from resurgo.errors import UnsupportedValueError
from resurgo.format import checksum
from resurgo.renamed import renamed_keywords


def small_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(4096, 128, generator=g), "step": 0}  # 2 MiB: 4 KiB blocks as a base


def block_sizes(path: Path) -> dict[str, list[int]]:
    return {k: [c.block_bytes for c in t.chunks] for k, t in resurgo.read_manifest(path).tensors.items()}


@pytest.fixture
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_the_decorator_warns_once_per_old_name_and_refuses_both():
    @renamed_keywords("f", old="new")
    def f(*, new: int = 0, other: int = 0) -> tuple[int, int]:
        return new, other

    assert list(inspect.signature(f).parameters) == ["new", "other"]  # the documented signature: new names only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(new=3, other=1) == (3, 1)
    with pytest.warns(DeprecationWarning, match=r"^f\(old=\.\.\.\) is deprecated: pass new= instead") as caught:
        assert f(old=3, other=1) == (3, 1)
    assert [w.filename for w in caught] == [__file__]
    with pytest.raises(UnsupportedValueError, match=r"^f: old=1 and new=2 were both given; old= is the deprecated "
                                                    r"name of new=: pass new= only$"):
        f(old=1, new=2)
    with pytest.raises(TypeError):  # a misspelt keyword is still Python's error
        f(olde=1)


@pytest.mark.parametrize("call", ["save", "async_save"])
def test_as_base_picks_the_blocks_a_base_needs_and_incremental_still_does_with_a_warning(tmp_path, call, no_warnings):
    def run(path: Path, **kw) -> None:
        result = getattr(resurgo, call)(small_state(), path, **kw)
        if call == "async_save":
            result.wait()

    run(tmp_path / "plain")
    run(tmp_path / "new", as_base=True)
    reuse = checksum.incremental_block_bytes_for(4096 * 128 * 4, 128 * 4)
    assert block_sizes(tmp_path / "new") == {"emb": [reuse]} != block_sizes(tmp_path / "plain")
    with pytest.warns(DeprecationWarning, match=rf"^resurgo\.{call}\(incremental=\.\.\.\) is deprecated: pass "
                                                r"as_base= instead") as caught:
        run(tmp_path / "old", incremental=True)
    assert [w.filename for w in caught] == [__file__]
    assert block_sizes(tmp_path / "old") == block_sizes(tmp_path / "new")
    with pytest.raises(UnsupportedValueError, match=rf"^resurgo\.{call}: incremental=True and as_base=True were "
                                                    r"both given; .*pass as_base= only$"):
        run(tmp_path / "both", incremental=True, as_base=True)
    assert not (tmp_path / "both").exists()
    assert "incremental" not in inspect.signature(getattr(resurgo, call)).parameters
