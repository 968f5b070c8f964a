"""The committed reference report (docs/study/reference.md): the run of ``resurgo study --reference``
that the README links to. It has the reference structure (every framework ran, equal parameter
counts, an interval for every overhead, findings for the four questions, the machine), it is what
its committed results render to, and its figures are committed beside it and small."""

from __future__ import annotations

import json
import re
from pathlib import Path

from resurgo.study.reference import FRAMEWORK_LABELS, check_report, require_reference_structure
from resurgo.study.report import render_markdown

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "docs" / "study"
REPORT = FOLDER / "reference.md"
RESULTS = FOLDER / "reference-results.json"
MOST_BYTES = 4 << 20  # "at most a few MB": the report, its figures and its results together
RERENDER = ('.venv/bin/python -c "import json; from resurgo.study.report import render_markdown; '
            "open('docs/study/reference.md', 'w').write(render_markdown(json.load(open("
            "'docs/study/reference-results.json'))))\"")


def test_the_reference_report_has_the_reference_structure():
    assert check_report(REPORT.read_text()) == []
    require_reference_structure(REPORT)


def test_the_reference_report_is_what_its_results_render_to():
    """The report is not edited by hand: it is the rendering of the run's results.json."""
    results = json.loads(RESULTS.read_text())
    assert REPORT.read_text() == render_markdown(results), f"re-render it: {RERENDER}"
    assert results["config"]["preset"] == "reference"
    assert {fw["label"] for fw in results["frameworks"].values() if fw["ran"]} == set(FRAMEWORK_LABELS) - {"PyTorch"}
    # the scale experiment ran in every framework, on 1, 2 and 4 processes
    worlds = {(r.get("framework", "pytorch"), r["ranks"]) for r in results["scale"]}
    assert worlds == {(fw, n) for fw in ("pytorch", "tensorflow", "jax", "chainer") for n in (1, 2, 4)}


def test_the_reference_reports_figures_are_beside_it_and_the_folder_is_small():
    text = REPORT.read_text()
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert figures, "the report shows no figure"
    for name in figures:
        path = FOLDER / name
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    on_disk = {p.name for p in FOLDER.iterdir()}
    assert on_disk == {REPORT.name, RESULTS.name, *figures}, "files in docs/study/ that the report does not use"
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) <= MOST_BYTES


def test_the_readme_and_the_study_guide_link_the_reference_report():
    assert "(docs/study/reference.md)" in (ROOT / "README.md").read_text()
    assert "(study/reference.md)" in (ROOT / "docs" / "study.md").read_text()
