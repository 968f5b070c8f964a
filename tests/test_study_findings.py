"""The study's findings (resurgo.study.findings): an order between mechanisms is claimed only
where their intervals do not overlap; the sentences name the cheapest, the smallest and the exact
restarts from the numbers; the paper's takeaways are checked as reproduced, differing or not
distinguishable."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from resurgo.study.findings import (
    Ranked, cost_findings, determinism_findings, formats_findings, order_sentence, overlap_groups, paper_comparison,
)


@st.composite
def intervals(draw) -> list[Ranked]:
    n = draw(st.integers(1, 8))
    out = []
    for i in range(n):
        low = draw(st.floats(-50, 50, allow_nan=False))
        width = draw(st.floats(0, 30, allow_nan=False))
        mid = draw(st.floats(low, low + width, allow_nan=False))
        out.append(Ranked(f"m{i}", low, mid, low + width))
    return out


@given(intervals())
def test_groups_are_apart_and_overlapping_intervals_share_a_group(items):
    groups = overlap_groups(items)
    assert sorted(r.label for g in groups for r in g) == sorted(r.label for r in items)  # each once
    for g, h in zip(groups, groups[1:]):  # an order is claimed: every interval of g ends below h's start
        assert max(r.high for r in g) < min(r.low for r in h)
    where = {r.label: i for i, g in enumerate(groups) for r in g}
    for a in items:
        for b in items:
            if a.low <= b.high and b.low <= a.high:  # overlapping intervals: never ordered
                assert where[a.label] == where[b.label]


@given(intervals())
def test_the_sentence_never_orders_overlapping_intervals(items):
    text = order_sentence(items, "overhead")
    groups = overlap_groups(items)
    # the sentence's "then"-separated parts are the groups, in order, each naming its members
    parts = text.split("; then ") if len(groups) > 1 else [text]
    assert len(parts) == len(groups)
    for part, group in zip(parts, groups):
        assert {r.label for r in group} == set(re.findall(r"\bm\d+\b", part))
        if len(group) > 1:
            assert "not distinguishable" in part


def _cost(label: str, low: float, mid: float, high: float, model: str = "resnet50", **extra) -> dict:
    return {"model": model, "mechanism": extra.pop("mechanism", label), "label": label, "overhead_pct": mid,
            "overhead_low_pct": low, "overhead_high_pct": high, "noise": low <= 0 <= high, "stall": None, **extra}


def test_cost_findings_name_the_cheapest_only_when_apart():
    results = {"cost": [_cost("A", 1, 2, 3), _cost("B", 5, 6, 7), _cost("C", 6.5, 8, 9)], "formats": []}
    assert cost_findings(results) == ["ResNet-50: A costs least by overhead, its interval below every other's; then "
                                      "B and C (not distinguishable from each other)."]
    results["cost"][0].update(overhead_low_pct=-1.0, overhead_high_pct=5.5, noise=True)
    assert cost_findings(results) == ["ResNet-50: A, B and C are not distinguishable by overhead: their intervals "
                                      "overlap. The overhead of A is not distinguishable from noise (its interval "
                                      "holds 0)."]


def test_cost_findings_say_what_compression_costs():
    def row(label: str, ratio: float, save_s: list[float]) -> dict:
        return {**_fmt(label, int(ratio * (100 << 20))), "model": "resnet50", "save_s": save_s}

    results = {"cost": [_cost("A", 1, 2, 3)],
               "formats": [row("npz", 0.9, [6.0, 7.0, 6.5]), row("plain", 1.0, [0.5, 0.4, 0.6]),
                           row("other", 1.01, [0.9, 0.7, 0.8])]}
    assert cost_findings(results)[1] == ("npz compresses (0.900 x the raw tensor bytes) and takes 6.50 s to save one "
                                         "ResNet-50 checkpoint alone, against a median 0.65 s for the mechanisms that "
                                         "write the bytes as they are.")


def _fmt(label: str, nbytes: int, files: int = 1, optimizer: bool = True, code: str = "no", **extra) -> dict:
    return {"model": "vgg16", "mechanism": extra.pop("mechanism", label), "label": label, "bytes": nbytes,
            "raw_tensor_bytes": 100 << 20, "size_over_raw": nbytes / (100 << 20), "files": files,
            "stores": {"weights": True, "optimizer": optimizer, "rng": False, "data_position": False},
            "executes_code": code, "fsync": True, **extra}


def test_formats_findings_name_the_smallest_files():
    results = {"cost": [_cost("x", 1, 2, 3, model="vgg16")],
               "formats": [_fmt("big", 110 << 20, files=3, code="yes"), _fmt("npz", 90 << 20),
                           _fmt("weights", 40 << 20, optimizer=False)]}
    assert formats_findings(results) == [
        "VGG-16: of the checkpoints holding weights and optimizer state, npz is smallest (90.0 MiB, 0.900 x the raw "
        "tensor bytes); the largest is 110.0 MiB. Only npz write fewer bytes than the tensors hold: compression.",
        "Several files per checkpoint: big (3 files); the rest write one.",
        "Loading big can run code from the file (pickle); the others read data only."]
    # one mechanism's file counts over the networks: said once, as a range
    results["formats"].append({**_fmt("big", 110 << 20, files=5, code="yes"), "model": "resnet50"})
    assert "Several files per checkpoint: big (3-5 files); the rest write one." in formats_findings(results)


def _restart(label: str, diff: float, rng: bool) -> dict:
    return {"label": label, "identical": diff == 0.0, "max_abs_diff": diff,
            "stores": {"weights": True, "optimizer": True, "rng": rng, "data_position": rng}}


def test_determinism_findings_say_which_restart_exactly_and_why_not():
    results = {"determinism": {"vgg16": {"restarts": {"a": _restart("resurgo.save", 0.0, True),
                                                      "b": _restart("torch.save", 0.25, False)}}},
               "frameworks": {"chainer": {"ran": True, "determinism": {"vgg16": {"restarts": {
                   "c": _restart("Chainer", 0.5, False)}}}}}}
    assert determinism_findings(results) == [
        "resurgo.save restart exactly: the loss curve after the restart is bit for bit the uninterrupted one, for "
        "every network.",
        "torch.save (up to 0.25) and Chainer (up to 0.5) diverge after the restart.",
        "Chainer and torch.save store neither the RNG state nor the data position: the restarted run draws other "
        "batches, augmentations and dropout masks."]
    # exact for one network only, and a mechanism that stores everything yet differs: each said as it is
    tf = {"a": _restart("TF", 0.0, False), "b": _restart("TF", 95.5, False)}
    for name, r in tf.items():
        r["stores"]["data_position"] = True
    results = {"determinism": {"resnet50": {"restarts": {"x": _restart("X", 0.5, True)}}},
               "frameworks": {"tensorflow": {"ran": True, "determinism": {"resnet50": {"restarts": {"t": tf["a"]}},
                                                                         "vgg16": {"restarts": {"t": tf["b"]}}}}}}
    assert determinism_findings(results) == [
        "TF restarts exactly for ResNet-50 but not for VGG-16 (up to 95.5).",
        "X (up to 0.5) diverge after the restart.",
        "TF stores the data position but no RNG state: the restarted run sees the same batches but draws other random "
        "numbers (augmentation, dropout), so only a network whose training draws none of its own restarts exactly.",
        "X stores the optimizer, the RNG state and the data position, and still differs: the difference comes from "
        "outside the checkpoint (nondeterministic kernels, state the job keeps elsewhere)."]


def test_paper_takeaways_checked_on_the_numbers():
    results = {
        "cost": [_cost("torch.save", 9, 10, 11, mechanism="torch_save"),
                 _cost("TF", 1, 2, 3, mechanism="tf_checkpoint_manager"),
                 _cost("Chainer", 2.5, 4, 8, mechanism="chainer_save_npz")],
        "formats": [_fmt("torch.save", 100 << 20, mechanism="torch_save", model="resnet50"),
                    _fmt("Chainer", 90 << 20, mechanism="chainer_save_npz", model="resnet50")],
        "determinism": {"resnet50": {"restarts": {"torch_save": _restart("torch.save", 0.5, False)}}},
        "frameworks": {"chainer": {"ran": True, "determinism": {"resnet50": {"restarts": {
            "chainer_save_npz": _restart("Chainer", 0.25, False)}}}}},
        "scale": []}
    for row in results["formats"]:
        row["model"] = "resnet50"
    lines = paper_comparison(results)
    assert lines[0] == ("- TensorFlow's checkpoints cost least (2.3% overhead on average): ResNet-50, not "
                        "distinguishable: TF and Chainer overlap (TensorFlow +2.0% here).")
    assert lines[1] == "- Chainer writes the smallest checkpoint files: ResNet-50, reproduced (90.0 MiB, compressed npz)."
    assert lines[2] == ("- PyTorch restarts closer to the uninterrupted run than Chainer and TensorFlow: ResNet-50, "
                        "differs: Chainer restarts as close or closer (largest loss difference after the restart: "
                        "PyTorch 0.5, Chainer 0.25).")
    assert lines[3].startswith("- at scale, TensorFlow keeps the lowest checkpoint overhead and Chainer's grows: "
                               "not checked")
    results["cost"][2].update(overhead_low_pct=3.5)  # apart now: TensorFlow alone below the others
    # per network: PyTorch closer on one, not on the other
    results["determinism"]["vgg16"] = {"restarts": {"torch_save": _restart("torch.save", 0.125, False)}}
    results["frameworks"]["chainer"]["determinism"]["vgg16"] = {"restarts": {
        "chainer_save_npz": _restart("Chainer", 0.25, False)}}
    results["cost"].append(_cost("torch.save", 9, 10, 11, mechanism="torch_save", model="vgg16"))
    lines = paper_comparison(results)
    assert [line for line in lines if "restarts closer" in line] == [
        "- PyTorch restarts closer to the uninterrupted run than Chainer and TensorFlow: ResNet-50, differs: Chainer "
        "restarts as close or closer (largest loss difference after the restart: PyTorch 0.5, Chainer 0.25).",
        "- PyTorch restarts closer to the uninterrupted run than Chainer and TensorFlow: VGG-16, reproduced (largest "
        "loss difference after the restart: PyTorch 0.125, Chainer 0.25)."]
    assert "ResNet-50, reproduced (TensorFlow +2.0% here)" in paper_comparison(results)[0]
