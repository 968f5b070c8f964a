"""Functions tests/test_rank_agreement.py runs on every rank (see dist_harness.run_ranks).

Each scenario makes one rank's outcome differ from the others' (a fault injected on one rank, an
argument passed differently) and records, per rank, ``"ok"`` or ``"<ErrorType>: <message>"``;
the test checks that every rank recorded the same thing, and that a following call succeeded
(no rank was left inside a collective).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import resurgo
from resurgo import faults

ROWS, COLS = 1000, 64
RANK0_ROWS = 900  # rank 0 holds most of "w": its snapshot alone exceeds BUDGET
BUDGET = 100_000


def outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test to compare across ranks
        return f"{type(e).__name__}: {e}"
    return "ok"


def full_w() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def uneven_state(rank: int, world: int) -> dict:
    """``w`` sharded by rows, rank 0 holding most; ``b`` replicated; a step."""
    bounds = [0, RANK0_ROWS] + [RANK0_ROWS + (ROWS - RANK0_ROWS) * (r + 1) // (world - 1) for r in range(world - 1)]
    a, b = bounds[rank], bounds[rank + 1]
    return {"w": resurgo.Shard(full_w()[a:b].clone(), (ROWS, COLS), (a, 0)), "b": torch.linspace(0, 1, 50), "step": 3}


def leftovers(root: Path) -> list[str]:
    """Names under ``root`` that are not committed checkpoints (staging directories, partial files)."""
    return sorted(p.name for p in root.iterdir() if not (p / "manifest.json").is_file())


class Refusing:
    """A Stateful whose state_dict() or load_state_dict() raises on one rank (a user's bug)."""

    def __init__(self, rank: int, refuse_save: int = -1, refuse_load: int = -1):
        self.rank, self.refuse_save, self.refuse_load = rank, refuse_save, refuse_load
        self.value = 7

    def state_dict(self) -> dict:
        if self.rank == self.refuse_save:
            raise ValueError(f"state_dict refused on rank {self.rank}")
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if self.rank == self.refuse_load:
            raise ValueError(f"load_state_dict refused on rank {self.rank}")
        self.value = state["value"]


def rank_local_outcomes(rank: int, world: int, tmp: str) -> dict:
    """Checks that pass on some ranks only: a memory budget, a staging failure, a full or failing
    disk, a user's state_dict()/load_state_dict(), the guard's background copy."""
    from resurgo.storage import local

    root = Path(tmp)
    aborted: list[str] = []
    real_abort = local.LocalStaging.abort

    def spy_abort(self):  # which rank removes a shared staging directory
        aborted.append(Path(self.final).name)
        return real_abort(self)

    local.LocalStaging.abort = spy_abort
    st = uneven_state(rank, world)
    out: dict[str, Any] = {}
    resurgo.save(st, root / "earlier")

    out["budget"] = outcome(lambda: resurgo.async_save(st, root / "budget", staging_bytes=BUDGET).wait())
    out["budget_sync"] = outcome(lambda: resurgo.async_save(st, root / "budget_sync", staging_bytes=BUDGET,
                                                            fallback="sync").wait())
    out["budget_after"] = outcome(lambda: resurgo.async_save(st, root / "budget").wait())

    out["budget_aborted"] = list(aborted)
    aborted.clear()
    faults.arm("1:async.stage:raise")
    out["stage"] = outcome(lambda: resurgo.async_save(st, root / "stage").wait())
    faults.arm("")
    out["stage_aborted"] = list(aborted)
    dist.barrier()
    out["stage_leftovers"] = leftovers(root)
    out["stage_after"] = outcome(lambda: resurgo.async_save(st, root / "stage").wait())

    for fault in ("enospc", "eio", "eacces"):
        faults.arm(f"1:save.write:{fault}")
        out[f"disk_{fault}"] = outcome(lambda: resurgo.save(st, root / f"disk_{fault}"))
        faults.arm("")
    faults.arm("1:save.write:eio")
    out["disk_async"] = outcome(lambda: resurgo.async_save(st, root / "disk_async").wait())
    faults.arm("")
    faults.arm("0:save.commit:eio")  # the background commit, on the rank that commits
    out["commit_async"] = outcome(lambda: resurgo.async_save(st, root / "commit_async").wait())
    faults.arm("")
    dist.barrier()
    out["disk_leftovers"] = leftovers(root)
    out["disk_after"] = outcome(lambda: resurgo.save(st, root / "disk_enospc"))

    out["state_dict"] = outcome(lambda: resurgo.save({**st, "obj": Refusing(rank, refuse_save=1)}, root / "sd"))
    out["state_dict_after"] = outcome(lambda: resurgo.save({**st, "obj": Refusing(rank)}, root / "sd"))
    target = uneven_state(rank, world)
    out["load_state_dict"] = outcome(lambda: resurgo.load({**target, "obj": Refusing(rank, refuse_load=1)}, root / "sd"))
    loaded = {**uneven_state(rank, world), "obj": Refusing(rank)}
    loaded["w"].local.zero_()
    out["load_after"] = outcome(lambda: resurgo.load(loaded, root / "sd"))
    out["load_exact"] = torch.equal(loaded["w"].local, st["w"].local) and loaded["obj"].value == 7

    # The guard's copy runs in the background thread: its failure on one rank reaches every rank's wait().
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    trained = {"model": model, "opt": opt}
    faults.arm("1:async.copy:raise")
    out["guard_copy"] = outcome(lambda: resurgo.async_save(trained, root / "guarded", guard=opt).wait())
    faults.arm("")
    out["guard_after"] = outcome(lambda: resurgo.async_save(trained, root / "guarded", guard=opt).wait())
    out["aborted"] = aborted
    return out


def busy_saves(rank: int, world: int, tmp: str, calls: int) -> list[str]:
    """Back-to-back ``async_save(if_busy="raise")`` calls, each rank's writer slowed differently, so
    that whether the previous save is done flips at different moments on each rank."""
    root = Path(tmp)
    st = uneven_state(rank, world)
    faults.arm(f"{rank}:save.write:slow={0.01 * (rank + 1)}")
    outcomes, handles = [], []
    for i in range(calls):
        try:
            handles.append(resurgo.async_save(st, root / f"c{i}", if_busy="raise"))
            outcomes.append("ok")
        except resurgo.ResurgoError as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    handles[-1].wait()
    faults.arm("")
    return outcomes


def mismatched_calls(rank: int, world: int, tmp: str) -> dict:
    """Collective calls whose ranks pass different arguments; nothing may be written."""
    from resurgo.dist.comm import sent_bytes
    from resurgo.manager import CheckpointManager

    root = Path(tmp)
    st = uneven_state(rank, world)
    resurgo.save(st, root / "b0", as_base=True)
    resurgo.save(st, root / "b1")
    dist.barrier()
    before = sorted(os.listdir(root))
    other = rank % 2  # rank 0 (and every even rank) passes one value, the odd ranks another
    saves = {
        "path": lambda: resurgo.save(st, root / f"p{other}"),
        "step": lambda: resurgo.save(st, root / "s", step=1 + other),
        "overwrite": lambda: resurgo.save(st, root / "o", overwrite=bool(other)),
        "as_base": lambda: resurgo.save(st, root / "i", as_base=bool(other)),
        "base": lambda: resurgo.save(st, root / "bs", base=root / "b0" if other else None),
        "allow_pickle": lambda: resurgo.save(st, root / "a", allow_pickle=bool(other)),
        "async_fallback": lambda: resurgo.async_save(st, root / "f", fallback="sync" if other else "raise").wait(),
        "if_busy": lambda: resurgo.async_save(st, root / "ib", if_busy="raise" if other else "wait").wait(),
    }
    out: dict[str, Any] = {name: outcome(fn) for name, fn in saves.items()}
    dist.barrier()
    out["written"] = sorted(set(os.listdir(root)) - set(before))
    # the deprecated name is the same argument: ranks passing it under either name agree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        out["as_base_either_name"] = outcome(
            lambda: resurgo.save(st, root / "ie", **{"incremental" if other else "as_base": True}))
    target = uneven_state(rank, world)
    loads = {
        "load_path": lambda: resurgo.load(target, root / f"b{other}"),
        "load_strict": lambda: resurgo.load(target, root / "b1", strict=bool(other)),
        "load_allow_pickle": lambda: resurgo.load(target, root / "b1", allow_pickle=bool(other)),
    }
    out.update({name: outcome(fn) for name, fn in loads.items()})
    mgr = CheckpointManager(root / "mgr", async_save=False)
    out["manager_step"] = outcome(lambda: mgr.save(st, 10 + other))
    dist.barrier()
    out["manager_written"] = sorted(os.listdir(root / "mgr")) if (root / "mgr").exists() else []
    mgr.save(st, 20)
    out["manager_restore"] = outcome(lambda: mgr.restore(uneven_state(rank, world), step=20 if other else None))
    out["manager_restore_missing"] = outcome(lambda: mgr.restore(uneven_state(rank, world), step=5))
    out["manager_restored"] = outcome(lambda: mgr.restore(uneven_state(rank, world), step=20))
    mgr.close()
    out["after"] = outcome(lambda: resurgo.save(st, root / "after"))
    loaded = uneven_state(rank, world)
    loaded["w"].local.zero_()
    out["load_after"] = outcome(lambda: resurgo.load(loaded, root / "after"))
    out["load_exact"] = torch.equal(loaded["w"].local, st["w"].local)
    out["sent"] = sent_bytes()
    return out


def background_failures(rank: int, world: int, tmp: str) -> dict:
    """A manager's background work failing on one rank: a tier copy, an asynchronous write."""
    from resurgo.manager import CheckpointManager, MemoryTier, Tier

    root = Path(tmp)
    st = uneven_state(rank, world)
    out: dict[str, Any] = {}
    mgr = CheckpointManager(tiers=[Tier(root / "fast"), Tier(root / "durable")], async_save=False)
    faults.arm("1:tier.copy:eio")
    mgr.save(st, 1)
    mgr._janitor.join()  # this rank's copy has failed (on every rank: the copy is collective)
    out["copy_next_call"] = outcome(lambda: mgr.maybe_save(st, 2))
    out["copy_should_stop"] = mgr.should_stop
    faults.arm("")
    out["copy_after"] = outcome(lambda: mgr.save(st, 3))
    out["copy_wait_after"] = outcome(mgr.wait)
    mgr.close()

    mgr = CheckpointManager(tiers=[Tier(root / "fast2"), Tier(root / "durable2")], async_save=False)
    faults.arm("0:tier.copy:eacces")
    mgr.save(st, 1)
    out["copy_wait"] = outcome(mgr.wait)
    out["copy_wait_should_stop"] = mgr.should_stop
    faults.arm("")
    mgr.close()

    mgr = CheckpointManager(root / "async", every_steps=1)
    faults.arm("1:save.write:enospc")
    mgr.maybe_save(st, 1)
    out["async_wait"] = outcome(mgr.wait)
    out["async_should_stop"] = mgr.should_stop
    faults.arm("")
    out["async_after"] = outcome(lambda: (mgr.maybe_save(st, 2), mgr.wait()))
    mgr.close()

    # A memory tier: each rank a node of its own, its files replicated to the other's memory.
    memory = MemoryTier(replicas=1, keep_last=1, root=os.path.join(tmp, "mem", "node{node}"), node=rank)
    mgr = CheckpointManager(tiers=[memory])
    faults.arm("1:replicate.send:eio")
    mgr.save(st, 1)
    out["replicate_wait"] = outcome(mgr.wait)
    out["replicate_should_stop"] = mgr.should_stop
    faults.arm("")
    out["replicate_after"] = outcome(lambda: (mgr.save(st, 2), mgr.wait()))
    mgr.close()
    dist.barrier()
    out["memory_steps"] = sorted(os.listdir(root / "mem" / f"node{rank}"))
    out["durable"] = sorted(os.listdir(root / "durable"))
    out["async_steps"] = sorted(os.listdir(root / "async"))
    return out


def accelerate_refused_prune(rank: int, world: int, tmp: str) -> dict:
    """Accelerate with total_limit=1: the main process's prune of checkpoint_0 is refused (a file
    resurgo did not write was put in it)."""
    from accelerate_run import train

    os.environ["LOCAL_RANK"] = str(rank)
    project = Path(tmp)

    def plant(step: int) -> None:
        if step == 3 and rank == 0:  # after checkpoint_0's save, before checkpoint_1's
            (project / "checkpoints" / "checkpoint_0" / "notes.txt").write_text("mine")

    out = {"train": outcome(lambda: train(project, save_every=2, stop=4, total_limit=1, on_step=plant))}
    out["after"] = outcome(lambda: resurgo.save({"x": torch.ones(3)}, project / "after"))
    return out


def mismatched_trees_and_loads(rank: int, world: int, tmp: str) -> dict:
    """Saves whose ranks hold different tensors where they must hold the same, loads whose ranks
    pass different arguments while one rank's own step fails; then differences that are the
    ranks' own (a PerRank, per-rank values) save and load exactly."""
    from fractions import Fraction

    root = Path(tmp)
    st = uneven_state(rank, world)
    resurgo.save(st, root / "b")
    resurgo.save({**st, "ratio": Fraction(1, 3)}, root / "pickled", allow_pickle=True)
    dist.barrier()
    before = sorted(os.listdir(root))
    many = {f"opt.{i}": torch.ones(2) for i in range(6)} if rank == 0 else {}
    saves = {
        "extra_tensor": {**st, **({"extra": torch.ones(3)} if rank == 1 else {})},
        "extra_plain": {"b": st["b"], **many},  # plain tensors only: no shard to trip on
        "shape": {**st, "b": torch.linspace(0, 1, 50 + rank)},
        "dtype": {**st, "b": st["b"].to(torch.float64 if rank else torch.float32)},
    }
    out: dict[str, Any] = {name: outcome(lambda: resurgo.save(state, root / name)) for name, state in saves.items()}
    dist.barrier()
    out["written"] = sorted(set(os.listdir(root)) - set(before))

    def blank() -> dict:
        target = uneven_state(rank, world)
        target["w"].local.zero_()
        target["b"].zero_()
        return target

    other = rank % 2
    targets: dict[str, dict] = {}

    def load(name: str, path: Path, **options: Any) -> str:
        targets[name] = blank()
        if options.pop("extra_key", False):
            targets[name]["missing"] = torch.zeros(2)  # not in the checkpoint: strict=True refuses
        return outcome(lambda: resurgo.load(targets[name], path, **options))

    out["load_strict"] = load("load_strict", root / "b", strict=bool(other), share_reads=False, extra_key=True)
    out["load_allow_pickle"] = load("load_allow_pickle", root / "pickled", allow_pickle=bool(other), share_reads=False)
    out["load_path"] = load("load_path", root / ("b" if other == 0 else "nowhere"), share_reads=False)
    out["load_share_reads"] = load("load_share_reads", root / "b", share_reads=None if other == 0 else False,
                                   strict=True, extra_key=bool(other))
    out["untouched"] = {name: bool(t["w"].local.eq(0).all() and t["b"].eq(0).all()) for name, t in targets.items()}
    out["load_dict_path"] = outcome(lambda: resurgo.load_dict(root / ("b" if other == 0 else "nowhere")))
    out["load_dict_allow_pickle"] = outcome(lambda: resurgo.load_dict(root / "pickled", allow_pickle=bool(other)))

    # The ranks' own differences: a PerRank of another key and shape, values and a small tensor.
    def legit(zero: bool) -> dict:
        mine = torch.arange(3 + rank) * (0 if zero else 1)  # of its own shape, under a key of each rank's
        return {**(blank() if zero else st), "own": resurgo.PerRank({"same": mine, f"k{rank}": mine.clone()}),
                "seen": [] if zero else list(range(rank + 1)), "noise": torch.full((4,), 0.0 if zero else float(rank))}

    out["legit"] = outcome(lambda: resurgo.save(legit(False), root / "legit"))
    back = legit(True)
    out["legit_load"] = outcome(lambda: resurgo.load(back, root / "legit"))
    want = legit(False)
    out["legit_exact"] = (torch.equal(back["w"].local, want["w"].local) and torch.equal(back["noise"], want["noise"])
                          and all(torch.equal(back["own"].value[k], want["own"].value[k]) for k in ("same", f"k{rank}"))
                          and back["seen"] == want["seen"])
    out["after"] = outcome(lambda: resurgo.save(st, root / "after"))
    return out


def retention_failures(rank: int, world: int, tmp: str) -> dict:
    """A manager's retention (rank 0 deletes) refused a deletion (a file resurgo did not write in
    the checkpoint), then failing with an OSError: what every rank's next calls see."""
    import errno
    import warnings

    from resurgo.manager import CheckpointManager
    from resurgo.manager import prune as prune_module
    from resurgo.manager.catalog import checkpoint_name

    root = Path(tmp)
    st = uneven_state(rank, world)
    out: dict[str, Any] = {}
    mgr = CheckpointManager(root, keep_last=1, async_save=False)

    def call(name: str, fn: Callable[[], Any]) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[name] = outcome(fn)
        out[name + "_warned"] = [f"{w.category.__name__}: {w.message}" for w in caught
                                 if issubclass(w.category, UserWarning)]
        out[name + "_should_stop"] = mgr.should_stop

    mgr.save(st, 1)
    if rank == 0:
        (root / checkpoint_name(1) / "notes.txt").write_text("mine")
    mgr.save(st, 2)  # rank 0's retention refuses to delete step 1
    mgr._janitor.join()
    call("refused", lambda: mgr.save(st, 3))
    mgr._janitor.join()
    if rank == 0:
        (root / checkpoint_name(1) / "notes.txt").unlink()
        real = prune_module.remove

        def failing(store, name, **options):
            prune_module.remove = real  # once
            raise OSError(errno.EIO, "Input/output error", name)

        prune_module.remove = failing
    mgr.save(st, 4)  # the warning of step 3's retention (step 1 still refused) is raised here
    mgr._janitor.join()
    call("oserror", lambda: mgr.maybe_save(st, 5))  # no policy: nothing saved, the outcome agreed
    call("after", lambda: mgr.save(st, 6))
    mgr._janitor.join()
    if rank == 0:
        prune_module.remove = failing  # step 6's deletion, chosen by the last save's retention, fails
    mgr.save(st, 7)
    call("close", mgr.close)  # no later call: close warns it, on every rank
    dist.barrier()
    out["steps"] = sorted(os.listdir(root))
    return out
