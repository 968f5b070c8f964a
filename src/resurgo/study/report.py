"""The study's output: ``results.json`` (everything measured), the PNG plots and ``report.md``
(the paper's Tables I-III and Figures 2-3 in Markdown, the plots embedded).

This module owns rendering only: it reads the results dict that ``experiments.run_study``
returns (or that ``results.json`` holds) and measures nothing. Plots use matplotlib's
non-interactive Agg backend; matplotlib is the ``study`` extra (``pip install 'resurgo[study]'``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from resurgo.errors import StudyError
from resurgo.study.findings import closing_sections, section_findings
from resurgo.study.machine import machine_section
from resurgo.study.models import LABELS
from resurgo.wording import plural

__all__ = ["write_outputs", "render_markdown", "render_frameworks", "require_matplotlib", "COST_PLOT", "SCALE_PLOT",
           "determinism_plot_name", "cost_figure", "scale_figure", "determinism_figure", "curve_groups"]

COST_PLOT = "fig1_cost_overhead.png"
SCALE_PLOT = "fig4_scale_overhead.png"
RESULTS = "results.json"
REPORT = "report.md"


def determinism_plot_name(index: int, model: str) -> str:
    """Figure 2 is the first model's loss curves, Figure 3 the second's (the paper's numbering)."""
    return f"fig{index + 2}_determinism_{model}.png"


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend, or a StudyError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise StudyError("the study's plots need matplotlib: pip install 'resurgo[study]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# -- formatting -------------------------------------------------------------------------------
def _human_bytes(n: float) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _spread(sp: dict) -> str:
    """A timing as median [min, max]."""
    return f"{_s(sp['median'])} [{_s(sp['min'])}, {_s(sp['max'])}]"


def _overhead(r: dict) -> str:
    """An overhead in percent with its interval, marked when the interval holds 0."""
    text = f"{r['overhead_pct']:+.1f} [{r['overhead_low_pct']:+.1f}, {r['overhead_high_pct']:+.1f}]"
    return text + (" not distinguishable from noise" if r["noise"] else "")


def _extra(r: dict) -> str:
    return f"{r['extra_s']:+.3f} [{r['extra_low_s']:+.3f}, {r['extra_high_s']:+.3f}]"


def _blocked(r: dict) -> str:
    return _spread(r["stall"]) if r["stall"] else "-"


def _coverage_note(rows: list[dict]) -> str:
    covers = sorted({f"{100 * r['coverage']:.0f}%" for r in rows})
    pairs = sorted({r["pairs"] for r in rows})
    return (f"Intervals of the overhead: order statistics of the {'/'.join(map(str, pairs))} paired differences, "
            f"which hold the true median difference with probability {'/'.join(covers)} whatever the noise's "
            "distribution (95% needs at least 6 pairs; below that the interval is [min, max]).")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _device(cfg: dict, env: dict) -> str:
    """Where PyTorch trained: the CPU, or the GPU by name (the other frameworks run on the CPU)."""
    if cfg.get("device", "cpu") == "cpu":
        return "the CPU"
    return f"{env.get('gpu') or 'a CUDA GPU'} (TensorFlow, JAX and Chainer on the CPU)"


def _model(name: str) -> str:
    return LABELS.get(name, name)


# -- plots ------------------------------------------------------------------------------------
def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cost_figure(plt: Any, results: dict) -> Any:
    """Figure 1: each mechanism's overhead, an error bar for its interval; bars whose interval
    holds 0 are hatched and named so in the legend."""
    from matplotlib.patches import Patch

    models = list(results["determinism"]) or sorted({r["model"] for r in results["cost"]})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results["cost"] if r["model"] == model]
        pct = [r["overhead_pct"] for r in rows]
        err = [[p - r["overhead_low_pct"] for p, r in zip(pct, rows)], [r["overhead_high_pct"] - p for p, r in zip(pct, rows)]]
        bars = ax.barh([r["label"] for r in rows], pct, xerr=err, capsize=4, color="tab:blue",
                       error_kw={"elinewidth": 1.2})
        for bar, r in zip(bars, rows):
            if r["noise"]:
                bar.set(facecolor="white", edgecolor="tab:blue", hatch="//")
        handles = [Patch(color="tab:blue", label="overhead: median of the pairs, bar: its interval")]
        if any(r["noise"] for r in rows):
            handles.append(Patch(facecolor="white", edgecolor="tab:blue", hatch="//",
                                 label="interval holds 0: not distinguishable from noise"))
        ax.axvline(0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel(f"overhead of checkpointing every {rows[0]['every']} steps (%)" if rows else "overhead (%)")
        ax.set_title(_model(model))
        ax.legend(handles=handles, fontsize=7)
    return fig


def scale_figure(plt: Any, results: dict) -> Any:
    """Figure 4: time blocked per checkpoint against ranks, one line per mechanism (median, bars
    from the interval), the lines nudged apart sideways so that their bars do not hide each other."""
    models = sorted({r["model"] for r in results["scale"]})
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(7 * max(1, len(models)), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in results["scale"] if r["model"] == model and r["stall"]]
        mechs = list(dict.fromkeys(r["mechanism"] for r in rows))
        for i, mech in enumerate(mechs):
            pts = sorted((r["ranks"], r) for r in rows if r["mechanism"] == mech)
            nudge = 1.0 + 0.04 * (i - (len(mechs) - 1) / 2)  # x is logarithmic: nudge by a factor
            xs = [n * nudge for n, _ in pts]
            med = [r["stall"]["median"] for _, r in pts]
            err = [[m - r["stall_interval"][0] for m, (_, r) in zip(med, pts)],
                   [r["stall_interval"][1] - m for m, (_, r) in zip(med, pts)]]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=pts[0][1]["label"])
        worlds = sorted({r["ranks"] for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.minorticks_off()
        ax.set_xlabel("data-parallel ranks (processes sharing this machine)")
        ax.set_ylabel("time blocked per checkpoint (s), median and interval")
        ax.set_title(_model(model))
        ax.legend(fontsize=7)
    return fig


def curve_groups(det: dict) -> list[tuple[list[str], list[float], bool]]:
    """The restarted runs grouped by identical loss curves: (labels, losses, identical to the
    uninterrupted run), in the order of their first mechanism."""
    groups: dict[tuple[float, ...], list[str]] = {}
    for r in det["restarts"].values():
        groups.setdefault(tuple(r["losses"]), []).append(r["label"])
    ref = det["reference"][det["restart_step"]:]
    return [(labels, list(losses), list(losses) == ref) for losses, labels in groups.items()]


def _curve_label(labels: list[str], identical: bool) -> str:
    text = ", ".join(labels)
    if identical:
        return f"{text}: identical to the uninterrupted run (drawn on it)"
    return f"{text}: identical curves (overlap)" if len(labels) > 1 else text


def determinism_figure(plt: Any, det: dict) -> Any:
    """Figures 2-3: the loss after restart per mechanism; curves that are identical are drawn once,
    and the legend and title say which overlap."""
    ref = det["reference"]
    k = det["restart_step"]
    steps = list(range(1, len(ref) + 1))
    after = steps[k:]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(steps, ref, color="black", linewidth=2.5, label="uninterrupted")
    groups = curve_groups(det)
    for labels, losses, identical in groups:
        style = ":" if identical else "--"
        label = _curve_label(labels, identical)
        top.plot(after, losses, linestyle=style, linewidth=1.6 if identical else 1.2, label=label)
        bottom.plot(after, [abs(a - b) for a, b in zip(losses, ref[k:])], marker=".", linestyle=style, label=label)
    for ax in (top, bottom):
        ax.axvline(k, color="grey", linestyle=":", linewidth=1)
    same = [lab for labels, _, identical in groups if identical for lab in labels]
    title = f"{_model(det['model'])}: restart from the checkpoint of step {k}"
    if same:
        title += f"\n{plural(len(same), 'restarted curve')} identical to the uninterrupted one, drawn on it"
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=7)
    bottom.set_ylabel("|loss - uninterrupted loss|")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=7)
    return fig


# -- the report -------------------------------------------------------------------------------
PYTORCH_NETS = {"resnet50": "CIFAR-10 variant (3x3 stem, no max-pool)",
                "vgg16": "CIFAR-10 variant (batch norm, 512-512-10 classifier, dropout)"}


def render_frameworks(results: dict) -> str:
    """The frameworks beside PyTorch: versions, what ran or why not, each network's parameter
    count per framework beside PyTorch's (stock networks as extra rows), and how scale ran or why not."""
    frameworks = results.get("frameworks", {})
    out = ["## Frameworks and networks\n",
           "PyTorch runs in this process; each other framework runs the same experiments (Tables I, II and the "
           "determinism table) in its own virtualenv with pinned versions, created on first use and cached "
           "(`--envs`), on synthetic CIFAR-10-shaped data, with the same batch size, steps, checkpoint interval "
           "and SGD with momentum. Its rows are named by framework in the tables below.\n"]
    rows = [["PyTorch", f"torch {results['environment']['torch']}", "ran",
             "ran" if results["scale"] else "not run: no rank counts were given"]]
    for fw in frameworks.values():
        versions = ", ".join(f"{k} {v}" for k, v in fw.get("versions", {}).items())
        status = f"ran ({fw['duration_s']:.0f} s)" if fw["ran"] else f"could not run: {fw['why']}"
        rows.append([fw["label"], versions or "-", status, fw["scale"]])
    out.append(_table(["framework", "versions", "cost, formats, determinism", "scale"], rows) + "\n")
    out.append("Every framework trains the same two networks, PyTorch's CIFAR-10 definitions written layer for "
               "layer in its own layers. *Parameters* are trainable ones, counted as PyTorch's `parameters()` "
               "counts them (batch norm's scale and shift, not its running statistics); *ratio* is a framework's "
               "count over PyTorch's. A framework's own stock network is listed as an extra row: it is another "
               "architecture, and nothing in the tables below uses it.\n")
    out.append(_table(["framework", "model", "parameters", "PyTorch's", "ratio", "definition"],
                      _architecture_rows(results)) + "\n")
    return "\n".join(out)


def _architecture_rows(results: dict) -> list[list[str]]:
    """Each framework's count of each network beside PyTorch's, then its stock network, labelled."""
    models = list(results["models"])
    pytorch = {m: results["models"][m]["parameters"] for m in models}

    def row(label: str, m: str, count: int, definition: str) -> list[str]:
        return [label, _model(m), f"{count:,}", f"{pytorch[m]:,}", f"{count / pytorch[m]:.4f}", definition]

    rows = [row("PyTorch", m, pytorch[m], f"resurgo.study.models, {PYTORCH_NETS[m]}") for m in models]
    for fw in results.get("frameworks", {}).values():
        for m in models:
            info = fw.get("models", {}).get(m)
            if info is None:
                rows.append([fw["label"], _model(m), "-", f"{pytorch[m]:,}", "-",
                             f"could not run: {fw.get('why', 'not run')}"])
                continue
            rows.append(row(fw["label"], m, info["parameters"], info["architecture"]))
        for m in models:
            stock = fw.get("models", {}).get(m, {}).get("stock")
            if stock:
                rows.append(row(f"{fw['label']} (stock, not the shared architecture)", m, stock["parameters"],
                                stock["definition"]))
    return rows


def render_markdown(results: dict) -> str:
    cfg, env = results["config"], results["environment"]
    cores = env.get("cpu_count")
    out: list[str] = []
    out.append("# resurgo study: the cost, formats, scale and determinism of checkpointing\n")
    out.append(
        f"Preset `{cfg['preset']}`: {', '.join(_model(m) for m in cfg['models'])} (CIFAR-10 variants, width "
        f"{cfg['width']}{'' if cfg['width'] == 64 else ' instead of 64: every layer kept, fewer channels'}), "
        f"batch {cfg['batch_size']}, SGD with momentum, "
        f"{'real CIFAR-10 from ' + cfg['data_dir'] if cfg['data_dir'] else 'synthetic CIFAR-10-shaped data'} "
        f"({cfg['samples']} images, random crop + flip, shuffled). "
        f"Machine: {cores} CPU cores, torch {env['torch']}, {cfg['threads']} intra-op thread(s) per process, "
        f"PyTorch on {_device(cfg, env)}, "
        f"load average {_load(env.get('load_average_1_5_15'))} at start. Study duration {results['duration_s']:.0f} s.\n")
    out.append("Mechanisms, as their users write them: torch.save of the model and optimizer state_dicts; "
               "PyTorch DCP `save`/`async_save` of `get_state_dict(model, optimizer)`; safetensors "
               "`save_file(model.state_dict())` (weights only); resurgo `save`/`async_save` of "
               "`TrainState(model, optimizer, dataloader, step)`, and `async_save(guard=optimizer)`.\n")
    if results.get("frameworks"):
        out.append(render_frameworks(results))

    for number, section in enumerate((_cost_section, _formats_section, _scale_section, _determinism_section), 1):
        out.extend(section(results) + section_findings(number, results))
    out.extend(_disk_section(results))
    out.extend(closing_sections(results) + machine_section(results))
    return "\n".join(out)


def _cost_section(results: dict) -> list[str]:
    """Section 1: the cost of checkpointing (Table I, Figure 1)."""
    out: list[str] = []
    cfg = results["config"]
    out.append("## 1. Cost of checkpointing (Table I)\n")
    out.append(f"Per mechanism and repetition, the job trains {cfg['cost_steps']} steps without checkpoints, "
               f"then {cfg['cost_steps']} steps with a checkpoint every {cfg['checkpoint_every']} steps, back to "
               f"back (a pair: the same machine load for both); {cfg['cost_repeats']} pairs per mechanism in "
               "rotated order. Times are *median [min, max]* over the repetitions. *Extra* is the median of the "
               "paired differences (with minus without, the same repetition) with its interval; *overhead* is "
               "extra / the median time without checkpoints, so it follows from the columns shown. An overhead "
               "whose interval holds 0 is marked *not distinguishable from noise*. *Blocked* is how long the "
               "training loop waited in the save call, over all checkpoints of all repetitions; an asynchronous "
               "save still running at the end of the run is waited for inside the timed run. torch.save and "
               "safetensors, called as their users call them, return before the data are durable (no fsync); "
               "DCP and resurgo fsync. " + _coverage_note(results["cost"]) + "\n")
    rows = [[_model(r["model"]), r["label"], _spread(r["baseline"]), _spread(r["with_ckpt"]), str(r["checkpoints"]),
             _blocked(r), _extra(r), _overhead(r)] for r in results["cost"]]
    out.append(_table(["model", "mechanism", "train, no ckpt (s)", "train with ckpt (s)", "checkpoints per run",
                       "blocked per ckpt (s)", "extra (s)", "overhead %"], rows) + "\n")
    out.append(f"![Figure 1: overhead of checkpointing]({COST_PLOT})\n")
    return out


def _formats_section(results: dict) -> list[str]:
    """Section 2: formats and sizes (Table II) and the notes on loading running code."""
    out: list[str] = []
    out.append("## 2. Formats and sizes (Table II)\n")
    out.append("One checkpoint of the trained job per mechanism and repetition, saved alone (*save s*: until "
               "complete) and loaded back (*load s*), median [min, max]. *Raw* is the bytes of the tensors the "
               "mechanism stores (model state_dict, plus the optimizer state where it stores it). *fsync*: the mechanism makes the "
               "data durable before returning (torch.save and safetensors do not, as users call them).\n")
    rows = []
    for r in results["formats"]:
        st = r["stores"]
        rows.append([_model(r["model"]), r["label"], r["format"], str(r["files"]), _human_bytes(r["bytes"]),
                     _human_bytes(r["raw_tensor_bytes"]), f"{r['size_over_raw']:.3f}", _yes(st["weights"]),
                     _yes(st["optimizer"]), _yes(st["rng"]), _yes(st["data_position"]), _yes(r["fsync"]),
                     r["executes_code"] + ("*" if r["mechanism"] == "torch_save" else ""), _spread(r["save"]),
                     _spread(r["load"])])
    out.append(_table(["model", "mechanism", "format", "files", "size", "raw", "size / raw", "weights",
                       "optimizer", "RNG", "data position", "fsync", "load can run code", "save s", "load s"],
                      rows) + "\n")
    notes: dict[str, list[str]] = {}  # one line per distinct note, naming every mechanism it is about
    for r in results["formats"]:
        labels = notes.setdefault(r["executes_code_note"], [])
        if r["label"] not in labels:
            labels.append(r["label"])
    for note, labels in notes.items():
        out.append(f"- {', '.join(labels)}: {note}.")
    out.append("\n\\* torch>=2.6 loads with `weights_only=True` by default, which refuses arbitrary "
               "objects; with `weights_only=False` (needed when a checkpoint holds other objects) or an "
               "older torch, loading runs code from the file.\n")
    return out


def _scale_section(results: dict) -> list[str]:
    """Section 3: scale (Table III, Figure 4)."""
    out: list[str] = []
    cfg = results["config"]
    cores = results["environment"].get("cpu_count")
    out.append("## 3. Scale (Table III)\n")
    worlds = sorted({r["ranks"] for r in results["scale"]})
    if not worlds:
        out.append("Not run: no rank counts were given (`--ranks` was empty).\n")
    else:
        out.append(f"Data-parallel training on {', '.join(map(str, worlds))} "
                   f"real processes, {cfg['batch_size']} images per rank, {cfg['scale_steps']} steps per run, a "
                   f"checkpoint every {cfg['scale_every']} steps, {cfg['cost_repeats']} pairs of runs per "
                   "mechanism as in Table I. PyTorch: DistributedDataParallel, gloo, CPU; every rank calls the "
                   "save (torch.save and safetensors write from rank 0 only, as their users do). "
                   "Times are the slowest rank's. "
                   f"**The ranks share this machine's {cores} CPU cores** (one thread each): with more ranks "
                   "than cores, ranks wait for CPU, so this measures the mechanisms' coordination and I/O under "
                   "contention, not the speed-up of a cluster. " + _coverage_note(results["scale"]) + "\n")
        rows = [[_model(r["model"]), str(r["ranks"]), str(r["global_batch"]), r["label"], _spread(r["baseline"]),
                 _spread(r["with_ckpt"]), _blocked(r), _extra(r), _overhead(r)] for r in results["scale"]]
        out.append(_table(["model", "ranks", "global batch", "mechanism", "train, no ckpt (s)",
                           "train with ckpt (s)", "blocked per ckpt (s)", "extra (s)", "overhead %"], rows) + "\n")
        out.append(f"![Figure 4: time blocked per checkpoint by number of ranks]({SCALE_PLOT})\n")
    out += _framework_scale_lines(results)
    return out


def _framework_scale_lines(results: dict) -> list[str]:
    """Per framework beside PyTorch: how its processes trained together, the wall time of each
    process count (start-up included), and exactly why a count did not run."""
    lines = []
    for name, fw in results.get("frameworks", {}).items():
        rows = [r for r in results["scale"] if r.get("framework") == name]
        walls = ", ".join(f"{plural(r['ranks'], 'process', 'processes')} {r['wall_s']:.0f} s"
                          for r in rows if r.get("wall_s"))
        lines.append(f"- {fw['label']}: {fw['scale']}" + (f". Wall time per group: {walls}" if walls else "") + ".")
    return (["Other frameworks:\n", "\n".join(lines) + "\n"]) if lines else []


def _determinism_section(results: dict) -> list[str]:
    """Section 4: determinism after a restart (Figures 2 and 3)."""
    out: list[str] = []
    cfg = results["config"]
    models = list(results["determinism"])
    out.append("## 4. Determinism (Figures 2 and 3)\n")
    out.append(f"An uninterrupted run of {cfg['det_steps']} steps checkpoints with every mechanism at step "
               f"{cfg['det_restart']}. For each mechanism, fresh objects are built as a new training script "
               "builds them (seeded), the global RNGs are moved elsewhere (as other code in a new process "
               "would), the checkpoint is loaded the way that mechanism's users load it, and training "
               "continues. The loader is iterated again, so it resumes mid-epoch only if its position was "
               "restored. Training draws random numbers for shuffling, augmentation and dropout (VGG-16). "
               "In the plots, identical curves are drawn once and named together in the legend; those "
               "identical to the uninterrupted run are drawn on it (dotted), as the title says.\n")
    rows = []
    for model in models:
        det = results["determinism"][model]
        others = [fw["determinism"][model] for fw in results.get("frameworks", {}).values()
                  if fw["ran"] and model in fw["determinism"]]
        for r in [r for d in [det, *others] for r in d["restarts"].values()]:
            st = r["stores"]
            rows.append([_model(model), r["label"], _yes(st["optimizer"]), _yes(st["rng"]),
                         _yes(st["data_position"]), f"{r['max_abs_diff']:.4g}", _yes(r["identical"])])
    out.append(_table(["model", "mechanism", "optimizer", "RNG", "data position",
                       "largest abs. loss difference after restart", "identical curve"], rows) + "\n")
    if results.get("frameworks"):
        out.append("Other frameworks' restarts are compared with their own uninterrupted run (same seed, same "
                   "steps); the figures show PyTorch's.\n")
    for i, model in enumerate(models):
        out.append(f"![Figure {i + 2}: {_model(model)} loss after restart]({determinism_plot_name(i, model)})\n")
    return out


DISK_EXPERIMENTS = (("cost", "cost runs"), ("formats", "formats (saved alone)"), ("determinism", "determinism"),
                    ("scale", "scale"))


def _load(averages: object) -> str:
    """The 1, 5 and 15 minute load averages as the system shows them."""
    if isinstance(averages, (list, tuple)) and averages:
        return ", ".join(f"{x:.2f}" for x in averages)
    return "unknown"


def _disk_section(results: dict) -> list[str]:
    """The bytes of checkpoints written, per framework and experiment, and the most on disk at once."""
    # (label, ledger, experiments that ran but whose bytes no ledger saw: another framework's scale
    # processes write and delete their checkpoints themselves)
    ledgers: list[tuple[str, Optional[dict], set[str]]] = [("PyTorch", results.get("disk"), set())] + [
        (fw["label"], fw.get("disk"), {"scale"} if str(fw.get("scale", "")).startswith("ran") else set())
        for fw in results.get("frameworks", {}).values() if fw["ran"]]
    disks = [(label, d, unseen - set(d["written"])) for label, d, unseen in ledgers if d]
    if not disks:
        return []
    out = ["## Disk: bytes written\n",
           "Every checkpoint is deleted as soon as it is measured: a cost run's when the run ends, the one "
           "saved alone when it is loaded back, a determinism checkpoint when its restart has loaded it. "
           "*Written* sums the bytes of every checkpoint an experiment created (counted when complete, an "
           "overwritten or pruned one included); *most on disk* is the largest total of checkpoints present "
           "at one time.\n"]
    if any(unseen for _, _, unseen in disks):
        out.append("*Not counted*: that framework's processes wrote and deleted those checkpoints themselves, "
                   "unmeasured (nor are they in *most on disk*); a sum that misses them is shown as *at least*.\n")

    def at_least(n: int, partial: bool) -> str:
        return ("at least " if partial else "") + _human_bytes(n)

    rows = [[label, *("not counted" if key in unseen else _human_bytes(d["written"].get(key, 0))
                      for key, _ in DISK_EXPERIMENTS), at_least(d["total"], bool(unseen)), _human_bytes(d["peak"])]
            for label, d, unseen in disks]
    if len(disks) > 1:  # the frameworks run one after another: the most on disk is one of theirs
        rows.append(["all", *(at_least(sum(d["written"].get(key, 0) for _, d, _ in disks),
                                       any(key in unseen for _, _, unseen in disks)) for key, _ in DISK_EXPERIMENTS),
                     at_least(sum(d["total"] for _, d, _ in disks), any(unseen for _, _, unseen in disks)),
                     _human_bytes(max(d["peak"] for _, d, _ in disks))])
    out.append(_table(["framework", *(title for _, title in DISK_EXPERIMENTS), "written", "most on disk"], rows) + "\n")
    return out


def write_outputs(results: dict, out: Path) -> list[Path]:
    """results.json, the PNG plots and report.md into ``out``; the paths written."""
    plt = require_matplotlib()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / RESULTS]
    (out / RESULTS).write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    _save(plt, cost_figure(plt, results), out / COST_PLOT)
    written.append(out / COST_PLOT)
    if results["scale"]:
        _save(plt, scale_figure(plt, results), out / SCALE_PLOT)
        written.append(out / SCALE_PLOT)
    for i, (model, det) in enumerate(results["determinism"].items()):
        path = out / determinism_plot_name(i, model)
        _save(plt, determinism_figure(plt, det), path)
        written.append(path)
    (out / REPORT).write_text(render_markdown(results))
    written.append(out / REPORT)
    return written
