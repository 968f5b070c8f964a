"""The reference report: its preset (``resurgo study --reference``) and the structure its
report.md must have.

This module owns two things. :func:`reference_config` is the preset that a 2-core machine
finishes in at most 120 minutes: the published networks, all four frameworks, the scale
experiment, six pairs per overhead (a 97% interval). :func:`check_report` reads a rendered
report.md and lists every rule it breaks: every framework ran, each network's parameter count is
shown for every framework and equal within 0.1% (a framework's stock model, labelled "stock", is
an extra row and not compared), every overhead in the cost and scale tables has its interval, the
four questions each end with findings, and the machine section names CPU, cores, memory, disk,
library versions and date.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from resurgo.errors import StudyError
from resurgo.study.experiments import StudyConfig

__all__ = ["reference_config", "check_report", "require_reference_structure", "FRAMEWORK_LABELS", "QUESTIONS",
           "MACHINE_ROWS", "PARAMETER_TOLERANCE"]

FRAMEWORK_LABELS = ("PyTorch", "TensorFlow", "JAX/Orbax", "Chainer")
QUESTIONS = ("## 1. Cost of checkpointing", "## 2. Formats and sizes", "## 3. Scale", "## 4. Determinism")
MACHINE_ROWS = ("CPU", "cores", "memory", "disk", "libraries", "date")
PARAMETER_TOLERANCE = 0.001  # 0.1%
INTERVAL = re.compile(r"^[+-]\d+\.\d \[[+-]\d+\.\d, [+-]\d+\.\d\]")


def reference_config(**overrides: Any) -> StudyConfig:
    """The reference report's preset: the published networks (width 64) at batch 2, runs of 4
    steps checkpointing twice, 6 pairs per mechanism (the overhead's interval [min, max] of 6
    paired differences holds the median with probability 97%), 12-step determinism runs
    restarted at step 6, the scale experiment on 1, 2 and 4 ranks (VGG-16, 2-step runs with one
    checkpoint, as ``--quick``), and TensorFlow, JAX and Chainer beside PyTorch (their scale
    experiment too, where they run it).

    On the 2-core development VM, otherwise idle, it ran in 1457 s and 1544 s (two runs, the
    frameworks' environments already built); docs/study/reference.md is the 1457 s run's report."""
    return replace(StudyConfig(width=64, batch_size=2, samples=256, warmup_steps=2, cost_steps=4, checkpoint_every=2,
                               cost_repeats=6, scale_worlds=(1, 2, 4), scale_models=("vgg16",), scale_steps=2,
                               scale_every=2, det_steps=12, det_restart=6, preset="reference",
                               frameworks=("tensorflow", "jax", "chainer")), **overrides)


def _section(text: str, heading: str) -> str:
    """The text from ``heading`` (a line starting with it) to the next "## " heading."""
    start = next((m.start() for m in re.finditer(r"^" + re.escape(heading), text, re.M)), None)
    if start is None:
        return ""
    nxt = re.search(r"^## ", text[start + 3:], re.M)
    return text[start:start + 3 + nxt.start()] if nxt else text[start:]


def _tables(section: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table of ``section``: (header cells, data rows' cells)."""
    tables, block = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            if len(block) >= 2:
                tables.append((block[0], block[2:]))
            block = []
    return tables


def _frameworks_rules(text: str) -> list[str]:
    problems = []
    section = _section(text, "## Frameworks and networks")
    if not section:
        return ["no section '## Frameworks and networks': the other frameworks did not run"]
    tables = _tables(section)
    status = {row[0]: row for header, rows in tables if "framework" in header and len(header) > 2
              and header[2].startswith("cost") for row in rows}
    for label in FRAMEWORK_LABELS:
        row = status.get(label)
        if row is None:
            problems.append(f"framework {label}: no row in the frameworks table")
        elif not row[2].startswith("ran"):
            problems.append(f"framework {label}: did not run ({row[2]})")
    nets = [(header, rows) for header, rows in tables if "parameters" in header]
    if not nets:
        return problems + ["no table of parameter counts (a 'parameters' column) in '## Frameworks and networks'"]
    header, rows = nets[0]
    fi, mi, pi = header.index("framework"), header.index("model"), header.index("parameters")
    counts: dict[str, dict[str, int]] = {}
    for row in rows:
        if any("stock" in cell.lower() for cell in row):
            continue  # a framework's own model, an extra row
        try:
            counts.setdefault(row[mi], {})[row[fi]] = int(row[pi].replace(",", ""))
        except ValueError:
            problems.append(f"{row[fi]} {row[mi]}: no parameter count shown ({row[pi]!r})")
    for model, by_fw in counts.items():
        for label in FRAMEWORK_LABELS:
            if label not in by_fw and not any(label == r[fi] and model == r[mi] for r in rows):
                problems.append(f"{model}: no parameter count for {label}")
        base = by_fw.get("PyTorch")
        for label, n in by_fw.items():
            if base and abs(n - base) > PARAMETER_TOLERANCE * base:
                problems.append(f"{model}: {label} has {n:,} parameters, PyTorch {base:,}: more than 0.1% apart")
    return problems


def _interval_rules(text: str) -> list[str]:
    problems = []
    for heading in (QUESTIONS[0], QUESTIONS[2]):
        tables = [(h, rows) for h, rows in _tables(_section(text, heading)) if "overhead %" in h]
        if not tables:
            problems.append(f"{heading.lstrip('# ')}: no table with an 'overhead %' column")
            continue
        header, rows = tables[0]
        col = header.index("overhead %")
        if not rows:
            problems.append(f"{heading.lstrip('# ')}: the table has no rows")
        for row in rows:
            if not INTERVAL.match(row[col]):
                problems.append(f"{heading.lstrip('# ')}: row '{' | '.join(row[:4])}' shows no interval for its "
                                f"overhead ({row[col]!r}; expected '+x.x [+low, +high]')")
    return problems


def _findings_rules(text: str) -> list[str]:
    problems = []
    for heading in QUESTIONS:
        section = _section(text, heading)
        if not section:
            problems.append(f"no section '{heading}'")
        elif "**Findings.**" not in section:
            problems.append(f"section '{heading}' has no findings ('**Findings.**' paragraph)")
    for heading in ("## What this reproduces of the paper's takeaways", "## What this run does not show"):
        if not _section(text, heading):
            problems.append(f"no section '{heading}'")
    return problems


def _machine_rules(text: str) -> list[str]:
    section = _section(text, "## Machine")
    if not section:
        return ["no section '## Machine' (CPU, cores, memory, disk, library versions, date)"]
    rows = {row[0]: row[1] for _, table in _tables(section) for row in table if len(row) > 1}
    return [f"machine: no {name}" + (f" ({rows[name]!r})" if name in rows else "")
            for name in MACHINE_ROWS if not rows.get(name) or rows[name].startswith("unknown")]


def check_report(text: str) -> list[str]:
    """Every rule of the reference report that ``text`` (a report.md) breaks; empty when none."""
    return _frameworks_rules(text) + _interval_rules(text) + _findings_rules(text) + _machine_rules(text)


def require_reference_structure(path: Path) -> None:
    """Raise StudyError naming ``path`` and each rule its report breaks."""
    problems = check_report(Path(path).read_text())
    if problems:
        raise StudyError(f"{path}: not a complete reference report: " + "; ".join(problems))
