"""The study's findings in plain words, generated from its numbers: two or three sentences per
question of the founding paper (cost, formats and sizes, scale, determinism), what this run
reproduces of the paper's takeaways and where it differs, and what it cannot show.

This module owns wording only: pure functions of the results dict (``experiments.run_study``'s),
no I/O. An order between two mechanisms is stated only when their intervals do not overlap
(:func:`overlap_groups`); mechanisms whose intervals overlap are said to be not distinguishable.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

from resurgo.study.models import LABELS

__all__ = ["Ranked", "overlap_groups", "order_sentence", "cost_findings", "formats_findings", "scale_findings",
           "determinism_findings", "paper_comparison", "not_shown", "section_findings", "closing_sections",
           "PAPER_TAKEAWAYS"]

# The founding paper's takeaways that a run of this study can check, each with its mechanism names.
PAPER_TAKEAWAYS = {
    "cost": "TensorFlow's checkpoints cost least (2.3% overhead on average)",
    "size": "Chainer writes the smallest checkpoint files",
    "determinism": "PyTorch restarts closer to the uninterrupted run than Chainer and TensorFlow",
    "scale": "at scale, TensorFlow keeps the lowest checkpoint overhead and Chainer's grows",
}
# The frameworks' own mechanisms, which the paper compared (the other mechanisms are additions).
NATIVE = {"torch_save": "PyTorch", "tf_checkpoint_manager": "TensorFlow", "chainer_save_npz": "Chainer"}


class Ranked(NamedTuple):
    """A quantity to order: its label, and its interval (low, middle, high)."""

    label: str
    low: float
    mid: float
    high: float


def overlap_groups(items: Sequence[Ranked]) -> list[list[Ranked]]:
    """``items`` in groups, lowest first: a group is a chain of overlapping intervals, and every
    interval of a group ends below every interval of the next one starts. Within a group, each
    is ordered by its middle value (no order between them is claimed)."""
    groups: list[list[Ranked]] = []
    reach = float("-inf")
    for item in sorted(items, key=lambda r: (r.low, r.high, r.label)):
        if groups and item.low <= reach:
            groups[-1].append(item)
            reach = max(reach, item.high)
        else:
            groups.append([item])
            reach = item.high
    return [sorted(g, key=lambda r: (r.mid, r.label)) for g in groups]


def _names(items: Sequence[str]) -> str:
    items = list(items)
    if not items:
        return ""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def order_sentence(items: Sequence[Ranked], noun: str) -> str:
    """One sentence ordering ``items`` by their intervals of ``noun``, least first: an order is
    stated between groups whose intervals do not overlap; within a group, none."""
    if not items:
        return ""
    groups = overlap_groups(items)
    if len(groups) == 1:
        if len(items) == 1:
            return f"Only {items[0].label} was measured for {noun}."
        return f"{_names([r.label for r in groups[0]])} are not distinguishable by {noun}: their intervals overlap."

    def part(group: list[Ranked]) -> str:
        text = _names([r.label for r in group])
        return text if len(group) == 1 else f"{text} (not distinguishable from each other)"

    head = groups[0]
    if len(head) == 1:
        first = f"{head[0].label} costs least by {noun}, its interval below every other's"
    else:
        first = f"{part(head)} cost least by {noun}, their intervals below the others'"
    return f"{first}; then " + "; then ".join(part(g) for g in groups[1:]) + "."


def _model(name: str) -> str:
    return LABELS.get(name, name)


def _framework(row: dict) -> str:
    return row.get("framework", "pytorch")


def _pct(x: float) -> str:
    return f"{x:+.1f}%"


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _models(results: dict) -> list[str]:
    return list(dict.fromkeys(r["model"] for r in results["cost"]))


def _overhead(row: dict) -> Ranked:
    return Ranked(row["label"], row["overhead_low_pct"], row["overhead_pct"], row["overhead_high_pct"])


def cost_findings(results: dict) -> list[str]:
    """Question 1: which mechanism costs least, per network; asynchrony and durability."""
    out = []
    for model in _models(results):
        rows = [r for r in results["cost"] if r["model"] == model]
        text = f"{_model(model)}: " + order_sentence([_overhead(r) for r in rows], "overhead")
        noise = [r["label"] for r in rows if r["noise"]]
        if noise:
            text += f" The overhead of {_names(noise)} is not distinguishable from noise (its interval holds 0)."
        out.append(text)
    pt = [r for r in results["cost"] if _framework(r) == "pytorch" and r.get("stall")]
    asyn = [r["stall"]["median"] for r in pt if "async" in r["mechanism"]]
    sync = [r["stall"]["median"] for r in pt if "async" not in r["mechanism"]]
    if asyn and sync:
        a, b = statistics.median(asyn), statistics.median(sync)
        out.append(f"Asynchronous saves keep training blocked a median {a:.3f} s per checkpoint, synchronous ones "
                   f"{b:.3f} s: " + ("the write overlaps the next steps, though on these cores it competes with them "
                                     "for CPU." if a < b else "at this size the snapshot and the hand-over to the "
                                     "writing thread cost more than the write they hide."))
    out.extend(_compression_costs(results))
    unsynced = sorted({r["label"] for r in results["formats"] if not r["fsync"]})
    if unsynced:
        out.append(f"{_names(unsynced)} {'returns' if len(unsynced) == 1 else 'return'} before the data are durable "
                   "(no fsync); the mechanisms that fsync pay for durability in their cost.")
    return out


def _compression_costs(results: dict) -> list[str]:
    """Where a mechanism's cost is its compression: the time one checkpoint takes to save alone,
    beside the median of the mechanisms that write the tensors' bytes as they are."""
    out: list[str] = []
    models = _models(results)
    if not models:
        return out
    model = models[0]
    rows = [r for r in results["formats"] if r["model"] == model and r["stores"]["optimizer"]]
    plain = [statistics.median(r["save_s"]) for r in rows if r["size_over_raw"] >= 1.0]
    if not plain:
        return out
    for r in sorted((r for r in rows if r["size_over_raw"] < 1.0), key=lambda r: r["label"]):
        out.append(f"{r['label']} compresses ({r['size_over_raw']:.3f} x the raw tensor bytes) and takes "
                   f"{statistics.median(r['save_s']):.2f} s to save one {_model(model)} checkpoint alone, against a "
                   f"median {statistics.median(plain):.2f} s for the mechanisms that write the bytes as they are.")
    return out


def formats_findings(results: dict) -> list[str]:
    """Question 2: which files are smallest, how many files, whether loading can run code."""
    out = []
    for model in _models(results):
        rows = [r for r in results["formats"] if r["model"] == model]
        full = [r for r in rows if r["stores"]["optimizer"]]
        if full:
            least = min(r["bytes"] for r in full)
            smallest = [r["label"] for r in full if r["bytes"] == least]
            text = (f"{_model(model)}: of the checkpoints holding weights and optimizer state, {_names(smallest)} "
                    f"{'is' if len(smallest) == 1 else 'are'} smallest ({_mib(least)}, "
                    f"{least / full[0]['raw_tensor_bytes'] if full[0]['raw_tensor_bytes'] else 0:.3f} x the raw "
                    f"tensor bytes); the largest is {_mib(max(r['bytes'] for r in full))}.")
            compressed = [r["label"] for r in full if r["size_over_raw"] < 1.0]
            if compressed:
                text += f" Only {_names(compressed)} write fewer bytes than the tensors hold: compression."
            out.append(text)
    counts: dict[str, set[int]] = {}
    for r in results["formats"]:
        if r["files"] > 1:
            counts.setdefault(r["label"], set()).add(r["files"])
    many = [f"{label} ({min(c)}{'' if len(c) == 1 else f'-{max(c)}'} files)" for label, c in sorted(counts.items())]
    if many:
        out.append(f"Several files per checkpoint: {_names(many)}; the rest write one.")
    runs_code = sorted({r["label"] for r in results["formats"] if r["executes_code"] != "no"})
    if runs_code:
        out.append(f"Loading {_names(runs_code)} can run code from the file (pickle); the others read data only.")
    return out


def scale_findings(results: dict) -> list[str]:
    """Question 3: how the time blocked and the overhead change with the number of ranks."""
    rows = results["scale"]
    if not rows:
        return ["The scale experiment was not run."]
    out = []
    worlds = sorted({r["ranks"] for r in rows})
    top = worlds[-1]
    for model in dict.fromkeys(r["model"] for r in rows):
        at_top = [r for r in rows if r["model"] == model and r["ranks"] == top]
        out.append(f"{_model(model)} on {top} ranks: " + order_sentence([_overhead(r) for r in at_top], "overhead"))
        grows = []
        for r in at_top:
            first = next((x for x in rows if x["model"] == model and x["ranks"] == worlds[0]
                          and x["mechanism"] == r["mechanism"] and _framework(x) == _framework(r)), None)
            if first and first.get("stall") and r.get("stall") and r["stall_interval"][0] > first["stall_interval"][1]:
                grows.append(f"{r['label']} ({first['stall']['median']:.3f} s to {r['stall']['median']:.3f} s)")
        if grows and len(worlds) > 1:
            out.append(f"Time blocked per checkpoint grows from {worlds[0]} to {top} ranks, intervals apart, for "
                       f"{_names(grows)}: the ranks share the machine's cores and disk.")
    return out


def _restarts(results: dict) -> tuple[dict[str, dict[str, dict]], dict[str, dict]]:
    """Per mechanism label, each network's restart row (every framework that ran), and what it stores."""
    per_label: dict[str, dict[str, dict]] = {}
    stores: dict[str, dict] = {}
    dets = [results["determinism"]] + [fw.get("determinism", {}) for fw in results.get("frameworks", {}).values()
                                       if fw.get("ran")]
    for det in dets:
        for model, model_det in det.items():
            for name, r in model_det["restarts"].items():
                per_label.setdefault(r["label"], {})[model] = {**r, "mechanism": name}
                stores[r["label"]] = r["stores"]
    return per_label, stores


# What a restart without each piece of state draws differently ({s}: a verb's "s" for one mechanism).
MISSING_STATE = {
    ("rng", "data_position"): "store{s} neither the RNG state nor the data position: the restarted run draws other "
                              "batches, augmentations and dropout masks",
    ("rng",): "store{s} the data position but no RNG state: the restarted run sees the same batches but draws other "
              "random numbers (augmentation, dropout), so only a network whose training draws none of its own "
              "restarts exactly",
    ("data_position",): "store{s} the RNG state but no data position: the restarted run trains on other batches",
    (): "store{s} the optimizer, the RNG state and the data position, and still differ{s}: the difference comes from "
        "outside the checkpoint (nondeterministic kernels, state the job keeps elsewhere)",
}


def determinism_findings(results: dict) -> list[str]:
    """Question 4: which mechanisms restart exactly, for which networks, and why the others do not."""
    per_label, stores = _restarts(results)
    exact = [label for label, by in per_label.items() if all(r["identical"] for r in by.values())]
    differ = [label for label, by in per_label.items() if not any(r["identical"] for r in by.values())]
    mixed = [label for label in per_label if label not in exact and label not in differ]
    out = []
    if exact:
        out.append(f"{_names(exact)} restart exactly: the loss curve after the restart is bit for bit the "
                   "uninterrupted one, for every network.")
    for label in mixed:
        by = per_label[label]
        same = [_model(m) for m, r in by.items() if r["identical"]]
        other = [f"{_model(m)} (up to {r['max_abs_diff']:.3g})" for m, r in by.items() if not r["identical"]]
        out.append(f"{label} restarts exactly for {_names(same)} but not for {_names(other)}.")
    if differ:
        parts = [f"{label} (up to {max(r['max_abs_diff'] for r in per_label[label].values()):.3g})" for label in differ]
        out.append(f"{_names(parts)} diverge after the restart.")
    groups: dict[tuple[str, ...], list[str]] = {}
    for label in differ + mixed:
        missing = tuple(k for k in ("rng", "data_position") if not stores[label][k])
        groups.setdefault(missing, []).append(label)
    for missing, labels in sorted(groups.items(), key=lambda kv: (-len(kv[0]), kv[0])):
        out.append(f"{_names(sorted(labels))} {MISSING_STATE[missing].format(s='s' if len(labels) == 1 else '')}.")
    return out


def _native_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["mechanism"] in NATIVE]


def paper_comparison(results: dict) -> list[str]:
    """Each of the paper's takeaways that this run can check: reproduced, differs, or not
    distinguishable, from the frameworks' own mechanisms (torch.save, tf.train.Checkpoint,
    Chainer's save_npz)."""
    out = []
    for model in _models(results):
        native = _native_rows([r for r in results["cost"] if r["model"] == model])
        tf = [r for r in native if r["mechanism"] == "tf_checkpoint_manager"]
        if not tf or len(native) < 2:
            out.append(f"- {PAPER_TAKEAWAYS['cost']}: not checked for {_model(model)} (TensorFlow and another "
                       "framework's own mechanism are needed).")
            continue
        head = overlap_groups([_overhead(r) for r in native])[0]
        if [x.label for x in head] == [tf[0]["label"]]:
            verdict = "reproduced"
        elif tf[0]["label"] in [x.label for x in head]:
            verdict = f"not distinguishable: {_names([x.label for x in head])} overlap"
        else:
            verdict = f"differs: {_names([x.label for x in head])} cost{'s' if len(head) == 1 else ''} less"
        out.append(f"- {PAPER_TAKEAWAYS['cost']}: {_model(model)}, {verdict} "
                   f"(TensorFlow {_pct(tf[0]['overhead_pct'])} here).")
    for model in _models(results):
        native = [r for r in _native_rows([r for r in results["formats"] if r["model"] == model])
                  if r["stores"]["optimizer"]]
        chainer = [r for r in native if r["mechanism"] == "chainer_save_npz"]
        if not chainer or len(native) < 2:
            out.append(f"- {PAPER_TAKEAWAYS['size']}: not checked for {_model(model)} (Chainer did not run).")
            continue
        least = min(native, key=lambda r: r["bytes"])
        verdict = "reproduced" if least is chainer[0] or least["bytes"] == chainer[0]["bytes"] else \
            f"differs: {least['label']} is smaller"
        out.append(f"- {PAPER_TAKEAWAYS['size']}: {_model(model)}, {verdict} ({_mib(chainer[0]['bytes'])}, "
                   "compressed npz).")
    per_label, _ = _restarts(results)
    restarts = {NATIVE[r["mechanism"]]: by for by in per_label.values() for r in by.values() if r["mechanism"] in NATIVE}
    checked = False
    for model in _models(results):
        diff = {fw: by[model]["max_abs_diff"] for fw, by in restarts.items() if model in by}
        if "PyTorch" not in diff or len(diff) < 2:
            continue
        checked = True
        closer = sorted(fw for fw, d in diff.items() if fw != "PyTorch" and d <= diff["PyTorch"])
        verdict = "reproduced" if not closer else f"differs: {_names(closer)} restart{'s' if len(closer) == 1 else ''} " \
            "as close or closer"
        out.append(f"- {PAPER_TAKEAWAYS['determinism']}: {_model(model)}, {verdict} (largest loss difference after "
                   "the restart: " + ", ".join(f"{k} {v:.3g}" for k, v in diff.items()) + ").")
    if not checked:
        out.append(f"- {PAPER_TAKEAWAYS['determinism']}: not checked (TensorFlow or Chainer did not run).")
    scaled = {NATIVE[r["mechanism"]] for r in results["scale"] if r["mechanism"] in NATIVE}
    if {"TensorFlow", "Chainer"} <= scaled:
        top = max(r["ranks"] for r in results["scale"])
        native = [r for r in results["scale"] if r["mechanism"] in NATIVE and r["ranks"] == top]
        head = overlap_groups([_overhead(r) for r in native])[0]
        labels = [x.label for x in head]
        tf_label = next(r["label"] for r in native if r["mechanism"] == "tf_checkpoint_manager")
        verdict = "reproduced" if labels == [tf_label] else (
            f"not distinguishable: {_names(labels)} overlap" if tf_label in labels else
            f"differs: {_names(labels)} cost{'s' if len(labels) == 1 else ''} less")
        out.append(f"- {PAPER_TAKEAWAYS['scale']}: on {top} ranks, {verdict}.")
    else:
        out.append(f"- {PAPER_TAKEAWAYS['scale']}: not checked (the scale experiment ran for "
                   f"{_names(sorted(scaled)) or 'no framework'} only).")
    return out


def not_shown(results: dict) -> list[str]:
    """What a run on this CPU cannot show that ``--full`` on a GPU would."""
    cfg, env = results["config"], results["environment"]
    return [
        f"- Device-to-host copies: on a GPU a checkpoint first copies every tensor out of device memory, the stall "
        "that asynchronous saves hide; here the tensors are in host memory and the copy is a memcpy.",
        f"- Realistic step times: batch {cfg['batch_size']} on {env.get('cpu_count')} CPU cores makes a step short "
        "and a checkpoint large beside it, so the overheads in percent are far above a GPU job's at batch 32 and "
        "hundreds of steps between checkpoints.",
        "- Scale: here the ranks share one machine's cores and disk, so the time blocked grows with contention; "
        "on a cluster each rank has its own accelerator and the storage's bandwidth decides.",
        "- Storage: one local disk; the shared parallel file system of the paper's clusters, or an object store, changes which "
        "mechanism's many files or fsyncs cost most.",
    ]


def section_findings(number: int, results: dict) -> list[str]:
    """The findings paragraph closing section ``number`` (1 cost, 2 formats, 3 scale, 4 determinism)."""
    make = {1: cost_findings, 2: formats_findings, 3: scale_findings, 4: determinism_findings}[number]
    sentences = make(results)
    return ["**Findings.** " + " ".join(sentences) + "\n"] if sentences else []


def closing_sections(results: dict) -> list[str]:
    """The report's last two sections: the paper's takeaways checked here, and what this run cannot show."""
    return ["## What this reproduces of the paper's takeaways\n",
            "The paper compared the frameworks' own mechanisms (torch.save, TensorFlow's checkpoint, Chainer's "
            "save_npz) on V100 GPUs with a parallel file system; each takeaway is checked on this machine's "
            "numbers, and an order is claimed only where intervals do not overlap.\n",
            "\n".join(paper_comparison(results)) + "\n",
            "## What this run does not show\n",
            "\n".join(not_shown(results)) + "\n"]
