"""The study (resurgo.study, ``resurgo study``): a reduced run end to end through the CLI, checked
for the report's structure, the plots, the raw results and the determinism results; plus the
networks, the mechanisms' round trips, the CIFAR-10 reader and the option errors."""

from __future__ import annotations

import json
import pickle
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from helpers import bits_equal
from test_study_frameworks import CONFIG as TOY_CONFIG
from test_study_frameworks import Toy
from resurgo.cli import app
from resurgo.errors import ResurgoError, StudyError
from resurgo.study.data import load_cifar10, synthetic_cifar10
from resurgo.study.experiments import StudyConfig, quick_config
from resurgo.study.frameworks import could_not_run, merge_framework
from resurgo.study.mechanisms import MECHANISMS, make_mechanism, quiet_single_process
from resurgo.study.models import ResNet50, VGG16
from resurgo.study.report import (
    cost_figure, curve_groups, determinism_figure, render_markdown, require_matplotlib, scale_figure,
)
from resurgo.study.stats import coverage, median_interval, paired_overhead
from resurgo.study.training import JobSpec, Training, build_training, tensor_bytes, train_steps
from resurgo.study.workers import driver

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SECTIONS = ("## 1. Cost of checkpointing (Table I)", "## 2. Formats and sizes (Table II)",
            "## 3. Scale (Table III)", "## 4. Determinism (Figures 2 and 3)")
FULL_STATE = ("torch_save", "dcp", "dcp_async")  # model + optimizer, no RNG, no data position
RESURGO = ("resurgo", "resurgo_async", "resurgo_async_guard")


def _section_tables(report: str) -> dict[str, list[list[str]]]:
    """The data rows of the first Markdown table under each section heading."""
    tables: dict[str, list[list[str]]] = {}
    for i, heading in enumerate(SECTIONS):
        start = report.index(heading)
        following = report.find("\n## ", start + 1)  # the sections after the four (findings, machine)
        end = following if following >= 0 else len(report)
        lines = [ln for ln in report[start:end].splitlines() if ln.startswith("|")]
        tables[heading] = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return tables


@pytest.fixture(scope="module")
def study_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("study")
    result = runner.invoke(app, ["study", "--quick", "--out", str(out), "--width", "2", "--steps", "6",
                                 "--ranks", "2", "--repeats", "2"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_report_has_the_four_tables_and_the_plots(study_out: Path):
    report = (study_out / "report.md").read_text()
    tables = _section_tables(report)
    models, mechs = ("ResNet-50", "VGG-16"), [MECHANISMS[n].label for n in MECHANISMS]
    # Table I, II and the determinism table: one row per model and mechanism, in order
    for heading in (SECTIONS[0], SECTIONS[1], SECTIONS[3]):
        assert [(r[0], r[1]) for r in tables[heading]] == [(m, x) for m in models for x in mechs], heading
    # Table III: VGG-16 (the quick preset's scale model) on 2 ranks, global batch 2 x 2
    assert [(r[0], r[1], r[2], r[3]) for r in tables[SECTIONS[2]]] == [("VGG-16", "2", "4", x) for x in mechs]
    assert "share this machine's" in report
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert images == ["fig1_cost_overhead.png", "fig4_scale_overhead.png", "fig2_determinism_resnet50.png",
                      "fig3_determinism_vgg16.png"]
    for name in images:
        data = (study_out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, name
    assert not (study_out / "checkpoints").exists()  # every checkpoint removed once measured


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_results_json_has_every_mechanism(study_out: Path):
    results = json.loads((study_out / "results.json").read_text())
    names = list(MECHANISMS)
    for model in ("resnet50", "vgg16"):
        assert [r["mechanism"] for r in results["cost"] if r["model"] == model] == names
        assert [r["mechanism"] for r in results["formats"] if r["model"] == model] == names
        assert list(results["determinism"][model]["restarts"]) == names
        assert len(results["determinism"][model]["reference"]) == 6
    assert [r["mechanism"] for r in results["scale"]] == names
    for row in results["cost"]:
        assert row["repeats"] == row["pairs"] == len(row["runs"]) == 2
        assert row["checkpoints"] == 6 and len(row["stall_s"]) == 12  # --steps 6: one every step, twice
    for row in results["scale"]:
        assert row["repeats"] == 2 and row["checkpoints"] == 3 and len(row["stall_s"]) == 6  # 3 steps, one every 1
        assert all(r["seconds"] > 0 for r in row["runs"])
    disk = results["disk"]  # every experiment's checkpoints counted, the scale's by its rank 0
    assert sorted(disk["written"]) == ["cost", "determinism", "formats", "scale"] and min(disk["written"].values()) > 0
    assert disk["total"] == sum(disk["written"].values()) and 0 < disk["peak"] < disk["total"]


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_every_overhead_has_an_interval_from_its_pairs(study_out: Path):
    results = json.loads((study_out / "results.json").read_text())
    for row in results["cost"] + results["scale"]:
        diffs = sorted(r["seconds"] - r["baseline_s"] for r in row["runs"])  # the same repetition, paired
        assert (row["extra_low_s"], row["extra_high_s"]) == (diffs[0], diffs[-1])  # 2 pairs: [min, max]
        assert row["extra_s"] == (diffs[0] + diffs[1]) / 2
        base = row["baseline"]["median"]
        assert row["overhead_pct"] == 100.0 * row["extra_s"] / base  # derivable from the columns shown
        assert row["overhead_low_pct"] <= row["overhead_pct"] <= row["overhead_high_pct"]
        assert row["noise"] == (diffs[0] <= 0.0 <= diffs[-1]) and row["coverage"] == 0.5
        for timing in ("baseline", "with_ckpt", "stall"):
            assert row[timing]["min"] <= row[timing]["median"] <= row[timing]["max"], timing
    for row in results["formats"]:
        assert row["save"]["n"] == row["load"]["n"] == 2
    # the report shows each overhead with its interval, and the mark where the interval holds 0
    report = (study_out / "report.md").read_text()
    tables = _section_tables(report)
    for heading, rows in ((SECTIONS[0], results["cost"]), (SECTIONS[2], results["scale"])):
        for line, row in zip(tables[heading], rows, strict=True):
            cell = line[-1]
            assert cell.startswith(f"{row['overhead_pct']:+.1f} [{row['overhead_low_pct']:+.1f}, "
                                   f"{row['overhead_high_pct']:+.1f}]"), cell
            assert cell.endswith("not distinguishable from noise") == row["noise"], cell
            assert line[-2] == f"{row['extra_s']:+.3f} [{row['extra_low_s']:+.3f}, {row['extra_high_s']:+.3f}]"


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_report_without_the_scale_experiment(study_out: Path):
    results = json.loads((study_out / "results.json").read_text())
    results["scale"] = []  # what `--ranks ""` produces
    report = render_markdown(results)
    scale_section = report[report.index(SECTIONS[2]):report.index(SECTIONS[3])]
    assert "Not run: no rank counts were given" in scale_section and "|" not in scale_section
    assert "fig4_scale_overhead.png" not in report


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_formats_sizes_match_the_state(study_out: Path):
    results = json.loads((study_out / "results.json").read_text())
    for row in results["formats"]:
        info = results["models"][row["model"]]
        full = info["model_state_bytes"] + info["optimizer_state_bytes"]
        expected_raw = info["model_state_bytes"] if row["mechanism"] == "safetensors" else full
        assert row["raw_tensor_bytes"] == expected_raw, row
        assert row["bytes"] > row["raw_tensor_bytes"], row  # every format adds its metadata
        assert row["size_over_raw"] == row["bytes"] / row["raw_tensor_bytes"]
    by_mech = {r["mechanism"]: r for r in results["formats"] if r["model"] == "vgg16"}
    assert by_mech["torch_save"]["file_names"] == ["checkpoint.pt"]
    assert by_mech["safetensors"]["file_names"] == ["model.safetensors"]
    assert ".metadata" in by_mech["dcp"]["file_names"]
    assert "manifest.json" in by_mech["resurgo"]["file_names"]
    assert {m: r["executes_code"] for m, r in by_mech.items()} == {
        "torch_save": "yes", "dcp": "yes", "dcp_async": "yes", "safetensors": "no", "resurgo": "no",
        "resurgo_async": "no", "resurgo_async_guard": "no"}


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_determinism_resurgo_exact_others_diverge(study_out: Path):
    results = json.loads((study_out / "results.json").read_text())
    for model, det in results["determinism"].items():
        ref = det["reference"][det["restart_step"]:]
        for name in RESURGO:
            r = det["restarts"][name]
            assert r["max_abs_diff"] == 0.0 and r["identical"] and r["losses"] == ref, (model, name)
        # no RNG, no data position: the restarted run draws other batches, flips and dropout masks
        for name in FULL_STATE + ("safetensors",):
            assert det["restarts"][name]["max_abs_diff"] > 0.0, (model, name)


def test_networks_have_the_published_sizes():
    assert sum(p.numel() for p in ResNet50().parameters()) == 23_520_842
    assert sum(p.numel() for p in VGG16().parameters()) == 14_990_922
    # width-reduced: every layer kept
    assert len(ResNet50(4).state_dict()) == len(ResNet50().state_dict())
    assert ResNet50(4)(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("name", [*MECHANISMS, "dcp_async_stager"])
def test_mechanism_round_trip(tmp_path: Path, name: str):
    data = synthetic_cifar10(32, seed=1)
    job = build_training(JobSpec("vgg16", 2, 4, seed=0), data)
    train_steps(job, 3)
    mech = make_mechanism(name)
    with quiet_single_process():  # DCP's async thread warns that it runs in a single process
        mech.save(job, tmp_path / "ck")
        mech.wait()
    fresh = build_training(JobSpec("vgg16", 2, 4, seed=5), data)
    step = mech.load(fresh, tmp_path / "ck")
    mech.close()
    assert bits_equal(fresh.model.state_dict(), job.model.state_dict())
    momentum_restored = bits_equal(fresh.optimizer.state_dict()["state"], job.optimizer.state_dict()["state"])
    assert momentum_restored == mech.stores.optimizer
    assert step == (None if name == "safetensors" else 3)


def test_a_job_without_a_loader_saves_no_rng_and_trains_no_step():
    """The benchmarks' job: their loop feeds fixed batches, so no loader, and no RNG to save."""
    job = Training(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), rng=False)
    assert sorted(job.state.state_dict()) == ["model", "optimizer", "step"]
    with pytest.raises(StudyError, match="train_steps: this job has no loader"):
        train_steps(job, 1)


SYNCHRONOUS = ("torch_save", "dcp", "safetensors", "resurgo")


@pytest.mark.parametrize("name", [*MECHANISMS, "dcp_async_stager"])
def test_save_returns_what_completes_it_and_syncs_once_when_asked(tmp_path: Path, name: str):
    """A benchmark times each save to durable: ``save`` returns None when the checkpoint is complete
    on return, else a callable that completes it; ``make_durable`` runs once on what the library
    wrote and left unsynced (resurgo commits durably itself)."""
    job = build_training(JobSpec("vgg16", 2, 4, seed=0), synthetic_cifar10(32, seed=1))
    train_steps(job, 1)
    synced: list[Path] = []
    mech = make_mechanism(name, synced.append)
    hooks = len(job.optimizer._optimizer_step_pre_hooks)
    with quiet_single_process():
        done = mech.save(job, tmp_path / "ck")
        assert (done is None) == (name in SYNCHRONOUS)
        if done is not None:
            done()
            # DCP with a reused stager (as resurgo with a guard) makes the next optimizer.step()
            # wait for its snapshot
            waits = name in ("dcp_async_stager", "resurgo_async_guard")
            assert len(job.optimizer._optimizer_step_pre_hooks) == hooks + waits
        mech.close()  # waits for the same save again: nothing more to sync
    assert synced == ([] if name in RESURGO else [tmp_path / "ck"])
    if name == "dcp_async_stager":  # closed: its hook is gone
        assert len(job.optimizer._optimizer_step_pre_hooks) == hooks
    assert mech.facts().keys() == {"resurgo": {"report"}, "resurgo_async": {"handle_stall_seconds"},
                                   "resurgo_async_guard": {"handle_stall_seconds"},
                                   "dcp_async_stager": {"stagers_made"}}.get(name, set())


def _write_cifar(root: Path, per_batch: int = 3) -> np.ndarray:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (5 * per_batch, 3072), dtype=np.uint8)
    for i in range(5):
        batch = {b"data": pixels[i * per_batch:(i + 1) * per_batch], b"labels": list(range(per_batch)),
                 b"batch_label": b"training batch"}
        (root / f"data_batch_{i + 1}").write_bytes(pickle.dumps(batch, protocol=2))
    return pixels


def test_cifar10_reader(tmp_path: Path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    pixels = _write_cifar(root)
    ds = load_cifar10(tmp_path, n=7)  # the parent directory is accepted too
    assert len(ds) == 7 and ds.images.shape == (7, 3, 32, 32) and ds.labels.tolist() == [0, 1, 2, 0, 1, 2, 0]
    first_red = torch.from_numpy(pixels[0, :1024].astype(np.float32)).reshape(32, 32) / 255
    assert torch.allclose(ds.images[0, 0], (first_red - 0.4914) / 0.2470)


class _RunsCode:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').touch()",))


def test_cifar10_reader_errors(tmp_path: Path, monkeypatch):
    with pytest.raises(StudyError, match=re.escape(f"{tmp_path}: no CIFAR-10 python batches found")):
        load_cifar10(tmp_path)
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({b"data": _RunsCode(), b"labels": []}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StudyError, match=r"data_batch_3: not a CIFAR-10 python batch .*refusing to load builtins.exec"):
        load_cifar10(tmp_path)
    assert not (tmp_path / "PWNED").exists()
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({b"data": np.zeros((2, 5), np.uint8), b"labels": [1, 2]}))
    with pytest.raises(StudyError, match=r"data_batch_3: expected b'data' of shape \(N, 3072\)"):
        load_cifar10(tmp_path)


def test_config_errors():
    with pytest.raises(StudyError, match="unknown model 'alexnet'; expected one of resnet50, vgg16"):
        quick_config(models=("alexnet",)).check()
    with pytest.raises(StudyError, match="unknown mechanism 'pickle'"):
        StudyConfig(mechanisms=("pickle",)).check()
    with pytest.raises(StudyError, match=r"0 < 8 < 8"):
        StudyConfig(det_steps=8, det_restart=8).check()
    assert issubclass(StudyError, ResurgoError)


def test_cli_bad_options_exit_2(tmp_path: Path):
    result = runner.invoke(app, ["study", "--models", "alexnet", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown model 'alexnet'" in result.output
    result = runner.invoke(app, ["study", "--quick", "--steps", "3", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--steps must be at least 4" in result.output
    result = runner.invoke(app, ["study", "--quick", "--frameworks", "pytorch,mxnet", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown framework 'mxnet'; expected pytorch or one of tensorflow, jax, chainer" in result.output
    assert list(tmp_path.iterdir()) == []  # nothing ran


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_report_puts_other_frameworks_beside_pytorch(study_out: Path, tmp_path: Path):
    results = json.loads((study_out / "results.json").read_text())
    worker = driver.run(Toy(keeps_rng=True), {**TOY_CONFIG, "models": ["vgg16"]}, tmp_path, progress=lambda label: None)
    merge_framework(results, "jax", worker)
    why = "Chainer environment /envs/chainer-0123456789ab: `pip install chainer==7.8.1` failed: ModuleNotFoundError: x"
    results["frameworks"]["chainer"] = could_not_run("chainer", why)
    report = render_markdown(results)
    tables = _section_tables(report)
    mechs = [MECHANISMS[n].label for n in MECHANISMS]
    # the framework's rows follow PyTorch's in Table I, II and the determinism table
    assert [(r[0], r[1]) for r in tables[SECTIONS[0]]] == [(m, x) for m in ("ResNet-50", "VGG-16") for x in mechs] + [
        ("VGG-16", "Toy save")]
    toy = results["cost"][-1]
    assert toy["framework"] == "jax" and toy["pairs"] == 3 and toy["coverage"] == 0.75
    assert tables[SECTIONS[0]][-1][-2] == f"{toy['extra_s']:+.3f} [{toy['extra_low_s']:+.3f}, {toy['extra_high_s']:+.3f}]"
    assert tables[SECTIONS[1]][-1][:4] == ["VGG-16", "Toy save", "JSON", "1"]
    assert tables[SECTIONS[3]][-1] == ["VGG-16", "Toy save", "yes", "yes", "yes", "0", "yes"]
    # the frameworks table: what ran, with versions, and the exact reason of what could not
    frameworks = report[report.index("## Frameworks and networks"):report.index(SECTIONS[0])]
    assert "| JAX/Orbax | toy 1.0 | ran (" in frameworks
    assert f"| Chainer | - | could not run: {why} | not run: the framework could not run |" in frameworks
    # each network's parameter count per framework
    vgg = f"{results['models']['vgg16']['parameters']:,}"
    assert f"| PyTorch | VGG-16 | {vgg} | {vgg} | 1.0000 | resurgo.study.models" in frameworks
    assert f"| JAX/Orbax | VGG-16 | 4 | {vgg} | " in frameworks and "| four floats |" in frameworks
    assert f"| JAX/Orbax (stock, not the shared architecture) | VGG-16 | 5 | {vgg} | " in frameworks
    assert f"| Chainer | ResNet-50 | - | {results['models']['resnet50']['parameters']:,} | - | could not run: {why} |" \
        in frameworks
    # Figure 1 draws the framework's bar and interval beside PyTorch's
    plt = require_matplotlib()
    fig = cost_figure(plt, results)
    assert len(fig.axes[1].collections[0].get_segments()) == len(MECHANISMS) + 1
    plt.close(fig)


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_figure1_has_error_bars_and_marks_noise(study_out: Path):
    results = json.loads((study_out / "results.json").read_text())
    results["cost"][0].update(overhead_pct=5.0, overhead_low_pct=-1.0, overhead_high_pct=9.0, noise=True)
    results["cost"][1].update(overhead_pct=20.0, overhead_low_pct=12.0, overhead_high_pct=30.0, noise=False)
    plt = require_matplotlib()
    fig = cost_figure(plt, results)
    ax = fig.axes[0]
    bars = ax.patches
    segments = ax.collections[0].get_segments()  # one error bar per mechanism, low to high
    assert [tuple(seg[:, 0]) for seg in segments[:2]] == [(-1.0, 9.0), (12.0, 30.0)]
    assert len(segments) == len(MECHANISMS)
    assert bars[0].get_hatch() == "//" and bars[1].get_hatch() is None
    assert "not distinguishable from noise" in [t.get_text() for t in ax.get_legend().get_texts()][-1]
    plt.close(fig)


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_figure4_blocked_time_against_ranks(study_out: Path):
    results = json.loads((study_out / "results.json").read_text())
    plt = require_matplotlib()
    fig = scale_figure(plt, results)
    ax = fig.axes[0]
    assert ax.get_ylabel().startswith("time blocked per checkpoint")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [MECHANISMS[n].label for n in MECHANISMS]
    assert len(ax.containers) == len(MECHANISMS)
    for container, name in zip(ax.containers, MECHANISMS):  # one line per mechanism, a point per rank count
        rows = sorted((r for r in results["scale"] if r["mechanism"] == name), key=lambda r: r["ranks"])
        assert list(container.lines[0].get_ydata()) == [r["stall"]["median"] for r in rows]
        segments = container.lines[2][0].get_segments()  # each error bar spans the blocked time's interval
        spans = [float(v) for seg in segments for v in seg[:, 1]]
        assert spans == pytest.approx([v for r in rows for v in r["stall_interval"][:2]])
    plt.close(fig)


@pytest.mark.bench  # a quick study end to end: make test runs it after the default suite
def test_determinism_plot_says_which_curves_overlap(study_out: Path):
    det = json.loads((study_out / "results.json").read_text())["determinism"]["vgg16"]
    groups = curve_groups(det)
    resurgo_labels = [MECHANISMS[n].label for n in RESURGO]
    assert (resurgo_labels, det["reference"][det["restart_step"]:], True) in groups
    assert sum(len(labels) for labels, _, _ in groups) == len(MECHANISMS)
    plt = require_matplotlib()
    fig = determinism_figure(plt, det)
    top = fig.axes[0]
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert f"{', '.join(resurgo_labels)}: identical to the uninterrupted run (drawn on it)" in legend
    assert len(top.lines) == 2 + len(groups)  # the uninterrupted run, the restart line, each curve once
    assert "3 restarted curves identical to the uninterrupted one" in top.get_title()
    plt.close(fig)


def test_quick_checkpoints_the_published_networks():
    cfg = quick_config()
    # full width: ResNet-50's weights and momentum are 2 x 23.5 M floats (188 MiB) per checkpoint,
    # far above a step's noise at batch 2; each run checkpoints twice; 3 pairs per mechanism
    assert cfg.width == 64 and cfg.batch_size == 2
    assert sum(p.numel() for p in ResNet50(cfg.width).parameters()) == 23_520_842
    assert cfg.cost_steps // cfg.checkpoint_every == 2 and cfg.cost_repeats == 3
    assert cfg.scale_models == ("vgg16",) and cfg.scale_worlds == (1, 2, 4)


def test_median_interval_known_values():
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)  # 3 values: [min, max], 75%
    assert coverage(6, 1) == 1 - 2 / 64 and median_interval(range(6))[:2] == (0, 5)
    low, high, cover = median_interval(range(20))
    assert (low, high) == (5, 14) and cover >= 0.95 and coverage(20, 7) < 0.95
    with pytest.raises(StudyError, match="got 2 and 3"):
        paired_overhead([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(StudyError, match="at least 2 repeats"):
        quick_config(cost_repeats=1).check()


times = st.floats(min_value=0.01, max_value=100.0, allow_nan=False)


@given(st.lists(st.floats(min_value=-1e3, max_value=1e3), min_size=1, max_size=40))
def test_interval_holds_the_median(values):
    low, high, cover = median_interval(values)
    assert low <= statistics.median(values) <= high
    assert min(values) <= low and high <= max(values)
    assert cover >= 0.95 or (low, high) == (min(values), max(values))


@given(st.lists(times, min_size=1, max_size=12))
def test_identical_pairs_are_noise(without):
    row = paired_overhead(without, list(without))
    assert row["extra_s"] == row["extra_low_s"] == row["extra_high_s"] == 0.0
    assert row["overhead_pct"] == 0.0 and row["noise"]


@given(st.lists(st.tuples(times, times), min_size=1, max_size=12), st.randoms())
def test_overhead_ignores_the_order_of_the_pairs(pairs, rnd):
    shuffled = list(pairs)
    rnd.shuffle(shuffled)
    a = paired_overhead([p[0] for p in pairs], [p[1] for p in pairs])
    b = paired_overhead([p[0] for p in shuffled], [p[1] for p in shuffled])
    assert a == b


@given(st.lists(st.tuples(times, times), min_size=1, max_size=12), st.floats(min_value=0.5, max_value=10.0))
def test_a_cost_above_the_noise_is_distinguishable(pairs, cost):
    # every run with checkpoints slower than its pair by more than 0: the interval excludes 0
    row = paired_overhead([b for b, _ in pairs], [b + cost + abs(w - b) for b, w in pairs])
    assert not row["noise"] and row["extra_low_s"] > 0 and row["overhead_low_pct"] > 0


def test_tensor_bytes_counts_nested_state():
    state = {"a": torch.zeros(3, dtype=torch.float64), "b": [torch.zeros(2, dtype=torch.int8), 5], "c": "x"}
    assert tensor_bytes(state) == 3 * 8 + 2
