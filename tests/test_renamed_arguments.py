"""Renamed keyword arguments: the new name does what the old one did; the old one still works for
one release, warning (DeprecationWarning naming the new name, pointing at the caller's line) and
doing exactly the same; both names in one call raise UnsupportedValueError naming both."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import resurgo
from resurgo.cli.app import app
from resurgo.errors import MemoryBudgetError, UnsupportedValueError
from resurgo.format import checksum
from resurgo.manager import CheckpointManager, MemoryTier, Tier
from resurgo.renamed import renamed_keywords

runner = CliRunner()


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


def test_staging_bytes_bounds_a_rank_s_staging_and_memory_budget_still_does(tmp_path, no_warnings):
    state = {"w": torch.zeros(1000)}  # 4000 bytes of staging
    with pytest.raises(MemoryBudgetError, match=r"the budget is 3999 \(staging_bytes\); raise staging_bytes"):
        resurgo.async_save(state, tmp_path / "new", staging_bytes=3999)
    with pytest.warns(DeprecationWarning, match=r"^resurgo\.async_save\(memory_budget=\.\.\.\) is deprecated: pass "
                                                r"staging_bytes= instead"):
        with pytest.raises(MemoryBudgetError, match=r"the budget is 3999 \(staging_bytes\)"):
            resurgo.async_save(state, tmp_path / "old", memory_budget=3999)
    with pytest.raises(UnsupportedValueError, match=r"memory_budget=1 and staging_bytes=2 were both given"):
        resurgo.async_save(state, tmp_path / "both", memory_budget=1, staging_bytes=2)
    assert not any((tmp_path / n).exists() for n in ("new", "old", "both"))


def test_buffer_bytes_of_convert_import_and_diff_and_their_old_name(tmp_path, no_warnings):
    resurgo.save({"w": torch.arange(1024.0)}, tmp_path / "ck")  # 4096 bytes of tensors
    with pytest.raises(MemoryBudgetError, match=r"more than buffer_bytes=4000; raise buffer_bytes"):
        resurgo.convert(tmp_path / "ck", tmp_path / "a.pt", to="torch", buffer_bytes=4000)
    with pytest.warns(DeprecationWarning, match=r"^resurgo\.convert\(memory_budget=\.\.\.\) is deprecated: pass "
                                                r"buffer_bytes= instead"):
        with pytest.raises(MemoryBudgetError, match=r"more than buffer_bytes=4000"):
            resurgo.convert(tmp_path / "ck", tmp_path / "b.pt", to="torch", memory_budget=4000)

    torch.save({"w": torch.arange(4.0)}, tmp_path / "f.pt")
    below = r"buffer_bytes=9437184 is below what one writer holds"
    with pytest.raises(MemoryBudgetError, match=below):
        resurgo.import_checkpoint(tmp_path / "f.pt", tmp_path / "i1", source="torch", buffer_bytes="9MiB")
    with pytest.warns(DeprecationWarning, match=r"^resurgo\.import_checkpoint\(memory_budget=\.\.\.\) is deprecated"):
        with pytest.raises(MemoryBudgetError, match=below):
            resurgo.import_checkpoint(tmp_path / "f.pt", tmp_path / "i2", source="torch", memory_budget="9MiB")

    resurgo.save({"w": torch.arange(1024.0) + 1}, tmp_path / "other")
    new = resurgo.diff_checkpoints(tmp_path / "ck", tmp_path / "other", stats=True, buffer_bytes=64)
    with pytest.warns(DeprecationWarning, match=r"^resurgo\.diff_checkpoints\(memory_budget=\.\.\.\) is deprecated"):
        old = resurgo.diff_checkpoints(tmp_path / "ck", tmp_path / "other", stats=True, memory_budget=64)
    assert old == new and new.tensors[0].elements_differing == 1024
    with pytest.raises(UnsupportedValueError, match=r"^resurgo\.diff_checkpoints: memory_budget=64 and "
                                                    r"buffer_bytes=64 were both given"):
        resurgo.diff_checkpoints(tmp_path / "ck", tmp_path / "other", memory_budget=64, buffer_bytes=64)


def test_node_bytes_of_a_memory_tier_and_its_old_name(tmp_path, no_warnings):
    assert MemoryTier(replicas=0, node=0, node_bytes=1000).node_bytes == 1000
    with pytest.warns(DeprecationWarning, match=r"^MemoryTier\(memory_budget=\.\.\.\) is deprecated: pass node_bytes="
                                                r" instead") as caught:
        tier = MemoryTier(replicas=0, node=0, memory_budget=1000)
    assert [w.filename for w in caught] == [__file__]
    assert tier == MemoryTier(replicas=0, node=0, node_bytes=1000)
    with pytest.warns(DeprecationWarning, match=r"^MemoryTier\.memory_budget is deprecated: read node_bytes instead"):
        assert tier.memory_budget == 1000
    with pytest.raises(UnsupportedValueError, match=r"^MemoryTier: memory_budget=1 and node_bytes=2 were both given"):
        MemoryTier(memory_budget=1, node_bytes=2)
    with pytest.raises(ValueError, match=r"node_bytes must be an int >= 1"):
        MemoryTier(node_bytes=0)
    assert list(inspect.signature(MemoryTier).parameters)[-1] == "node_bytes"


def test_the_cli_takes_buffer_and_still_memory_budget_hidden_with_a_warning(tmp_path):
    resurgo.save({"w": torch.arange(1024.0)}, tmp_path / "a")
    resurgo.save({"w": torch.arange(1024.0) + 1}, tmp_path / "b")
    diff = ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--stats"]
    new = runner.invoke(app, [*diff, "--buffer", "64B"])
    old = runner.invoke(app, [*diff, "--memory-budget", "64B"])
    assert new.exit_code == old.exit_code == 1, (new.output, old.output)
    assert old.stdout == new.stdout and "1024" in new.stdout
    assert "warning: --memory-budget is deprecated: use --buffer" in old.stderr and "deprecated" not in new.stderr
    both = runner.invoke(app, [*diff, "--buffer", "64B", "--memory-budget", "64B"])
    assert both.exit_code == 2 and "--memory-budget is the old name of --buffer; give --buffer only" in both.stderr
    for command in ("diff", "convert", "import"):
        shown = runner.invoke(app, [command, "--help"], terminal_width=200).stdout
        assert "--buffer" in shown and "--memory-budget" not in shown, command
    r = runner.invoke(app, ["convert", str(tmp_path / "a"), str(tmp_path / "x.pt"), "--to", "torch",
                            "--memory-budget", "4000B"])
    assert r.exit_code == 2 and "more than buffer_bytes=4000" in r.stderr and "deprecated" in r.stderr
    r = runner.invoke(app, ["import", str(tmp_path / "none.pt"), str(tmp_path / "i"), "--from", "torch",
                            "--memory-budget", "1B"])
    assert "warning: --memory-budget is deprecated" in r.stderr and not (tmp_path / "i").exists()


def test_copy_every_steps_selects_a_tier_s_copies_and_every_steps_still_does(tmp_path, no_warnings):
    durable = Tier(tmp_path / "durable", copy_every_steps=2)
    assert [s for s in range(1, 7) if durable.selects(s)] == [2, 4, 6]
    with pytest.warns(DeprecationWarning, match=r"^Tier\(every_steps=\.\.\.\) is deprecated: pass copy_every_steps= "
                                                r"instead") as caught:
        old = Tier(tmp_path / "durable", every_steps=2)
    assert [w.filename for w in caught] == [__file__]
    assert old == durable
    with pytest.warns(DeprecationWarning, match=r"^Tier\.every_steps is deprecated: read copy_every_steps instead"):
        assert old.every_steps == 2
    with pytest.raises(UnsupportedValueError, match=r"^Tier: every_steps=2 and copy_every_steps=3 were both given"):
        Tier(tmp_path, every_steps=2, copy_every_steps=3)
    with pytest.raises(ValueError, match=r"copy_every_steps must be an int >= 1"):
        Tier(tmp_path, copy_every_steps=0)
    with pytest.raises(ValueError, match=r"copy_every_steps applies to the later tiers only"):
        resurgo.CheckpointManager(tiers=[Tier(tmp_path, copy_every_steps=2)])
    # the manager saves every step; the durable tier gets the even ones, whichever name selected them
    with CheckpointManager(tiers=[Tier(tmp_path / "fast", keep_last=10), durable], every_steps=1,
                           async_save=False) as mgr:
        for step in range(1, 5):
            mgr.maybe_save({"w": torch.full((4,), float(step))}, step)
        mgr.wait()
        assert mgr.steps(tier=0) == [1, 2, 3, 4] and mgr.steps(tier=1) == [2, 4]
