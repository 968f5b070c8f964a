"""``resurgo study``: reproduce the checkpointing study (:mod:`resurgo.study`) and write its report."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from resurgo.cli.app import fail_cleanly
from resurgo.cli.render import console as make_console
from resurgo.errors import CheckpointNotFoundError, storage_error

if TYPE_CHECKING:  # the study (torch, models) is imported only when it runs
    from resurgo.study.experiments import StudyConfig


@contextlib.contextmanager
def terminated_as_exit() -> Iterator[None]:
    """Within it, SIGTERM raises SystemExit (status 143) in the main thread, as Ctrl-C raises
    KeyboardInterrupt: the study's ``finally`` clauses run, so the rank groups and framework
    processes it started are ended with it instead of training on, orphaned. (By default SIGTERM
    ends the process at once, cleanup included.)"""

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _names(text: Optional[str]) -> Optional[tuple[str, ...]]:
    return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())


def _check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and make sure a file can be written in it (StorageError if not)."""
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise storage_error(e, directory, "cannot write there", "choose another --out") from None


def _study_config(quick: bool, reference: bool, models: Optional[str], mechanisms: Optional[str], ranks: Optional[str],
                  width: Optional[int], threads: Optional[int], repeats: Optional[int], data: Optional[Path],
                  steps: Optional[int], frameworks: Optional[str], device: str = "cpu") -> StudyConfig:
    """The study's configuration: the preset, with each option given replacing its part."""
    from dataclasses import replace

    from resurgo.study.experiments import full_config, quick_config, with_steps
    from resurgo.study.reference import reference_config

    if quick and reference:
        raise typer.BadParameter("--quick and --reference are two presets: choose one")
    cfg = reference_config() if reference else quick_config() if quick else full_config()
    chosen_models = _names(models)
    if chosen_models is not None:
        cfg = replace(cfg, models=chosen_models,
                      scale_models=tuple(m for m in cfg.scale_models if m in chosen_models) or chosen_models[:1])
    chosen_mechanisms = _names(mechanisms)
    if chosen_mechanisms is not None:
        cfg = replace(cfg, mechanisms=chosen_mechanisms)
    if ranks is not None:
        try:
            cfg = replace(cfg, scale_worlds=tuple(int(n) for n in _names(ranks) or ()))
        except ValueError:
            raise typer.BadParameter(f"--ranks takes comma-separated integers, got {ranks!r}") from None
    if width is not None:
        cfg = replace(cfg, width=width)
    cfg = replace(cfg, device=device)
    if threads is not None:
        cfg = replace(cfg, threads=threads)
    if repeats is not None:
        cfg = replace(cfg, cost_repeats=repeats)
    if data is not None:
        cfg = replace(cfg, data_dir=str(data))
    if steps is not None:
        cfg = with_steps(cfg, steps)
    if frameworks is not None:
        cfg = replace(cfg, frameworks=tuple(n for n in _names(frameworks) or () if n != "pytorch"))
    return cfg


def study(
    quick: bool = typer.Option(False, "--quick", help="The published networks at full width, batch 2, a few steps: minutes on 2 cores."),
    reference: bool = typer.Option(False, "--reference", help="The reference report's preset: the published networks, "
                                   "all four frameworks, the scale experiment, a 97% interval per overhead; estimated at "
                                   "80-100 minutes on 2 cores. Resumable: run the same command again after a kill."),
    restart: bool = typer.Option(False, "--restart", help="Measure everything again, discarding the units of "
                                 "measurement an earlier run recorded in --out (its study-journal)."),
    out: Path = typer.Option(Path("study-results"), "--out", metavar="DIR", help="Directory for report.md, the plots, results.json."),
    data: Optional[Path] = typer.Option(None, "--data", metavar="DIR", help="A local CIFAR-10 python copy (data_batch_1..5) "
                                        "instead of synthetic data."),
    models: Optional[str] = typer.Option(None, "--models", metavar="NAMES", help="Comma-separated: resnet50,vgg16."),
    mechanisms: Optional[str] = typer.Option(None, "--mechanisms", metavar="NAMES", help="Comma-separated, default all: "
                                             "torch_save,dcp,dcp_async,safetensors,resurgo,resurgo_async,"
                                             "resurgo_async_guard."),
    ranks: Optional[str] = typer.Option(None, "--ranks", metavar="COUNTS", help="Comma-separated rank counts for the scale "
                                        "experiment (default 1,2,4; empty to skip it)."),
    width: Optional[int] = typer.Option(None, "--width", metavar="N", help="Channels of the first stage (64 = published)."),
    steps: Optional[int] = typer.Option(None, "--steps", metavar="N", help="Steps per training run (>= 4)."),
    repeats: Optional[int] = typer.Option(None, "--repeats", metavar="N", help="Pairs of runs (without, with checkpoints) per "
                                          "mechanism in the cost and scale experiments, at least 2 (default 3)."),
    threads: Optional[int] = typer.Option(None, "--threads", metavar="N", help="torch threads of the study process (default 1)."),
    frameworks: Optional[str] = typer.Option(None, "--frameworks", metavar="NAMES", help="Comma-separated frameworks beside "
                                             "PyTorch (which always runs): tensorflow,jax,chainer. Each runs in its own "
                                             "pinned virtualenv, created on first use (needs PyPI) and cached."),
    device: str = typer.Option("cpu", "--device", metavar="DEVICE", help="Where PyTorch trains: cpu, or cuda (the "
                               "published setting with the full preset; scale rank r on GPU r modulo the GPUs). "
                               "TensorFlow, JAX and Chainer run on the CPU."),
    envs: Optional[Path] = typer.Option(None, "--envs", metavar="DIR", help="Where the frameworks' virtualenvs are cached "
                                        "(default $RESURGO_STUDY_ENVS, else ~/.cache/resurgo/study-envs)."),
) -> None:
    """Reproduce the checkpointing study (cost, formats and sizes, scale, determinism) with ResNet-50
    and VGG-16 on CIFAR-10-shaped data, for torch.save, DCP, safetensors and resurgo."""
    from rich.progress import TimeElapsedColumn

    from resurgo.study.experiments import run_study
    from resurgo.study.report import REPORT, require_matplotlib, write_outputs

    with fail_cleanly():
        require_matplotlib()  # before minutes of training, not after
        cfg = _study_config(quick, reference, models, mechanisms, ranks, width, threads, repeats, data, steps, frameworks, device)
        cfg.check()
        if data is not None and not data.is_dir():
            raise CheckpointNotFoundError(f"{data}: no such directory (--data takes a local CIFAR-10 python copy, "
                                          "data_batch_1..5)")
        _check_writable(out)  # before anything is drawn or trained
        console = make_console()
        from rich.progress import BarColumn, Progress, TextColumn

        columns = (TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("starting", total=None)

            def on_progress(done: int, total: int, label: str) -> None:
                progress.update(task, completed=done, total=total, description=label)

            with terminated_as_exit():
                results = run_study(cfg, out, on_progress, envs, restart)
        write_outputs(results, out)
    console.print(f"study done in {results['duration_s']:.0f} s: {escape(str(out / REPORT))}")
    if results["journal"]["units_replayed"]:
        console.print(f"  {results['journal']['units_replayed']} units of measurement were recorded by an earlier "
                      f"run ({escape(results['journal']['path'])}) and not measured again; --restart measures them again")
    for fw in results["frameworks"].values():
        if not fw["ran"]:
            console.print(f"  {escape(fw['label'])} could not run: {escape(fw['why'])}")
    for model, det in results["determinism"].items():
        diffs = ", ".join(f"{name} {r['max_abs_diff']:.3g}" for name, r in det["restarts"].items())
        console.print(f"  {model}: largest loss difference after restart: {escape(diffs)}")
