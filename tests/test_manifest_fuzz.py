"""Untrusted manifests: whatever ``manifest.json`` holds, reading it raises a ResurgoError or succeeds.

One small checkpoint is saved once; then its manifest is replaced by (a) arbitrary bytes and
arbitrary JSON, (b) structured mutations of the real document (a value somewhere replaced,
deleted or duplicated, mostly by a near miss of the same type) and (c) tensor entries and trees
generated from the format's grammar, valid or nearly so. ``resurgo.read_manifest``, ``resurgo.load_dict`` and ``resurgo.load``
must each either succeed or raise a :class:`resurgo.ResurgoError`: never another exception, a
crash, a hang, a huge allocation, or a read of a file outside the checkpoint (an audit hook
watches every ``open``). A load that succeeds may have been told other dtypes or shapes, but
every tensor it returns holds bytes that were really saved (checksums were verified).

Then one deterministic test per named bad case asserts the exact error class. The default run
takes about half a minute; ``make test-slow`` runs the properties with 5000 examples each.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resurgo
from resurgo import (
    CorruptCheckpointError,
    KeyMismatchError,
    ManifestError,
    PickleNotAllowedError,
    ResurgoError,
    TypeMismatchError,
)
from resurgo.format import dtypes as _dtypes
from resurgo.format.manifest import SEAL_FIELD, parse_manifest, seal
from resurgo.pipeline.verify import verify_checkpoint

from helpers import resealed
from open_watch import opened_outside

_file_bytes: dict[str, bytes] = {}  # the data files' bytes, by manifest path
BLOCK = 16  # small blocks: every chunk has several checksums, so list mutations matter
MAX_MESSAGE = 20_000

FAST = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=5_000, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------
# The checkpoint under attack
# ------------------------------------------------------------------------------------------------
class Counter:
    """A Stateful, so that load() exercises the load_state_dict path."""

    def __init__(self, n: int, t: torch.Tensor):
        self.n, self.t = n, t

    def state_dict(self) -> dict:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd: Any) -> None:
        self.loaded = sd


def make_state(target: bool = False) -> dict:
    """The saved state; with ``target=True`` the same structure with every tensor byte 0xA5."""
    g = torch.Generator().manual_seed(7)
    state = {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(4, 3, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "name": "all"}],
        },
        "arr": np.arange(5, dtype=np.int16) * 3 + 1,
        "empty": torch.empty(0, 3),
        "flags": torch.tensor([True, False, True]),
        "counter": Counter(3, torch.arange(6, dtype=torch.int64) + 100),
        "scalars": OrderedDict(
            i=-(2**70), f=float("nan"), c=complex(1.5, -0.0), s="héllo", by=b"\x00\xff", n=None, t=True,
            ns=np.float32(2.5), dt=torch.float16, dev=torch.device("cpu"), sz=torch.Size([2, 3]),
        ),
        "tup": (1, [2.0, (3,)], {}),
    }
    if target:
        for t in tensors_in(state):
            if isinstance(t, np.ndarray):
                t.view(np.uint8)[...] = 0xA5
            else:
                t.reshape(-1).view(torch.uint8).fill_(0xA5)
    return state


def tensors_in(obj: Any) -> list:
    """Every tensor and array reachable from ``obj`` (through containers and Statefuls)."""
    out: list = []
    seen: set[int] = set()

    def walk(o: Any, depth: int) -> None:
        if depth > 200 or id(o) in seen:
            return
        if isinstance(o, (torch.Tensor, np.ndarray)):
            out.append(o)
            return
        seen.add(id(o))
        if isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif isinstance(o, Counter):
            walk(o.t, depth + 1)
            walk(getattr(o, "loaded", None), depth + 1)

    walk(obj, 0)
    return out


def raw_bytes(t: Any) -> bytes:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class Bench:
    """The saved checkpoint, and every way of reading it with a replaced manifest."""

    def __init__(self, path: Path):
        self.path = path
        self.raw = (path / "manifest.json").read_bytes()
        self.doc = json.loads(self.raw)
        del self.doc[SEAL_FIELD]  # edited documents are sealed again as they are written (attempt)
        self.bases: list[dict] = [self.doc]  # and multi-chunk variants, once the file bytes are known
        self.originals = {raw_bytes(t) for t in tensors_in(make_state())}
        self.data_file = next(iter(self.doc["files"]))

    def write(self, raw: bytes) -> None:
        (self.path / "manifest.json").write_bytes(raw)

    def attempt(self, raw: bytes, check_bytes: bool = True, reseal: bool = True) -> list[str]:
        """Write ``raw`` as the manifest and run every reader; returns each outcome's name.

        ``check_bytes``: every tensor a successful load returns holds the bytes of a saved tensor
        (off for generated manifests, which may legally describe any verified bytes of a file).
        ``reseal``: seal edited bytes again, so that they reach the checks after the manifest's
        own checksum (what a crafted manifest would do); off to test that checksum. ``verify``
        runs too: its outcome is left in :attr:`verified`.
        """
        self.write(resealed(raw) if reseal else raw)
        outcomes = []
        for name, fn in (("read_manifest", lambda: resurgo.read_manifest(self.path)),
                         ("load_dict", lambda: resurgo.load_dict(self.path)),
                         ("load", self._load_target)):
            with opened_outside(self.path) as outside:
                try:
                    result = fn()
                except ResurgoError as e:
                    message = str(e)
                    assert len(message) < MAX_MESSAGE, f"{name}: error message of {len(message)} characters"
                    outcomes.append(type(e).__name__)
                else:
                    outcomes.append("ok")
                    if name != "read_manifest" and check_bytes:
                        for t in tensors_in(result):
                            assert raw_bytes(t) in self.originals, f"{name} returned bytes that were never saved"
            assert not outside, f"{name} opened files outside the checkpoint: {outside}"
        self.verified = self._verify()
        return outcomes

    def _verify(self) -> str:
        """``verify``'s outcome. When it finds nothing wrong, a plain safetensors reader of each data
        file sees each whole tensor with the dtype and shape the manifest gives (or its raw bytes)."""
        with opened_outside(self.path) as outside:
            try:
                report = verify_checkpoint(self.path)
            except ResurgoError as e:
                return type(e).__name__
        assert not outside, f"verify opened files outside the checkpoint: {outside}"
        if not report.ok:
            return "verify found problems"
        doc = json.loads((self.path / "manifest.json").read_bytes())
        for key, t in doc["tensors"].items():
            for c in t["chunks"]:
                nbytes = c["byte_range"][1] - c["byte_range"][0] if "file" in c else 0
                if not nbytes:  # an empty chunk holds no bytes, nor a tensor of the file
                    continue
                declared = _header_of(self.path / c["file"])[c.get("name", key)]
                shape = c["box"]["shape"] if "box" in c else [c["flat"]["stop"] - c["flat"]["start"]]
                code = _dtypes.SAFETENSORS_CODES.get(t["dtype"])
                expected = (code, shape) if code is not None else ("U8", [nbytes])
                assert (declared["dtype"], declared["shape"]) == expected, (key, declared, expected)
        return "verified"

    def _load_target(self) -> Any:
        target = make_state(target=True)
        resurgo.load(target, self.path)
        return target


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Bench:
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    resurgo.save(make_state(), path, block_bytes=BLOCK, step=5, metadata={"run": "fuzz", "nested": {"a": [1, 2]}})
    b = Bench(path)
    for name in b.doc["files"]:
        _file_bytes[name] = (path / name).read_bytes()
    b.bases[1:] = [split_doc(b.doc, "box"), split_doc(b.doc, "flat"),
                   split_doc(b.doc, "box", key="optimizer.state.0.exp_avg", rows=3)]
    yield b
    b.write(b.raw)


def dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _header_of(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


@FAST
@given(data=st.data())
def test_a_member_named_twice_is_refused_by_every_reader(bench: Bench, data):
    """Any object of the manifest given one of its keys a second time, with another value: every
    reader refuses it (Python's parser alone would keep the second silently)."""
    base = data.draw(st.sampled_from(bench.bases))
    objects = [p for p in [()] + paths_of(base) if isinstance(get_at(base, p), dict) and get_at(base, p)]
    path = data.draw(st.sampled_from(objects))
    key = data.draw(st.sampled_from(sorted(get_at(base, path))))
    doc = copy.deepcopy(base)
    get_at(doc, path)["@@DUP@@"] = None
    twin = data.draw(typed_values(get_at(base, path)[key], base))
    text = serialize(doc).replace(b'"@@DUP@@": null', json.dumps(key).encode() + b": " + serialize(twin))
    assert bench.attempt(text) == ["ManifestError"] * 3 and bench.verified == "ManifestError"


def test_the_pristine_manifest_loads_bitwise(bench: Bench):
    assert bench.attempt(bench.raw) == ["ok", "ok", "ok"]
    loaded = resurgo.load_dict(bench.path)
    want = make_state()
    assert [raw_bytes(t) for t in tensors_in(loaded)] == [raw_bytes(t) for t in tensors_in(want)]


# ------------------------------------------------------------------------------------------------
# The manifest's own checksum (format section 5.4)
# ------------------------------------------------------------------------------------------------
def test_every_flipped_bit_of_the_manifest_is_caught(bench: Bench):
    """No single flipped bit anywhere in the manifest is accepted; where the JSON still parses to
    the same members, it is the manifest's checksum that refuses it."""
    raw = bench.raw
    digest_at = raw.rindex(b'"manifest_checksum":"') + len(b'"manifest_checksum":"')
    outcomes: dict[str, int] = {}
    for i in range(len(raw)):
        for bit in (0x01, 0x10):
            flipped = bytearray(raw)
            flipped[i] ^= bit
            with pytest.raises((ManifestError, CorruptCheckpointError)) as err:
                parse_manifest(bytes(flipped))
            outcomes[err.type.__name__] = outcomes.get(err.type.__name__, 0) + 1
            try:
                doc = json.loads(bytes(flipped))
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.keys() == bench.doc.keys() | {SEAL_FIELD} and not (
                    digest_at <= i < digest_at + 32):
                assert err.type is CorruptCheckpointError, (i, bit, str(err.value))
    assert outcomes["CorruptCheckpointError"] > len(raw)  # most flips land in values the JSON still parses
    assert sum(outcomes.values()) == 2 * len(raw)


def test_the_pristine_manifest_is_compact_and_sealed_last(bench: Bench):
    assert bench.raw.endswith(b',"manifest_checksum":"' + json.loads(bench.raw)[SEAL_FIELD].encode() + b'"}')
    assert bench.raw == json.dumps(json.loads(bench.raw), separators=(",", ":")).encode()
    zeroed = bench.raw[:-34] + b"0" * 32 + b'"}'
    assert xxhash.xxh3_128_hexdigest(zeroed) == json.loads(bench.raw)[SEAL_FIELD]


def test_a_changed_value_fails_the_seal_with_both_digests_named(bench: Bench):
    raw = bench.raw.replace(b'"step":5', b'"step":6', 1)
    stored = json.loads(raw)[SEAL_FIELD]
    expect(bench, raw, CorruptCheckpointError, f"manifest.json: the manifest's bytes do not match .*stored {stored}",
           reseal=False)


def test_a_reencoded_manifest_is_refused(bench: Bench):
    doc = json.loads(bench.raw)
    expect(bench, json.dumps(doc, indent=2).encode(), ManifestError, "re-encoded", reseal=False)
    reordered = {SEAL_FIELD: doc[SEAL_FIELD], **{k: v for k, v in doc.items() if k != SEAL_FIELD}}
    expect(bench, json.dumps(reordered, separators=(",", ":")).encode(), ManifestError, "last member", reseal=False)
    digest = doc[SEAL_FIELD].encode()
    for tail in (digest.upper() + b'"}', digest[:31] + b'"}', digest + b'0"}'):  # not 32 lowercase hex digits
        expect(bench, bench.raw[:-34] + tail, ManifestError, "32 hex digits", reseal=False)
    for value in (b"12345", b"null", b"[]"):
        expect(bench, bench.raw[:-35] + value + b"}", ManifestError, "32 hex digits", reseal=False)


def test_whitespace_after_the_manifest_is_not_covered(bench: Bench):
    assert bench.attempt(bench.raw + b"\n \t\r\n", reseal=False) == ["ok", "ok", "ok"]


def test_version_2_needs_the_seal_and_unsealed_version_1_is_refused(bench: Bench):
    unsealed = json.dumps(bench.doc, separators=(",", ":")).encode()
    expect(bench, unsealed, ManifestError, "needs its 'manifest_checksum'.*unsealed and cannot be trusted",
           reseal=False)
    # An edited manifest relabelled as the unsealed version 1: the step changed, the seal dropped.
    v1 = json.dumps({**bench.doc, "version": 1, "step": 6}, separators=(",", ":")).encode()
    expect(bench, v1, ManifestError, "format version 1 is unsealed.*cannot be trusted", reseal=False)
    with pytest.raises(ManifestError, match=f"{re.escape(str(bench.path))}.*version 1 is unsealed"):
        verify_checkpoint(bench.path)
    expect(bench, seal(v1), ManifestError, "format version 1 is unsealed", reseal=False)


# ------------------------------------------------------------------------------------------------
# (a) arbitrary bytes and arbitrary JSON
# ------------------------------------------------------------------------------------------------
json_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True)
                | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
                           max_leaves=25)


@FAST
@given(raw=st.binary(max_size=3000))
def test_arbitrary_bytes(bench: Bench, raw: bytes):
    outcomes = bench.attempt(raw)
    assert outcomes == ["ManifestError"] * 3


@FAST
@given(doc=json_values)
def test_arbitrary_json(bench: Bench, doc: Any):
    outcomes = bench.attempt(dumps(doc))
    assert outcomes == ["ManifestError"] * 3


@FAST
@given(extra=st.dictionaries(st.sampled_from(["created_at", "step", "metadata", "library", "world",
                                              "checksum_algorithm", "pickled", "files", "tensors", "tree", "x"]),
                             json_values, max_size=6))
def test_arbitrary_sections(bench: Bench, extra: dict):
    """Past the format/version check: every top-level section replaced by arbitrary JSON."""
    doc = {**bench.doc, **extra}
    bench.attempt(dumps(doc))


# ------------------------------------------------------------------------------------------------
# (b) structured mutations of the real manifest
# ------------------------------------------------------------------------------------------------
class Deep:
    """A placeholder for a value nested ``n`` levels deep (serialized as text: json.dumps would recurse)."""

    def __init__(self, n: int, kind: str):
        self.n, self.kind = n, kind


def paths_of(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(paths_of(v, prefix + (k,)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.extend(paths_of(v, prefix + (i,)))
    return out


def values_at(doc: Any) -> list:
    out = []
    for p in paths_of(doc):
        v = doc
        for c in p:
            v = v[c]
        out.append(v)
    return out


INTERESTING_INTS = [0, 1, -1, 2, 7, 8, 15, 16, 17, 48, 63, 64, 65, 2**30, 2**30 + 1, 2**31, 2**32, 2**40,
                    2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 10**300, -(10**300), 10**4000]
INTERESTING_STRS = [
    "", " ", "\x00", "../manifest.json", "/etc/passwd", "data/../manifest.json", "data/../../outside.safetensors",
    "data/x.safetensors", "data//rank00000-000.safetensors", "./data/rank00000-000.safetensors",
    "data/rank00000-000.safetensors", "manifest.json", "data", "a" * 300, "F" * 32, "0" * 32, "g" * 32,
    "ffffffffffffffff", "-000000000000001", "0x00000000000001", " 00000000000001", "7ff8000000000000",
    "nan", "1e999", "float32", "float64", "bfloat16", "uint1", "int4", "bits8", "float4_e2m1fn_x2", "complex32",
    "qint8", "object", "torch", "numpy", "box", "flat", "tensor", "ndarray", "dict", "ordered_dict", "list",
    "tuple", "stateful", "pickle", "none", "bool", "int", "float", "complex", "str", "bytes", "numpy_scalar",
    "torch_dtype", "torch_device", "torch_size", "cuda:99", "meta", "xxh3-64", "resurgo.checkpoint",
    "model.w", "model.b", "optimizer.state.0.step", "optimizer.state.0.exp_avg", "arr", "empty", "flags", "counter.t",
    "gASVAAAAAAAAAAAu", "!!!", "é" * 10,
]


def interesting_values(bench_doc: dict) -> st.SearchStrategy:
    own = values_at(bench_doc)
    return st.one_of(
        json_values,
        st.sampled_from(INTERESTING_INTS),
        st.sampled_from(INTERESTING_STRS),
        st.sampled_from(own).map(copy.deepcopy),  # type confusion with real parts of the document
        st.lists(st.sampled_from(INTERESTING_INTS), max_size=4),
        st.builds(Deep, st.integers(50, 5000), st.sampled_from(["list", "dict", "node"])),
        st.just(float("nan")), st.just(float("inf")), st.just(-0.0), st.just(1e308),
    )


def serialize(doc: Any) -> bytes:
    """json.dumps, with each Deep placeholder spliced in as deeply nested text."""
    deep: dict[str, Deep] = {}

    def strip(o: Any) -> Any:
        if isinstance(o, Deep):
            token = f"@@DEEP{len(deep)}@@"
            deep[token] = o
            return token
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items()}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o

    text = json.dumps(strip(doc))
    for token, d in deep.items():
        if d.kind == "list":
            nested = "[" * d.n + "]" * d.n
        elif d.kind == "dict":
            nested = '{"a":' * d.n + "1" + "}" * d.n
        else:  # a chain of tree nodes
            nested = '{"type":"list","items":[' * d.n + '{"type":"none"}' + "]}" * d.n
        text = text.replace(json.dumps(token), nested)
    return text.encode()


def mutate(doc: Any, path: tuple, op: str, value: Any) -> Any:
    doc = copy.deepcopy(doc)
    if not path:
        return value if op == "replace" else doc
    parent = doc
    for c in path[:-1]:
        parent = parent[c]
    last = path[-1]
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "duplicate":
        if isinstance(parent, list):
            parent.insert(last, copy.deepcopy(parent[last]))
        else:
            parent[f"{last}_copy" if isinstance(value, bool) and value else "x"] = copy.deepcopy(parent[last])
    return doc


EDIT_CHARS = "-x G0fA9./\\\x00é"


def string_edits(s: str) -> st.SearchStrategy:
    """Near misses of a real string: one character changed, one dropped or added, case changed."""
    n = max(len(s), 1)
    return st.one_of(
        st.tuples(st.integers(0, n - 1), st.sampled_from(EDIT_CHARS)).map(lambda ic: s[: ic[0]] + ic[1] + s[ic[0] + 1 :]),
        st.integers(0, n - 1).map(lambda i: s[:i] + s[i + 1 :]),
        st.tuples(st.integers(0, n), st.sampled_from(EDIT_CHARS)).map(lambda ic: s[: ic[0]] + ic[1] + s[ic[0] :]),
        st.sampled_from([s.upper(), s + s, "../" + s, "/" + s, s + "/..", s.replace("/", "/../")]),
    )


def list_edits(xs: list) -> st.SearchStrategy:
    n = max(len(xs), 1)
    return st.one_of(
        st.integers(0, n - 1).map(lambda i: xs[:i] + xs[i + 1 :]),
        st.integers(0, n - 1).map(lambda i: xs[: i + 1] + [copy.deepcopy(xs[i])] + xs[i + 1 :] if xs else [0]),
        st.sampled_from(INTERESTING_INTS).map(lambda v: xs + [v]),
        st.sampled_from([xs[::-1], [], xs[:1], xs * 2, [xs]]),
    )


def typed_values(orig: Any, base: dict) -> st.SearchStrategy:
    """A replacement for ``orig``: mostly a near miss of the same JSON type, sometimes anything."""
    if isinstance(orig, bool):
        specific = st.sampled_from([not orig, 0, 1, None, "true"])
    elif isinstance(orig, int):
        specific = st.one_of(st.sampled_from(INTERESTING_INTS), st.integers(-3, 3).map(lambda d: orig + d),
                             st.sampled_from([orig * 2, orig // 2, -orig, orig + 2**64, str(orig)[:100],
                                              float(orig) if abs(orig) < 2**1000 else 1e300]))
    elif isinstance(orig, str):
        specific = st.one_of(st.sampled_from(INTERESTING_STRS), string_edits(orig))
    elif isinstance(orig, list):
        specific = list_edits(orig)
    elif isinstance(orig, dict) and orig:
        specific = st.one_of(st.sampled_from(sorted(orig)).map(lambda k: {a: b for a, b in orig.items() if a != k}),
                             st.just({**orig, "extra": 1}))
    else:
        specific = interesting_values(base)
    return st.one_of(specific, specific, specific, interesting_values(base))


def get_at(doc: Any, path: tuple) -> Any:
    for c in path:
        doc = doc[c]
    return doc


@st.composite
def mutations(draw, base: dict, region: tuple = (), rounds: int = 3) -> dict:
    doc = base
    for _ in range(draw(st.integers(1, rounds))):
        candidates = [p for p in paths_of(doc) if p[: len(region)] == region]
        if not candidates:
            break
        path = draw(st.sampled_from(candidates))
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "duplicate"]))
        value = draw(typed_values(get_at(doc, path), base)) if op == "replace" else None
        doc = mutate(doc, path, op, value)
        if not isinstance(doc, dict):
            break
    return doc


REGIONS = {"files": ("files",), "tensors": ("tensors",), "tree": ("tree",), "anywhere": ()}


def _mutation_test(bench: Bench, data: st.DataObject, region: str) -> None:
    base = data.draw(st.sampled_from(bench.bases))
    doc = data.draw(mutations(base, REGIONS[region]))
    bench.attempt(serialize(doc))


@pytest.mark.parametrize("region", sorted(REGIONS))
@FAST
@given(data=st.data())
def test_mutated_manifest(bench: Bench, region: str, data):
    _mutation_test(bench, data, region)


@pytest.mark.slow
@pytest.mark.parametrize("region", sorted(REGIONS))
@SLOW
@given(data=st.data())
def test_mutated_manifest_slow(bench: Bench, region: str, data):
    _mutation_test(bench, data, region)


@pytest.mark.slow
@SLOW
@given(doc=json_values)
def test_arbitrary_json_slow(bench: Bench, doc: Any):
    assert bench.attempt(dumps(doc)) == ["ManifestError"] * 3


# ------------------------------------------------------------------------------------------------
# (c) generated parts: tensor entries and trees built from the format's grammar, valid or nearly so
# ------------------------------------------------------------------------------------------------
DTYPE_NAMES = sorted(_dtypes.TORCH_DTYPES) + ["float128", "object", "", "F32", "torch.float32"]
DIMS = [0, 0, 1, 1, 2, 3, 4, 12, 2**31, 2**62, 2**63, 10**30, -1]


def _prod(xs: list[int]) -> int:
    return math.prod(xs) if all(isinstance(x, int) for x in xs) else 0


def _chunk_bytes(draw, bench: Bench, nbytes: int) -> dict:
    """byte_range, block_bytes and checksums for ``nbytes`` bytes somewhere in the data file, mostly real."""
    name = bench.data_file
    data = _file_bytes[name]
    header = bench.doc["files"][name]["header_bytes"]
    if 0 <= nbytes <= len(data) - header and draw(st.sampled_from([True, True, True, False])):
        start = draw(st.sampled_from([header, len(data) - nbytes]) | st.integers(header, len(data) - nbytes))
    else:
        start = draw(st.sampled_from([header, header + 4, len(data) - nbytes, len(data), 4, -1, 10**30]))
    block = draw(st.sampled_from([BLOCK] * 10 + [1, 7, 2**30, 0, 2**31]))
    count = -(-nbytes // block) if block > 0 and nbytes >= 0 else 0
    count = min(count, 10_000) + draw(st.sampled_from([0] * 12 + [1, -1]))
    sums: list[str] = []
    if 0 <= start and start + nbytes <= len(data) and block > 0 and nbytes >= 0:
        sums = [xxhash.xxh3_128_hexdigest(data[start + i : min(start + i + block, start + nbytes)])
                for i in range(0, nbytes, block)][: max(count, 0)]
    sums += ["0" * 32] * (count - len(sums))
    return {"file": draw(st.sampled_from([name] * 20 + ["data/nope.safetensors", "../x"])),
            "byte_range": [start, start + nbytes], "block_bytes": block, "checksums": sums}


@st.composite
def tensor_entries(draw, bench: Bench, key: str) -> dict:
    """A tensor entry: a consistent one (whole, flat or split in two) with at most a small flaw, or a noisy one."""
    orig = bench.doc["tensors"][key]
    other = "torch" if orig["kind"] == "numpy" else "numpy"
    kind = draw(st.sampled_from([orig["kind"]] * 20 + [other, "jax"]))
    names = DTYPE_NAMES if kind == "torch" else sorted(_dtypes.NUMPY_DTYPES) + ["bfloat16", "object"]
    dtype = draw(st.sampled_from([orig["dtype"]] * len(names) + names))
    itemsize = _dtypes.itemsize(dtype) if _dtypes.is_known(dtype) else 4
    how = draw(st.sampled_from(["orig"] * 5 + ["random"] * 4 + ["too many dims"]))
    if how == "orig":
        shape = list(orig["shape"])
    elif how == "random":
        shape = draw(st.lists(st.sampled_from(DIMS), max_size=3))
    else:
        shape = [0] * 65
    total = _prod(shape)
    style = draw(st.sampled_from(["whole", "flat", "split", "noisy"]))
    chunks = []
    if style in ("whole", "flat", "split") and total * itemsize <= 1 << 20 and all(d >= 0 for d in shape):
        if style == "whole":
            places = [{"box": {"offsets": [0] * len(shape), "shape": list(shape)}}]
        elif style == "flat":
            cut = draw(st.integers(0, total))
            places = [{"flat": {"start": 0, "stop": cut}}, {"flat": {"start": cut, "stop": total}}]
        elif shape and shape[0] >= 1:
            cut = draw(st.integers(0, shape[0]))
            places = [{"box": {"offsets": [0] * len(shape), "shape": [cut] + shape[1:]}},
                      {"box": {"offsets": [cut] + [0] * (len(shape) - 1), "shape": [shape[0] - cut] + shape[1:]}}]
        else:
            places = [{"box": {"offsets": [], "shape": []}}]
        for place in places:
            numel = _prod(place["box"]["shape"]) if "box" in place else place["flat"]["stop"] - place["flat"]["start"]
            chunks.append({**place, "name": key, **_chunk_bytes(draw, bench, numel * itemsize)})
        if chunks and draw(st.sampled_from([True, False, False])):  # one small flaw somewhere
            c = draw(st.sampled_from(chunks))
            field = draw(st.sampled_from(["box", "flat", "byte_range", "block_bytes"]))
            if field in c and field in ("box", "flat"):
                inner = c[field]
                k = draw(st.sampled_from(sorted(inner)))
                if isinstance(inner[k], list) and inner[k]:
                    i = draw(st.integers(0, len(inner[k]) - 1))
                    inner[k] = inner[k][:i] + [inner[k][i] + draw(st.sampled_from([1, -1, 2**62]))] + inner[k][i + 1 :]
                elif isinstance(inner[k], int):
                    inner[k] += draw(st.sampled_from([1, -1]))
            elif field in c:
                c[field] = draw(typed_values(c[field], bench.doc))
    else:
        for _ in range(draw(st.sampled_from([1, 1, 0, 2, 3]))):
            chunk: dict = {"name": key}
            kind_of_place = draw(st.sampled_from(["box", "box", "flat", "both", "neither"]))
            numel = total
            if kind_of_place in ("box", "both"):
                offsets = [draw(st.sampled_from([0, 0, 0, 1, -1, 2**63, d])) for d in shape]
                cshape = [draw(st.sampled_from([d, d, d, 0, 1, 2**62])) for d in shape]
                if offsets and draw(st.sampled_from([False] * 9 + [True])):
                    offsets = offsets[:-1]
                chunk["box"] = {"offsets": offsets, "shape": cshape}
                numel = _prod(cshape)
            if kind_of_place in ("flat", "both"):
                a = draw(st.sampled_from([0, 0, 1, total, 2**63]))
                b = draw(st.sampled_from([total, total, a, a + 1, total - 1]))
                chunk["flat"] = {"start": a, "stop": b}
                numel = b - a
            nbytes = max(numel * itemsize, 0) + draw(st.sampled_from([0] * 8 + [1, -1]))
            chunk.update(_chunk_bytes(draw, bench, nbytes))
            chunks.append(chunk)
    return {"kind": kind, "dtype": dtype, "shape": shape, "chunks": chunks}


def _f64_bits() -> st.SearchStrategy:
    valid = st.floats(allow_nan=True, allow_infinity=True).map(
        lambda x: "%016x" % int.from_bytes(np.float64(x).tobytes(), "little"))
    return st.one_of(valid, valid.flatmap(string_edits), st.sampled_from(INTERESTING_STRS), st.integers())


SCALAR_NODES = st.one_of(
    st.just({"type": "none"}),
    st.booleans().map(lambda v: {"type": "bool", "value": v}),
    st.one_of(st.integers(), st.sampled_from(INTERESTING_INTS)).map(lambda v: {"type": "int", "value": v}),
    _f64_bits().map(lambda b: {"type": "float", "bits": b}),
    st.tuples(_f64_bits(), _f64_bits()).map(lambda ri: {"type": "complex", "real": ri[0], "imag": ri[1]}),
    st.text(max_size=10).map(lambda v: {"type": "str", "value": v}),
    st.one_of(st.binary(max_size=8).map(lambda b: base64.b64encode(b).decode()),
              st.sampled_from(["!", "YQ", "YQ==="])).map(lambda v: {"type": "bytes", "base64": v}),
    st.tuples(st.sampled_from(sorted(_dtypes.NUMPY_DTYPES) + ["object", "float128", "<f4"]),
              st.binary(max_size=16).map(bytes.hex) | st.sampled_from(["zz", " 00", "0"])).map(
        lambda dh: {"type": "numpy_scalar", "dtype": dh[0], "hex": dh[1]}),
    st.sampled_from(DTYPE_NAMES).map(lambda v: {"type": "torch_dtype", "value": v}),
    st.sampled_from(["cpu", "cuda", "cuda:0", "meta", "mps", "cpu:0", "cuda:-1", "nodevice", "", "cuda:1:2",
                     "cpu:99999999999999999999", "\x00", "é"]).map(lambda v: {"type": "torch_device", "value": v}),
    st.just({"type": "pickle", "class": "builtins.int", "base64": "gARLAS4="}),  # pickle.dumps(1): never loaded
)


def _spoil(node_strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the node as generated; sometimes with a field dropped, added or replaced."""
    def spoil(node: dict, how: int, value: Any) -> dict:
        node = dict(node)
        fields = sorted(node)
        if how == 1:
            node.pop(fields[value % len(fields) if isinstance(value, int) else 0])
        elif how == 2:
            node["extra"] = value
        elif how == 3:
            node[fields[-1]] = value
        return node
    return st.tuples(node_strategy, st.sampled_from([0] * 12 + [1, 2, 3]), json_values).map(lambda t: spoil(*t))


@st.composite
def trees(draw, bench: Bench) -> dict:
    keys = sorted(bench.doc["tensors"])
    kinds = bench.doc["tensors"]
    refs = st.sampled_from(keys).flatmap(lambda k: st.sampled_from([
        {"type": "tensor" if kinds[k]["kind"] == "torch" else "ndarray", "key": k}] * 4 + [
        {"type": "ndarray" if kinds[k]["kind"] == "torch" else "tensor", "key": k}, {"type": "tensor", "key": k + "x"}]))
    leaves = _spoil(st.one_of(SCALAR_NODES, refs))
    keys_nodes = _spoil(SCALAR_NODES)

    def containers(children: st.SearchStrategy) -> st.SearchStrategy:
        return _spoil(st.one_of(
            st.tuples(st.sampled_from(["list", "tuple"]), st.lists(children, max_size=4)).map(
                lambda t: {"type": t[0], "items": t[1]}),
            st.tuples(st.sampled_from(["dict", "ordered_dict"]),
                      st.lists(st.tuples(keys_nodes, children).map(list), max_size=4)).map(
                lambda t: {"type": t[0], "items": t[1]}),
            children.map(lambda c: {"type": "stateful", "class": "m.C", "state": c}),
            st.lists(st.sampled_from(DIMS), max_size=3).map(lambda xs: {"type": "torch_size", "items": xs}),
        ))

    body = draw(st.recursive(leaves, containers, max_leaves=12))
    # The saved top level, with one entry replaced by the generated subtree.
    tree = copy.deepcopy(bench.doc["tree"])
    items = tree["items"]
    items[draw(st.integers(0, len(items) - 1))][1] = body
    return tree


def _generated_entries_test(bench: Bench, data: st.DataObject) -> None:
    doc = copy.deepcopy(bench.doc)
    for key in data.draw(st.lists(st.sampled_from(sorted(doc["tensors"])), min_size=1, max_size=2, unique=True)):
        doc["tensors"][key] = data.draw(tensor_entries(bench, key))
    read, load_dict, _ = bench.attempt(serialize(doc), check_bytes=False)
    if read == "ok":  # a valid manifest fails to load only because the bytes it names do not verify
        assert load_dict in ("ok", "CorruptCheckpointError"), load_dict


@FAST
@given(data=st.data())
def test_generated_tensor_entries(bench: Bench, data):
    _generated_entries_test(bench, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_generated_tensor_entries_slow(bench: Bench, data):
    _generated_entries_test(bench, data)


def _generated_tree_test(bench: Bench, data: st.DataObject) -> None:
    doc = copy.deepcopy(bench.doc)
    doc["tree"] = data.draw(trees(bench))
    doc["pickled"] = data.draw(st.booleans())
    read, load_dict, _ = bench.attempt(serialize(doc), check_bytes=False)
    if read == "ok":  # read_manifest checks the whole tree: what it accepts, load_dict loads
        assert load_dict in ("ok", "PickleNotAllowedError"), load_dict


@FAST
@given(data=st.data())
def test_generated_trees(bench: Bench, data):
    _generated_tree_test(bench, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_generated_trees_slow(bench: Bench, data):
    _generated_tree_test(bench, data)


# ------------------------------------------------------------------------------------------------
# Multi-chunk manifests (resurgo.save writes whole chunks; readers must still assemble and check tiles)
# ------------------------------------------------------------------------------------------------
def _checksums(data: bytes) -> list[str]:
    return [xxhash.xxh3_128_hexdigest(data[i : i + BLOCK]) for i in range(0, len(data), BLOCK)]


def split_doc(doc: dict, how: str, key: str = "model.w", rows: int = 1) -> dict:
    """``doc`` with tensor ``key`` (4x3 float32) described as two chunks: rows [0, rows) and [rows, 4)."""
    doc = copy.deepcopy(doc)
    entry = doc["tensors"][key]
    (chunk,) = entry["chunks"]
    start, stop = chunk["byte_range"]
    data = _file_bytes[chunk["file"]][start:stop]
    row = (stop - start) // entry["shape"][0]
    cut = start + rows * row
    a, b = dict(chunk), dict(chunk)
    a["byte_range"], b["byte_range"] = [start, cut], [cut, stop]
    a["checksums"], b["checksums"] = _checksums(data[: cut - start]), _checksums(data[cut - start :])
    del a["box"], b["box"]
    cols = entry["shape"][1]
    if how == "box":
        a["box"] = {"offsets": [0, 0], "shape": [rows, cols]}
        b["box"] = {"offsets": [rows, 0], "shape": [entry["shape"][0] - rows, cols]}
    else:
        a["flat"] = {"start": 0, "stop": rows * cols}
        b["flat"] = {"start": rows * cols, "stop": entry["shape"][0] * cols}
    entry["chunks"] = [b, a]  # out of order on purpose
    return doc


@pytest.mark.parametrize("how", ["box", "flat"])
def test_split_chunks_assemble_bitwise(bench: Bench, how: str):
    assert bench.attempt(serialize(split_doc(bench.doc, how))) == ["ok", "ok", "ok"]
    loaded = resurgo.load_dict(bench.path)
    assert raw_bytes(loaded["model"]["w"]) == raw_bytes(make_state()["model"]["w"])


# ------------------------------------------------------------------------------------------------
# Named bad cases: the exact error class
# ------------------------------------------------------------------------------------------------
def expect(bench: Bench, doc_or_raw: Any, error: type[ResurgoError], match: str | None = None,
           readers: tuple[str, ...] = ("read_manifest", "load_dict", "load"), reseal: bool = True) -> None:
    raw = doc_or_raw if isinstance(doc_or_raw, bytes) else serialize(doc_or_raw)
    outcomes = dict(zip(("read_manifest", "load_dict", "load"), bench.attempt(raw, reseal=reseal)))
    for r in readers:
        assert outcomes[r] == error.__name__, (r, outcomes)
    if match is not None:
        with pytest.raises(error, match=match):
            resurgo.load_dict(bench.path)


def chunk0(doc: dict, key: str = "model.w") -> dict:
    return doc["tensors"][key]["chunks"][0]


def edited(bench: Bench, fn) -> dict:
    doc = copy.deepcopy(bench.doc)
    fn(doc)
    return doc


def test_not_json(bench: Bench):
    expect(bench, b"{not json", ManifestError, "not valid JSON")
    expect(bench, b"\xff\xfe\x00", ManifestError, "not valid JSON")
    expect(bench, b"[1, 2]", ManifestError, "JSON object")
    expect(bench, bench.raw[:-1], ManifestError)


def test_wrong_format_or_version(bench: Bench):
    expect(bench, edited(bench, lambda d: d.update(version=4)), ManifestError, "version")
    expect(bench, edited(bench, lambda d: d.update(version=0)), ManifestError, "version")
    expect(bench, edited(bench, lambda d: d.update(version=True)), ManifestError)
    expect(bench, edited(bench, lambda d: d.update(version=1.0)), ManifestError)
    expect(bench, edited(bench, lambda d: d.update(format="safetensors")), ManifestError, "format")


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "data/../manifest.json",
                                 "data/../../x.safetensors", "data/sub/x.safetensors", "data/.safetensors/..",
                                 "data/x.safetensors\x00", "data/x.safetensors\n", "data\\x.safetensors",
                                 "./data/x.safetensors", "data/x.safetensors/", "DATA/x.safetensors"])
def test_path_leaving_the_checkpoint(bench: Bench, bad: str):
    def edit(d):
        name = next(iter(d["files"]))
        d["files"][bad] = d["files"].pop(name)
        for t in d["tensors"].values():
            for c in t["chunks"]:
                c["file"] = bad
    expect(bench, edited(bench, edit), ManifestError, "data file path")


def test_chunk_names_an_unlisted_file(bench: Bench):
    expect(bench, edited(bench, lambda d: chunk0(d).update(file="data/other.safetensors")), ManifestError,
           "not listed")


def _outside_copy(bench: Bench, tmp_path: Path) -> tuple[Path, Path]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bench.path, ckpt)
    (ckpt / "manifest.json").write_bytes(bench.raw)
    outside = tmp_path / "outside"
    outside.mkdir()
    return ckpt, outside


def test_the_watch_records_each_file_opened_outside_its_roots_while_it_runs(tmp_path: Path):
    (tmp_path / "root").mkdir()
    for name in ("root/in", "out", "later"):
        (tmp_path / name).write_bytes(b"x")
    with opened_outside(tmp_path / "root") as outside:
        (tmp_path / "root" / "in").read_bytes()
        (tmp_path / "out").read_bytes()
    (tmp_path / "later").read_bytes()
    assert outside == [os.path.realpath(tmp_path / "out")]


def _readers_raise(ckpt: Path, error: type[ResurgoError], match: str) -> None:
    with opened_outside(ckpt) as outside:
        with pytest.raises(error, match=match):
            resurgo.load_dict(ckpt)
        with pytest.raises(error, match=match):
            resurgo.load(make_state(target=True), ckpt)
    assert not outside, outside


def test_symlinked_data_file_pointing_outside(bench: Bench, tmp_path: Path):
    ckpt, outside = _outside_copy(bench, tmp_path)
    data = ckpt / bench.data_file
    shutil.move(data, outside / data.name)  # byte-identical, valid, but not inside the checkpoint
    data.symlink_to(outside / data.name)
    resurgo.read_manifest(ckpt)  # the manifest itself is fine
    _readers_raise(ckpt, CorruptCheckpointError, "leaves the checkpoint")


def test_symlinked_data_directory_pointing_outside(bench: Bench, tmp_path: Path):
    ckpt, outside = _outside_copy(bench, tmp_path)
    shutil.move(ckpt / "data", outside / "data")
    (ckpt / "data").symlink_to(outside / "data", target_is_directory=True)
    _readers_raise(ckpt, CorruptCheckpointError, "leaves the checkpoint")


def test_symlink_inside_the_checkpoint_is_followed(bench: Bench, tmp_path: Path):
    ckpt, _ = _outside_copy(bench, tmp_path)
    data = ckpt / bench.data_file
    data.rename(ckpt / "data" / "real.bin")
    data.symlink_to("real.bin")
    resurgo.load(make_state(target=True), ckpt)


def test_data_file_that_is_not_a_regular_file(bench: Bench, tmp_path: Path):
    """A FIFO would block open() forever, a directory would fail pread(): both are refused first."""
    ckpt, _ = _outside_copy(bench, tmp_path)
    data = ckpt / bench.data_file
    data.unlink()
    os.mkfifo(data)
    _readers_raise(ckpt, CorruptCheckpointError, "not a regular file")
    data.unlink()
    data.mkdir()
    _readers_raise(ckpt, CorruptCheckpointError, "not a regular file")


def test_missing_data_file(bench: Bench, tmp_path: Path):
    ckpt, _ = _outside_copy(bench, tmp_path)
    (ckpt / bench.data_file).unlink()
    _readers_raise(ckpt, CorruptCheckpointError, "missing")


def test_byte_range_past_the_file(bench: Bench):
    def edit(d):
        c = chunk0(d)
        size = d["files"][c["file"]]["bytes"]
        n = c["byte_range"][1] - c["byte_range"][0]
        c["byte_range"] = [size - n + 4, size + 4]
    expect(bench, edited(bench, edit), ManifestError, "outside the data area")


def test_byte_range_inside_the_header(bench: Bench):
    def edit(d):
        c = chunk0(d)
        n = c["byte_range"][1] - c["byte_range"][0]
        c["byte_range"] = [4, 4 + n]
    expect(bench, edited(bench, edit), ManifestError, "outside the data area")


def test_byte_range_reversed_or_negative(bench: Bench):
    expect(bench, edited(bench, lambda d: chunk0(d).update(byte_range=[500, 452])), ManifestError)
    expect(bench, edited(bench, lambda d: chunk0(d).update(byte_range=[-48, 0])), ManifestError)
    expect(bench, edited(bench, lambda d: chunk0(d).update(byte_range=[1, 2, 3])), ManifestError)


def test_declared_file_size_differs_from_the_real_one(bench: Bench):
    """The manifest's sizes are checked against the disk before anything is allocated."""
    def edit(d):
        d["files"][bench.data_file]["bytes"] += 4
    expect(bench, edited(bench, edit), CorruptCheckpointError, "truncated", readers=("load_dict", "load"))


def test_shape_and_byte_count_disagree(bench: Bench):
    expect(bench, edited(bench, lambda d: d["tensors"]["model.w"].update(dtype="float64")), ManifestError,
           "need 96 bytes")
    def edit(d):
        d["tensors"]["model.w"]["shape"] = [4, 4]
        chunk0(d)["box"]["shape"] = [4, 4]
    expect(bench, edited(bench, edit), ManifestError, "need 64 bytes")


def test_box_outside_the_shape(bench: Bench):
    expect(bench, edited(bench, lambda d: chunk0(d)["box"].update(offsets=[1, 0])), ManifestError,
           "outside the tensor")
    expect(bench, edited(bench, lambda d: chunk0(d)["box"].update(offsets=[-1, 0])), ManifestError)
    expect(bench, edited(bench, lambda d: chunk0(d)["box"].update(offsets=[0])), ManifestError, "rank")


@pytest.mark.parametrize("how", ["box", "flat"])
def test_overlapping_chunks(bench: Bench, how: str):
    doc = split_doc(bench.doc, how)
    b, a = doc["tensors"]["model.w"]["chunks"]
    if how == "box":  # rows [0,1) and [1,4) become [0,1) and [0,3): an overlap and a one-row gap
        b["box"]["offsets"] = [0, 0]
    else:
        b["flat"] = {"start": 2, "stop": 11}
    expect(bench, doc, ManifestError, "exactly once")


@pytest.mark.parametrize("how", ["box", "flat"])
def test_chunks_leaving_a_gap(bench: Bench, how: str):
    doc = split_doc(bench.doc, how)
    doc["tensors"]["model.w"]["chunks"].pop(0)
    expect(bench, doc, ManifestError, "exactly once")


def test_box_and_flat_mixed_or_both(bench: Bench):
    doc = split_doc(bench.doc, "box")
    b, a = doc["tensors"]["model.w"]["chunks"]
    del b["box"]
    b["flat"] = {"start": 3, "stop": 12}
    expect(bench, doc, ManifestError, "mixes box and flat")
    expect(bench, edited(bench, lambda d: chunk0(d).update(flat={"start": 0, "stop": 12})), ManifestError,
           "exactly one of")
    expect(bench, edited(bench, lambda d: chunk0(d).pop("box")), ManifestError, "exactly one of")


def test_wrong_checksum_count(bench: Bench):
    expect(bench, edited(bench, lambda d: chunk0(d)["checksums"].pop()), ManifestError, "2 checksums for 3 blocks")
    expect(bench, edited(bench, lambda d: chunk0(d)["checksums"].append("0" * 32)), ManifestError,
           "4 checksums for 3 blocks")
    expect(bench, edited(bench, lambda d: chunk0(d).update(block_bytes=32)), ManifestError, "for 2 blocks")
    expect(bench, edited(bench, lambda d: chunk0(d).update(block_bytes=0)), ManifestError, "block_bytes")


def test_bad_checksum_hex(bench: Bench):
    expect(bench, edited(bench, lambda d: chunk0(d)["checksums"].__setitem__(0, "A" * 32)), ManifestError,
           "32 hex")
    expect(bench, edited(bench, lambda d: d["files"][bench.data_file].update(header_checksum="xyz")),
           ManifestError, "32 hex")


def test_wrong_checksum_value(bench: Bench):
    expect(bench, edited(bench, lambda d: chunk0(d)["checksums"].__setitem__(1, "0" * 32)), CorruptCheckpointError,
           "block 1", readers=("load_dict", "load"))
    expect(bench, edited(bench, lambda d: d["files"][bench.data_file].update(header_checksum="0" * 32)),
           CorruptCheckpointError, "header", readers=("load_dict", "load"))


def test_unknown_dtype_and_kind(bench: Bench):
    for dtype in ("float128", "qint8", "object", "", "torch.float32"):
        expect(bench, edited(bench, lambda d: d["tensors"]["model.w"].update(dtype=dtype)), ManifestError, "dtype")
    expect(bench, edited(bench, lambda d: d["tensors"]["arr"].update(dtype="bfloat16")), ManifestError, "dtype")
    expect(bench, edited(bench, lambda d: d["tensors"]["model.w"].update(kind="jax")), ManifestError)


def test_unknown_fields_are_refused(bench: Bench):
    expect(bench, edited(bench, lambda d: d.update(extra=1)), ManifestError, "schema")
    expect(bench, edited(bench, lambda d: chunk0(d).update(compression="zstd")), ManifestError, "schema")


def _tree_items(doc: dict) -> list:
    return doc["tree"]["items"]


def _tree_value(doc: dict, name: str) -> list:
    for pair in _tree_items(doc):
        if pair[0] in (name, {"type": "str", "value": name}):
            return pair
    raise KeyError(name)


def test_tree_references_an_unknown_tensor(bench: Bench):
    def edit(d):
        _tree_value(d, "arr")[1] = {"type": "ndarray", "key": "nope"}
    expect(bench, edited(bench, edit), ManifestError, "unknown tensor")


def test_tree_references_a_tensor_twice(bench: Bench):
    def edit(d):
        _tree_value(d, "tup")[1] = {"type": "ndarray", "key": "arr"}
    expect(bench, edited(bench, edit), ManifestError, "twice")


def test_tree_node_kind_disagrees_with_tensor_kind(bench: Bench):
    expect(bench, edited(bench, lambda d: _tree_value(d, "arr").__setitem__(1, {"type": "tensor", "key": "arr"})),
           ManifestError, "disagrees")


@pytest.mark.parametrize("node", [{"type": "set", "items": []}, {"type": "eval", "value": "1"}, {"kind": "int"},
                                  {"type": 3}, [], "x", None, {"type": "list"}, {"type": "list", "items": 3},
                                  {"type": "dict", "items": [[1, 2]]}, {"type": "dict", "items": [["a"]]},
                                  {"type": "stateful"}, {"type": "stateful", "state": 1},
                                  {"type": "torch_size", "items": ["a"]}, {"type": "int", "value": True},
                                  {"type": "int", "value": 1.5}, {"type": "bool", "value": 1},
                                  {"type": "float", "bits": "-000000000000001"},
                                  {"type": "float", "bits": "0x00000000000001"},
                                  {"type": "float", "bits": 1.5}, {"type": "float", "bits": "zz"},
                                  {"type": "complex", "real": "0" * 16},
                                  {"type": "bytes", "base64": "!!"}, {"type": "bytes", "base64": 5},
                                  {"type": "numpy_scalar", "dtype": "float32", "hex": "00"},
                                  {"type": "numpy_scalar", "dtype": "object", "hex": "00"},
                                  {"type": "numpy_scalar", "dtype": "float32", "hex": "zz"},
                                  {"type": "torch_dtype", "value": "float128"},
                                  {"type": "torch_device", "value": "nodevice:0"},
                                  {"type": "torch_device", "value": 7},
                                  {"type": "str"}, {"type": "tensor"}, {"type": "tensor", "key": 5}])
def test_bad_tree_nodes(bench: Bench, node: Any):
    def edit(d):
        _tree_value(d, "scalars")[1]["items"][0][1] = node
    expect(bench, edited(bench, edit), ManifestError)


@pytest.mark.parametrize("node", [{"type": "set", "items": []}, {"type": "stateful"}, {"type": "dict"}])
def test_bad_nodes_under_a_stateful_target(bench: Bench, node: Any):
    def edit(d):
        _tree_value(d, "counter")[1] = node
    expect(bench, edited(bench, edit), ManifestError)


def test_bad_dict_keys(bench: Bench):
    def edit_key(key):
        def edit(d):
            _tree_value(d, "scalars")[1]["items"][0][0] = key
        return edit
    for key in ({"type": "list", "items": []}, {"type": "tensor", "key": "arr"}, {"type": "nope"}, 5, None, ["i"],
                {"type": "str", "value": "i", "extra": 1}, {"type": "float", "bits": "nan"},
                {"type": "pickle", "class": "x", "base64": "gARLAS4="}):  # keys are plain scalars, never pickles
        expect(bench, edited(bench, edit_key(key)), ManifestError, "key")


def test_pickle_node_is_never_loaded(bench: Bench):
    # pickle.dumps(1): harmless, but loading it must still need allow_pickle=True
    node = {"type": "pickle", "class": "builtins.int", "base64": "gARLAS4="}
    def edit(d):
        _tree_value(d, "scalars")[1]["items"][0][1] = node
    doc = edited(bench, edit)
    expect(bench, doc, ManifestError, "'pickled' flag is false")  # an inconsistent manifest
    doc["pickled"] = True
    expect(bench, doc, PickleNotAllowedError, "allow_pickle", readers=("load_dict", "load"))
    resurgo.read_manifest(bench.path)  # reading the manifest never unpickles
    assert resurgo.load_dict(bench.path, allow_pickle=True)["scalars"]["i"] == 1
    target = make_state(target=True)
    with pytest.raises(PickleNotAllowedError):
        resurgo.load(target, bench.path)
    assert raw_bytes(target["model"]["w"]) == b"\xa5" * 48  # nothing was filled before the refusal


def test_pickled_flag_alone_refuses(bench: Bench):
    expect(bench, edited(bench, lambda d: d.update(pickled=True)), PickleNotAllowedError,
           readers=("load_dict", "load"))


def test_huge_ints_and_floats(bench: Bench):
    big = 10**2000  # within the 8192 bits writers allow an int node; Python's json reads up to 4300 digits
    expect(bench, bench.raw.replace(b'"step":5', b'"step":' + b"9" * 5000), ManifestError, "not valid JSON")
    # A huge int value is legal in the tree (Python ints are unbounded) ...
    def edit_int(d):
        _tree_value(d, "scalars")[1]["items"][0][1] = {"type": "int", "value": big}
    assert bench.attempt(serialize(edited(bench, edit_int)))[:2] == ["ok", "ok"]
    assert resurgo.load_dict(bench.path)["scalars"]["i"] == big
    # ... but not as a size, an offset or a count.
    for edit in (lambda d: chunk0(d).update(byte_range=[big, big + 48]),
                 lambda d: chunk0(d).update(block_bytes=big),
                 lambda d: d["tensors"]["model.w"].update(shape=[big, 3])):
        expect(bench, edited(bench, edit), ManifestError)
    expect(bench, edited(bench, lambda d: d["files"][bench.data_file].update(bytes=big)), CorruptCheckpointError,
           "truncated or altered", readers=("load_dict", "load"))
    expect(bench, bench.raw.replace(b'"step":5', b'"step":1e999'), ManifestError)
    expect(bench, bench.raw.replace(b'"step":5', b'"step":NaN'), ManifestError)


@pytest.mark.parametrize("shape", [[0, 10**30], [0, 2**62, 2**62], [0, 2**63], [0] + [2**40] * 5])
def test_zero_size_tensor_with_huge_dimensions(bench: Bench, shape: list[int]):
    """Zero elements need zero bytes, so only a bound on the dimensions stops np/torch.empty failing."""
    def edit(d):
        e = d["tensors"]["empty"]
        e["shape"] = shape
        e["chunks"][0]["box"] = {"offsets": [0] * len(shape), "shape": shape}
    expect(bench, edited(bench, edit), ManifestError, "shape", readers=("read_manifest", "load_dict"))


def test_too_many_dimensions(bench: Bench):
    def edit(d):
        e = d["tensors"]["empty"]
        e["shape"] = [0] * 65
        e["chunks"][0]["box"] = {"offsets": [0] * 65, "shape": [0] * 65}
    expect(bench, edited(bench, edit), ManifestError, "shape")


@pytest.mark.parametrize("n", [80, 300, 900, 3000, 100_000])
@pytest.mark.parametrize("kind", ["list", "dict", "node"])
def test_very_deep_nesting(bench: Bench, n: int, kind: str):
    def edit(d):
        _tree_value(d, "tup")[1] = Deep(n, kind)
    expect(bench, edited(bench, edit), ManifestError)
    if n > 200:  # deeper than any JSON parser here allows: refused, never a RecursionError
        expect(bench, edited(bench, lambda d: d.update(metadata={"deep": Deep(n, kind)})), ManifestError)


def test_deep_but_legal_tree_loads(tmp_path: Path):
    """What save accepts, load reads: a state nested to the depth limit round-trips."""
    from resurgo.format.tree import MAX_TREE_DEPTH

    state: Any = {"t": torch.arange(3), "sz": torch.Size([1, 2])}
    for _ in range(MAX_TREE_DEPTH - 1):
        state = {"a": state}
    resurgo.save(state, tmp_path / "ok")
    out = resurgo.load_dict(tmp_path / "ok")
    for _ in range(MAX_TREE_DEPTH - 1):
        out = out["a"]
    assert torch.equal(out["t"], torch.arange(3))
    deeper = {"a": state}
    with pytest.raises(resurgo.UnsupportedValueError, match="deeper"):
        resurgo.save(deeper, tmp_path / "too-deep")
    assert not (tmp_path / "too-deep").exists()


def test_duplicate_keys_in_the_json(bench: Bench):
    """JSON objects with a repeated name are refused, whichever one a parser would keep."""
    for raw in (bench.raw.replace(b'{"format"', b'{"version":2,"format"', 1),
                bench.raw.replace(b'{"format"', b'{"format":"x","format"', 1),
                bench.raw.replace(b'"version":2', b'"version":2,"version":4', 1)):
        expect(bench, raw, ManifestError, match="appears twice in one JSON object")


def test_key_mismatch_is_a_resurgo_error(bench: Bench):
    def edit(d):
        _tree_items(d).pop()
    assert bench.attempt(serialize(edited(bench, edit)))[2] == KeyMismatchError.__name__


# ------------------------------------------------------------------------------------------------
# Huge claimed sizes never turn into huge allocations (checked under an address-space limit)
# ------------------------------------------------------------------------------------------------
_RLIMIT_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch, numpy, resurgo  # import first: the limit is set relative to what the imports map
    ckpt = sys.argv[1]
    def vm_bytes():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    limit = vm_bytes() + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from resurgo.format.manifest import seal
    base = json.load(open(ckpt + "/manifest.json"))
    del base["manifest_checksum"]
    name = next(iter(base["files"]))
    header = base["files"][name]["header_bytes"]
    results = []
    for claimed in (1 << 34, 1 << 40):  # 16 GiB and 1 TiB, against a limit of about 1 GiB more than now
        for how in ("whole", "split"):
            doc = json.loads(json.dumps(base))
            doc["files"][name]["bytes"] = header + claimed
            n = claimed // 4
            block = 1 << 30
            if how == "whole":
                chunks = [{"box": {"offsets": [0], "shape": [n]}, "file": name, "name": "w",
                           "byte_range": [header, header + claimed], "block_bytes": block,
                           "checksums": ["0" * 32] * (claimed // block)}]
            else:
                half = claimed // 2
                chunks = [{"flat": {"start": i * (n // 2), "stop": (i + 1) * (n // 2)}, "file": name, "name": "w",
                           "byte_range": [header + i * half, header + (i + 1) * half], "block_bytes": block,
                           "checksums": ["0" * 32] * (half // block)} for i in range(2)]
            doc["tensors"]["model.w"] = {"kind": "torch", "dtype": "float32", "shape": [n], "chunks": chunks}
            open(ckpt + "/manifest.json", "wb").write(seal(json.dumps(doc).encode()))
            try:
                resurgo.load_dict(ckpt)
                results.append("ok")
            except resurgo.ResurgoError as e:
                results.append(type(e).__name__)
    print(json.dumps(results))
    """
)


def test_huge_claimed_sizes_allocate_nothing(bench: Bench, tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(bench.path, ckpt)
    (ckpt / "manifest.json").write_bytes(bench.raw)
    proc = subprocess.run([sys.executable, "-c", _RLIMIT_SCRIPT, str(ckpt)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["CorruptCheckpointError"] * 4


def test_many_chunks_do_not_hang(bench: Bench):
    """Tiling is checked without comparing every pair of chunks: 20000 one-element chunks validate fast."""
    doc = copy.deepcopy(bench.doc)
    c = chunk0(doc)
    start = c["byte_range"][0]
    n = 20_000
    doc["files"][bench.data_file]["bytes"] = _file_bytes_len(bench)
    entry = {"kind": "torch", "dtype": "uint8", "shape": [n], "chunks": []}
    for i in range(n):  # every chunk reads the same first byte: legal in v1 (ranges may be shared)
        entry["chunks"].append({"box": {"offsets": [i], "shape": [1]}, "file": c["file"], "name": "w",
                                "byte_range": [start, start + 1], "block_bytes": BLOCK,
                                "checksums": ["0" * 32]})
    doc["tensors"]["many"] = entry
    raw = serialize(doc)
    import time

    t0 = time.perf_counter()
    bench.write(resealed(raw))
    resurgo.read_manifest(bench.path)
    assert time.perf_counter() - t0 < 30


def _file_bytes_len(bench: Bench) -> int:
    return len(_file_bytes[bench.data_file])


def test_error_messages_name_the_manifest(bench: Bench):
    bench.write(b"{")
    with pytest.raises(ManifestError) as ei:
        resurgo.read_manifest(bench.path)
    assert "manifest.json" in str(ei.value)
    assert math.isfinite(len(str(ei.value)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="0123456789abcdefABCDEFgz_ é\n", min_size=30, max_size=33)
                | st.text(alphabet="0123456789abcdef", min_size=32, max_size=32), max_size=6))
def test_checksum_list_check_is_exactly_32_lowercase_hex_digits_each(digests):
    from resurgo.format.manifest import _all_hex128
    assert _all_hex128(digests) == all(re.fullmatch(r"[0-9a-f]{32}", d) is not None for d in digests)


@pytest.mark.parametrize("where", ["root", "model"])
def test_a_size_in_place_of_a_container_loads_into_no_target(bench: Bench, where: str):
    # A torch_size node where the target holds a dict: the load must refuse, not report success
    # with the target's tensors never filled (found by test_mutated_manifest_slow[tree]).
    size = {"type": "torch_size", "items": [2, 3]}
    def edit(d):
        if where == "root":
            d["tree"] = size
        else:
            _tree_value(d, "model")[1] = size
    bench.write(resealed(serialize(edited(bench, edit))))
    target = make_state(target=True)
    with pytest.raises(TypeMismatchError, match="holds a torch_size value, the target a dict"):
        resurgo.load(target, bench.path)
    assert raw_bytes(target["model"]["w"]) == b"\xa5" * 48
    bench.write(bench.raw)
