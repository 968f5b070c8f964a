"""The study's disk use: every checkpoint is counted, then deleted once measured, and the report
states the bytes written (resurgo.study.workers.disk, experiments.run_study, report)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from resurgo.study import experiments
from resurgo.study.experiments import quick_config, run_study
from resurgo.study.mechanisms import MECHANISMS
from resurgo.study.report import _human_bytes as human
from resurgo.study.report import render_markdown
from resurgo.study.workers.disk import Ledger, NewFiles, tree_bytes


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _files_under(path: Path) -> list[Path]:
    return sorted(f for f in Path(path).rglob("*") if f.is_file()) if path.exists() else []


def test_a_study_counts_every_checkpoint_and_leaves_none_behind(tmp_path: Path, monkeypatch):
    # one synchronous mechanism writing a file, one asynchronous writing a folder
    cfg = quick_config(models=("vgg16",), mechanisms=("torch_save", "resurgo_async"), width=2, samples=8,
                       cost_steps=2, checkpoint_every=1, cost_repeats=2, det_steps=2, det_restart=1, scale_worlds=())
    work = tmp_path / "checkpoints"
    saved: list[Path] = []  # every path a mechanism saved to, in order
    pending: set[Path] = set()  # saved, not yet deleted
    at_removal: list[tuple[Path, int]] = []  # each save's bytes, measured by this test as it is deleted
    loaded: list[str] = []
    real_make, real_remove = experiments.make_mechanism, experiments.remove

    def make(name: str):
        mech = real_make(name)
        save, load = mech.save, mech.load

        def spy_save(job, path):
            assert Path(path) not in pending  # the same path is saved again only once deleted
            saved.append(Path(path))
            pending.add(Path(path))
            return save(job, path)

        def spy_load(job, path):
            if Path(path).parent.name == "vgg16":  # a determinism checkpoint: still there when needed
                assert _files_under(Path(path)), f"{path} was deleted before its restart loaded it"
                loaded.append(name)
            return load(job, path)

        mech.save, mech.load = spy_save, spy_load
        return mech

    def remove(path: Path) -> None:
        if Path(path) in pending:
            pending.remove(Path(path))
            at_removal.append((Path(path), _bytes_under(path)))
        real_remove(path)

    restarts: list[str] = []

    def progress(done: int, total: int, label: str) -> None:
        # each unit starts with nothing on disk but the determinism checkpoints not yet restarted
        left = {f.relative_to(work).parts[:3] for f in _files_under(work)}
        pending = cfg.mechanisms[cfg.mechanisms.index(label.rsplit(" ", 1)[1]):] if "restart with" in label else ()
        assert left == {("det", "vgg16", name) for name in pending}, (label, left)
        restarts.extend(pending[:1])

    monkeypatch.setattr(experiments, "make_mechanism", make)
    monkeypatch.setattr(experiments, "remove", remove)
    results = run_study(cfg, tmp_path, on_progress=progress)

    assert restarts == loaded == list(cfg.mechanisms)  # every restart loaded its checkpoint, present
    assert not pending and len(at_removal) == len(saved)  # every save deleted, once measured
    assert len(saved) == 2 * 2 * (2 + 1) + 2  # 2 repeats x (2 checkpoints + 1 saved alone) + determinism
    disk = results["disk"]
    kind = lambda p: "cost" if p.name.startswith("step_") else "formats" if p.name == "alone" else "determinism"  # noqa: E731
    assert disk["written"] == {k: sum(n for p, n in at_removal if kind(p) == k) for k in ("cost", "formats",
                                                                                         "determinism")}
    assert disk["total"] == sum(n for _, n in at_removal) == sum(disk["written"].values()) > 0
    # the most at once: a cost run's two checkpoints, or the determinism checkpoints
    runs = [at_removal[i][1] + at_removal[i + 1][1] for i, (p, _) in enumerate(at_removal)
            if kind(p) == "cost" and i % 3 == 0]
    assert disk["peak"] == max(disk["written"]["determinism"], *runs)
    assert not work.exists()
    json.dumps(results, allow_nan=False)

    report = render_markdown(results)
    section = report[report.index("## Disk: bytes written"):]
    row = next(ln for ln in section.splitlines() if ln.startswith("| PyTorch |"))
    assert re.split(r"\s*\|\s*", row.strip("| ")) == [
        "PyTorch", human(disk["written"]["cost"]), human(disk["written"]["formats"]),
        human(disk["written"]["determinism"]), "0 B", human(disk["total"]), human(disk["peak"])]


def test_new_files_counts_overwrites_and_skips_files_being_written(tmp_path: Path):
    look = NewFiles(tmp_path / "ckpt")
    assert look.look() == 0  # nothing yet
    (tmp_path / "ckpt" / "1.orbax-checkpoint-tmp-5").mkdir(parents=True)
    (tmp_path / "ckpt" / "1.orbax-checkpoint-tmp-5" / "data").write_bytes(b"x" * 10)
    assert look.look() == 0  # still being written
    (tmp_path / "ckpt" / "1.orbax-checkpoint-tmp-5").rename(tmp_path / "ckpt" / "1")
    assert look.look() == 10 and look.look() == 0  # counted once, under its final name
    (tmp_path / "ckpt" / "m.npz.tmp").write_bytes(b"y" * 7)
    (tmp_path / "ckpt" / "m.npz.tmp").replace(tmp_path / "ckpt" / "m.npz")
    (tmp_path / "ckpt" / "m2.npz").write_bytes(b"y" * 3)
    assert look.look() == 10
    (tmp_path / "ckpt" / "m.npz.tmp").write_bytes(b"z" * 7)  # the same name and size, overwritten
    (tmp_path / "ckpt" / "m.npz.tmp").replace(tmp_path / "ckpt" / "m.npz")
    assert look.look() == 7
    assert tree_bytes(tmp_path / "ckpt") == 20 and tree_bytes(tmp_path / "none") == 0
    ledger = Ledger(tmp_path)
    ledger.add("cost", 5)
    ledger.wrote("cost", tmp_path / "ckpt" / "1")
    ledger.observe()
    ledger.observe(3)
    assert ledger.summary() == {"written": {"cost": 15}, "total": 15, "peak": 20}


def test_bytes_no_ledger_saw_are_not_counted_not_zero():
    """Another framework's scale processes write and delete their checkpoints themselves: their
    bytes are "not counted" (not 0 B), and the sums they miss say "at least"."""
    from resurgo.study.report import _disk_section

    gib = 1 << 30
    ledger = {"written": {"cost": 3 * gib, "formats": gib, "determinism": gib}, "total": 5 * gib, "peak": gib // 4}
    results = {"disk": {"written": {"cost": 8 * gib, "formats": 2 * gib, "determinism": gib, "scale": 4 * gib},
                        "total": 15 * gib, "peak": gib},
               "frameworks": {"jax": {"label": "JAX/Orbax", "ran": True, "disk": ledger,
                                      "scale": "ran on 1, 2 processes (gloo)"},
                              "chainer": {"label": "Chainer", "ran": True, "disk": ledger,
                                          "scale": "could not run on 2 processes: boom"}}}
    rows = [ln for ln in "".join(_disk_section(results)).splitlines() if ln.startswith("| ") and "---" not in ln]
    assert rows[1:] == [
        "| PyTorch | 8.00 GiB | 2.00 GiB | 1.00 GiB | 4.00 GiB | 15.00 GiB | 1.00 GiB |",
        "| JAX/Orbax | 3.00 GiB | 1.00 GiB | 1.00 GiB | not counted | at least 5.00 GiB | 256.00 MiB |",
        "| Chainer | 3.00 GiB | 1.00 GiB | 1.00 GiB | 0 B | 5.00 GiB | 256.00 MiB |",
        "| all | 14.00 GiB | 4.00 GiB | 3.00 GiB | at least 4.00 GiB | at least 25.00 GiB | 1.00 GiB |"]
    del results["frameworks"]["jax"]
    assert "not counted" not in "".join(_disk_section(results)) and "at least" not in "".join(_disk_section(results))
