"""The study's networks across frameworks as the report shows them: each framework's parameter
count of each network beside PyTorch's, with the ratio, and the stock networks as extra rows
labelled as another architecture. (The counts themselves are checked in each framework's
environment by test_study_frameworks.py under ``-m frameworks``.)"""

from __future__ import annotations

from resurgo.study.frameworks import could_not_run
from resurgo.study.report import render_frameworks

RESNET, VGG = 23_520_842, 14_990_922  # PyTorch's (test_study.py checks them)


def _framework(label: str, counts: dict, stock: dict) -> dict:
    return {"label": label, "ran": True, "versions": {label.lower(): "1.0"}, "duration_s": 1.0, "scale": "not run",
            "models": {m: {"parameters": n, "architecture": f"{label} layers", "stock": stock.get(m)}
                       for m, n in counts.items()}}


def _table_rows(text: str, header: str) -> list[list[str]]:
    lines = text[text.index(header):].splitlines()
    rows = []
    for ln in lines[2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_architecture_table_shows_each_count_beside_pytorchs_and_the_ratio():
    keras_stock = {"resnet50": {"definition": "keras.applications.ResNet50", "parameters": 23_555_082},
                   "vgg16": {"definition": "keras.applications.VGG16", "parameters": 33_638_218}}
    results = {"models": {"resnet50": {"parameters": RESNET}, "vgg16": {"parameters": VGG}},
               "environment": {"torch": "2.0"}, "scale": [],
               "frameworks": {"tensorflow": _framework("TensorFlow", {"resnet50": RESNET, "vgg16": VGG}, keras_stock),
                              "jax": _framework("JAX/Orbax", {"resnet50": RESNET, "vgg16": VGG + 15}, {}),
                              "chainer": could_not_run("chainer", "pip failed: E")}}
    rows = _table_rows(render_frameworks(results), "| framework | model | parameters | PyTorch's | ratio |")
    r, v = f"{RESNET:,}", f"{VGG:,}"
    assert [row[:5] for row in rows] == [
        ["PyTorch", "ResNet-50", r, r, "1.0000"], ["PyTorch", "VGG-16", v, v, "1.0000"],
        ["TensorFlow", "ResNet-50", r, r, "1.0000"], ["TensorFlow", "VGG-16", v, v, "1.0000"],
        # the stock networks follow their framework's rows, labelled: another architecture
        ["TensorFlow (stock, not the shared architecture)", "ResNet-50", "23,555,082", r, "1.0015"],
        ["TensorFlow (stock, not the shared architecture)", "VGG-16", "33,638,218", v, "2.2439"],
        ["JAX/Orbax", "ResNet-50", r, r, "1.0000"], ["JAX/Orbax", "VGG-16", "14,990,937", v, "1.0000"],
        ["Chainer", "ResNet-50", "-", r, "-"], ["Chainer", "VGG-16", "-", v, "-"]]
    assert rows[4][5] == "keras.applications.ResNet50" and rows[2][5] == "TensorFlow layers"
    assert rows[-1][5] == "could not run: pip failed: E"
