"""Untrusted foreign files: whatever a source holds, importing it succeeds or raises a ResurgoError.

Five small real fixtures are built once: a DCP checkpoint written by ``torch.distributed.checkpoint``
in one process, a torch.save file, a Hugging Face folder with a safetensors file, a DeepSpeed
ZeRO-2 folder of two ranks built by hand, and the spec JSON the torch importer emits. Each example
copies one and mutates it: a field of the unpickled structure replaced (DCP's own dataclasses,
torch's tensor rebuild calls with any geometry, shared and deep structures), a field of a JSON
header or spec replaced, or bytes of a file flipped or cut; and sometimes one of its files is
replaced by a symlink to a copy outside the source. ``resurgo.import_checkpoint`` must then:

- raise nothing but a ResurgoError (never a RecursionError, TypeError, IndexError, ...);
- open no file outside the source and the destination's folder (an audit hook watches ``open``);
- leave nothing in the destination's folder when it refuses;
- spend at most 1 s of CPU (the sources are about 10 KB; 1 s more per MB), and never take the process's peak memory
  (its resident set's high-water mark, reset before each example) more than 300 MB above where it was;
- when it succeeds, write a checkpoint that ``resurgo.load_dict`` reads.

The default run takes about half a minute; ``-m slow`` runs each property with 1000 examples.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import struct
import time
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import resurgo
from open_watch import opened_outside
from resurgo import ResurgoError
from resurgo.interop import spec as spec_lang
from resurgo.interop.torch_file import read_objects, spec_from_torch_file
from resurgo.interop.unpickle import DEEPSPEED, TensorRef

# No shrinking: an example is a whole import, and the failing draws are printed as they are.
FAST = settings(max_examples=250, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=1000, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CPU_SECONDS = 1.0  # per MB of source, and for any source under 10 KB: the bound
PEAK_BYTES = 300 << 20


# ------------------------------------------------------------------------------------------------
# Pickling structures as torch.save does, with tensors of any geometry
# ------------------------------------------------------------------------------------------------
class _StorageId:
    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _Rebuild:
    """Pickles as torch.save pickles a tensor: ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``."""

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any):
        self.args = [storage, offset, size, stride, False, OrderedDict()]

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, tuple(self.args)


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageId):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def as_picklable(node: Any) -> Any:
    """A structure read by the restricted unpickler, with each TensorRef as a :class:`_Rebuild`."""
    if isinstance(node, TensorRef):
        return _Rebuild(_StorageId(node.storage.key, node.storage.numel), node.offset, tuple(node.shape),
                        tuple(node.strides))
    if isinstance(node, dict):
        return type(node)((k, as_picklable(v)) for k, v in node.items())
    if isinstance(node, (list, tuple)):
        return type(node)(as_picklable(v) for v in node)
    return node


def replace_pickle(path: Path, obj: Any) -> None:
    """Rewrite the torch.save file ``path`` with ``obj`` as its data.pkl (its storages kept)."""
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    members[next(n for n in members if n.endswith("/data.pkl"))] = buf.getvalue()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)


# ------------------------------------------------------------------------------------------------
# Mutations
# ------------------------------------------------------------------------------------------------
def shared_lists(levels: int) -> list:
    node: list = [1]
    for _ in range(levels):
        node = [node, node]
    return node


def nested(depth: int) -> list:
    node: list = []
    for _ in range(depth):
        node = [node]
    return node


def _loop() -> list:
    loop: list = []
    loop.append(loop)
    return loop


HOSTILE_INTS = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 40),
                         st.sampled_from([-1, 0, 1, 2 ** 31, 2 ** 62, 2 ** 63, -2 ** 63, 10 ** 30]))
HOSTILE_PATHS = st.sampled_from(["../secret.bin", "/etc/passwd", "", ".", "a/../../b", "sub/../x", "\\x", "x\0"])
JSON_VALUES = st.recursive(
    st.one_of(HOSTILE_INTS, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6), HOSTILE_PATHS,
              st.none(), st.booleans()),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children, max_size=3)),
    max_leaves=8)
PICKLED_VALUES = st.one_of(
    JSON_VALUES,
    st.tuples(HOSTILE_INTS, HOSTILE_INTS),
    st.floats(),
    st.builds(nested, st.integers(1, 400)),
    st.builds(shared_lists, st.integers(5, 26)),
    st.builds(_loop),
    st.builds(lambda key, numel, off, size, stride: _Rebuild(_StorageId(key, numel), off, tuple(size), tuple(stride)),
              st.sampled_from(["0", "1", "9", "../0"]), HOSTILE_INTS, HOSTILE_INTS,
              st.lists(HOSTILE_INTS, max_size=3), st.lists(HOSTILE_INTS, max_size=3)),
    st.sampled_from([torch.float32, torch.int64, torch.Size([2, 3]), torch.Size([-1]), torch.Size([])]),
)


def slots(root: Any) -> list[tuple[Any, Any]]:
    """Every place a value can be replaced, in a stable order: (container, key) for dict values,
    list items, and the attributes of objects (DCP's dataclasses, _Rebuild's args, _StorageId)."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, list):
            items = list(enumerate(node))
        elif isinstance(node, _Rebuild):
            items = list(enumerate(node.args))
            node = node.args
        elif hasattr(node, "__dict__") and not isinstance(node, type):
            items = [(("attr", k), v) for k, v in vars(node).items()]
        else:
            continue
        for key, value in items:
            out.append((node, key))
            stack.append(value)
    return out


def put(container: Any, key: Any, value: Any) -> None:
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "attr":
        object.__setattr__(container, key[1], value)
    else:
        container[key] = value


def mutate_tree(root: Any, data: Any, values: Any) -> Any:
    """One to three values somewhere in ``root`` replaced (or a dict key renamed)."""
    for _ in range(data.draw(st.integers(1, 3))):
        places = slots(root)
        if not places:
            return data.draw(values)
        container, key = places[data.draw(st.integers(0, len(places) - 1))]
        if isinstance(container, dict) and data.draw(st.booleans()):
            new_key = data.draw(st.one_of(st.text(max_size=4), HOSTILE_INTS, HOSTILE_PATHS))
            try:
                container[new_key] = container.pop(key)
            except TypeError:  # an unhashable key: the value stays
                pass
        else:
            put(container, key, data.draw(values))
    return root


def mutate_bytes(path: Path, data: Any) -> None:
    """Bytes of ``path`` flipped at a few places, or the file cut short."""
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans()) and raw:
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 8))):
            if raw:
                raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(raw))


# ------------------------------------------------------------------------------------------------
# The fixtures and one attempt
# ------------------------------------------------------------------------------------------------
def _dcp_fixture(path: Path) -> None:
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(3), "step": 7,
             "lr": [0.1, 0.2]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _torch_fixture(path: Path) -> None:
    path.mkdir()
    torch.save({"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)[1:]},
                "n": 5, "names": ["a", "b"]}, path / "m.pt")


def _hf_fixture(path: Path) -> None:
    path.mkdir()
    save_file({"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, 2)}, str(path / "model.safetensors"))


def _deepspeed_fixture(root: Path) -> None:
    """A ZeRO-2 checkpoint of two data-parallel ranks, as DeepSpeed lays it out."""
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    w, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([10.0, 11.0])
    flat = torch.cat([w.flatten(), b])
    torch.save({"module": OrderedDict([("fc.weight", w), ("fc.bias", b), ("buf", torch.zeros(2))]),
                "param_shapes": [OrderedDict([("fc.weight", torch.Size([2, 3])), ("fc.bias", torch.Size([2]))])],
                "buffer_names": ["buf"], "shared_params": {}, "global_steps": 1, "global_samples": 8,
                "skipped_steps": 0, "ds_version": "0.14.0", "lr_scheduler": {"last_epoch": 1}},
               tag / "mp_rank_00_model_states.pt")
    for r in range(2):
        part = flat[4 * r: 4 * r + 4].clone()
        torch.save({"optimizer_state_dict": {
            "zero_stage": 2, "partition_count": 2, "single_partition_of_fp32_groups": [part],
            "base_optimizer_state": {"state": {0: {"exp_avg": part * 0.5, "exp_avg_sq": part * 0.25,
                                                   "step": torch.tensor(1.0)}},
                                     "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]}}},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")


def _spec_fixture(path: Path) -> None:
    _torch_fixture(path)
    (path / "spec.json").write_text(spec_lang.dumps(spec_from_torch_file(path / "m.pt")))


FIXTURES: dict[str, Callable[[Path], None]] = {"dcp": _dcp_fixture, "torch": _torch_fixture, "hf": _hf_fixture,
                                               "deepspeed": _deepspeed_fixture, "spec": _spec_fixture}


def _status_bytes(field: str) -> int:
    """A memory line of /proc/self/status ("VmRSS:", "VmHWM:"), in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) << 10
    raise KeyError(field)


def _reset_peak() -> int:
    """Make the peak resident set (VmHWM) the current one, so that it measures one attempt alone
    and not what earlier tests of the same process left; returns the current resident set."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status_bytes("VmRSS:")


class Bench:
    """The pristine fixtures, a work copy per example, and the attempt with every check."""

    def __init__(self, base: Path):
        self.base = base
        for name, build in FIXTURES.items():
            build(base / "pristine" / name)
        self.outcomes: dict[str, dict[str, int]] = {name: {} for name in FIXTURES}
        self.largest: dict[str, tuple[int, float, int]] = {}  # source bytes, CPU seconds, peak growth
        self.slowest: dict[str, tuple[int, float, str]] = {}  # source bytes, CPU seconds, outcome

    def fresh(self, name: str) -> Path:
        src = self.base / "work" / name
        shutil.rmtree(self.base / "work", ignore_errors=True)
        shutil.copytree(self.base / "pristine" / name, src, symlinks=True)
        return src

    def link_out(self, name: str, src: Path, data: Any) -> None:
        """Sometimes: one file of the source replaced by a symlink to a copy of it outside the
        source (the import must refuse it, or never open it); the file the caller names is exempt."""
        named = {"torch": "m.pt", "spec": "spec.json"}.get(name)
        files = sorted(p for p in src.rglob("*") if p.is_file() and p.name != named)
        if not files or data.draw(st.integers(0, 7)) != 0:
            return
        victim = data.draw(st.sampled_from(files))
        outside = self.base / "outside" / victim.name
        outside.parent.mkdir(exist_ok=True)
        shutil.copyfile(victim, outside)
        victim.unlink()
        victim.symlink_to(outside)

    def attempt(self, name: str, src: Path) -> str:
        args = {"source": name}
        target = src / "m.pt" if name == "torch" else src
        if name == "spec":
            args["spec"] = src / "spec.json"
        out = self.base / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
        rss_before = _reset_peak()
        cpu = time.process_time()
        with opened_outside(src, out) as outside:
            try:
                resurgo.import_checkpoint(target, out / "ckpt", **args)
            except ResurgoError as e:
                outcome = type(e).__name__
                assert len(str(e)) < 20_000, f"an error message of {len(str(e))} characters"
                assert os.listdir(out) == [], f"a refused import left {os.listdir(out)}"
            else:
                outcome = "ok"
            finally:
                cpu = time.process_time() - cpu
                peak = _status_bytes("VmHWM:") - rss_before
        assert not outside, f"opened files outside the source: {outside}"
        assert cpu < CPU_SECONDS * (1 + size / (1 << 20)), f"{cpu:.2f} s of CPU for a {size}-byte source"
        assert peak < PEAK_BYTES, f"the peak memory grew by {peak >> 20} MB (a {size}-byte source)"
        if outcome == "ok":
            resurgo.load_dict(out / "ckpt")
        self.outcomes[name][outcome] = self.outcomes[name].get(outcome, 0) + 1
        if size >= self.largest.get(name, (0, 0.0, 0))[0]:
            self.largest[name] = (size, cpu, peak)
        if cpu >= self.slowest.get(name, (0, 0.0, outcome))[1]:
            self.slowest[name] = (size, cpu, outcome)
        return outcome


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    b = Bench(tmp_path_factory.mktemp("import-fuzz"))
    for name in FIXTURES:  # the pristine sources import, and every lazy import is done before measuring
        assert b.attempt(name, b.fresh(name)) == "ok"
    yield b
    print("\nimport fuzz outcomes:", json.dumps(b.outcomes), "\nlargest source (bytes, CPU s, peak RSS growth bytes):",
          json.dumps(b.largest), "\nslowest (bytes, CPU s, outcome):", json.dumps(b.slowest))


# ------------------------------------------------------------------------------------------------
# The properties
# ------------------------------------------------------------------------------------------------
def fuzz_dcp(bench: Bench, data: Any) -> None:
    src = bench.fresh("dcp")
    if data.draw(st.integers(0, 3)) == 0:
        mutate_bytes(data.draw(st.sampled_from(sorted(src.iterdir()))), data)
    else:
        md = pickle.loads((src / ".metadata").read_bytes())  # our own fixture: a plain load is fine here
        md = mutate_tree(md, data, PICKLED_VALUES)
        try:
            raw = pickle.dumps(md)
        except Exception:  # noqa: BLE001 - a mutation DCP's own __getstate__ cannot encode: nothing to try
            return
        (src / ".metadata").write_bytes(raw)
    bench.link_out("dcp", src, data)
    bench.attempt("dcp", src)


def fuzz_torch_file(bench: Bench, path: Path, data: Any) -> None:
    if data.draw(st.integers(0, 3)) == 0:
        mutate_bytes(path, data)
        return
    obj, _ = read_objects(path, DEEPSPEED)
    replace_pickle(path, mutate_tree(as_picklable(obj), data, PICKLED_VALUES))


def fuzz_torch(bench: Bench, data: Any) -> None:
    src = bench.fresh("torch")
    fuzz_torch_file(bench, src / "m.pt", data)
    bench.link_out("torch", src, data)
    bench.attempt("torch", src)


def fuzz_hf(bench: Bench, data: Any) -> None:
    src = bench.fresh("hf")
    path = src / "model.safetensors"
    if data.draw(st.integers(0, 3)) == 0:
        mutate_bytes(path, data)
    else:
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        doc = mutate_tree(json.loads(raw[8: 8 + n]), data, JSON_VALUES)
        header = json.dumps(doc).encode()
        path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n:])
    bench.link_out("hf", src, data)
    bench.attempt("hf", src)


def fuzz_deepspeed(bench: Bench, data: Any) -> None:
    src = bench.fresh("deepspeed")
    files = sorted((src / "global_step1").iterdir()) + [src / "latest"]
    path = data.draw(st.sampled_from(files))
    if path.name == "latest":
        mutate_bytes(path, data)
    else:
        fuzz_torch_file(bench, path, data)
    bench.link_out("deepspeed", src, data)
    bench.attempt("deepspeed", src)


def fuzz_spec(bench: Bench, data: Any) -> None:
    src = bench.fresh("spec")
    doc = mutate_tree(json.loads((src / "spec.json").read_text()), data, JSON_VALUES)
    (src / "spec.json").write_text(json.dumps(doc))
    bench.link_out("spec", src, data)
    bench.attempt("spec", src)


PROPERTIES = {"dcp": fuzz_dcp, "torch": fuzz_torch, "hf": fuzz_hf, "deepspeed": fuzz_deepspeed, "spec": fuzz_spec}


@pytest.mark.parametrize("kind", list(PROPERTIES))
@FAST
@given(data=st.data())
def test_mutated_source(bench: Bench, kind: str, data):
    PROPERTIES[kind](bench, data)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(PROPERTIES))
@SLOW
@given(data=st.data())
def test_mutated_source_slow(bench: Bench, kind: str, data):
    PROPERTIES[kind](bench, data)
