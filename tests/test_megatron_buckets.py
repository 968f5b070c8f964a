"""The distributed optimizer's bucket-space state (Megatron-Core ``dp_reshardable``) found under each
parameter by its values (resurgo.interop.megatron_buckets).

The buckets here are laid out as Megatron's parameter and gradient buffers lay them out (each
parameter at a multiple of 64 elements, padding of arbitrary bytes between, a parameter of several
chunks written chunk after chunk, each parameter and padding a stored run, runs also split where a
DP rank's shard ends), in a raw file with a spec over it; tests/megatron_optimizer_workers.py has a
real Megatron optimizer write them (the ``megatron`` tests).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resurgo.errors import CorruptCheckpointError, UnsupportedValueError
from resurgo.interop.megatron_buckets import per_parameter, states_by_value
from resurgo.interop.spec import Box, Piece, TensorSpec

DOMAIN = "optimizer.distributed.dp_group_idx_{}"
BUCKET = "gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_{}"
STATES = ("param", "exp_avg", "exp_avg_sq")


class Source:
    """A raw file of tensors' bytes and the spec pieces over it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = bytearray()

    def put(self, t: torch.Tensor) -> int:
        at = len(self.data)
        self.data += t.contiguous().view(torch.uint8).numpy().tobytes()
        return at

    def save(self) -> None:
        (self.root / "data.bin").write_bytes(bytes(self.data))


def model_tensor(src: Source, key: str, whole: torch.Tensor, boxes: list[tuple[list[int], list[int]]]) -> TensorSpec:
    pieces = []
    for offsets, shape in boxes:
        part = whole[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
        pieces.append(Piece(file="data.bin", offset=src.put(part), shape=shape, box=Box(offsets=offsets, shape=shape)))
    return TensorSpec(key=key, dtype=str(whole.dtype).removeprefix("torch."), shape=list(whole.shape), pieces=pieces)


def bucket_states(params: list[list[dict[str, torch.Tensor]]], rng: random.Random, splits: int = 2
                  ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One bucket as Megatron lays it out, per state: the parameters (each a list of chunks'
    states) at multiples of 64, random padding between; and where its stored runs start: at each
    parameter and padding, and at ``splits`` random DP-shard ends."""
    flat: dict[str, list[torch.Tensor]] = {s: [] for s in STATES}
    bounds, at = {0}, 0
    for param in params:
        start = -(-at // 64) * 64
        if start > at:
            bounds.add(at)
            for s in STATES:  # padding: whatever memory held
                flat[s].append(torch.from_numpy(np.frombuffer(rng.randbytes(4 * (start - at)), dtype=np.float32).copy()))
        bounds.add(start)
        for chunk in param:
            for s in STATES:
                flat[s].append(chunk[s].reshape(-1).float())
        at = start + sum(c["param"].numel() for c in param)
    bounds |= {rng.randrange(1, at) for _ in range(splits)} if at > 1 else set()
    return {s: torch.cat(flat[s]) for s in STATES}, sorted(bounds)


def stored(src: Source, key: str, whole: torch.Tensor, starts: list[int]) -> TensorSpec:
    cuts = starts + [whole.numel()]
    pieces = [Piece(file="data.bin", offset=src.put(whole[a:b]), shape=[b - a], box=Box(offsets=[a], shape=[b - a]))
              for a, b in zip(cuts, cuts[1:]) if b > a]
    return TensorSpec(key=key, dtype="float32", shape=[whole.numel()], pieces=pieces)


def bucket_tensors(src: Source, domain: int, bucket: int, params: list[list[dict[str, torch.Tensor]]],
                   rng: random.Random, splits: int = 2) -> list[TensorSpec]:
    """One bucket as ``dp_reshardable`` saves it: a tensor per state."""
    states, starts = bucket_states(params, rng, splits)
    return [stored(src, f"{DOMAIN.format(domain)}.{BUCKET.format(bucket)}.{s}", t, starts) for s, t in states.items()]


def assemble(root: Path, t: TensorSpec) -> torch.Tensor:
    out = torch.full(t.shape, float("nan"), dtype=torch.float32)
    data = (root / "data.bin").read_bytes()
    for p in t.pieces:
        raw = data[p.offset:p.offset + 4 * p.numel]
        out[tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.shape))] = torch.frombuffer(
            bytearray(raw), dtype=torch.float32).reshape(p.shape)
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 4), tp=st.integers(1, 3), width=st.integers(1, 70),
       domains=st.integers(1, 3), splits=st.integers(0, 4), coalesced=st.booleans())
def test_each_chunk_gets_the_state_at_its_place_in_the_buckets(tmp_path_factory, seed, layers, tp, width, domains,
                                                               splits, coalesced):
    """A model of stacked layers (a tensor-parallel weight, a gated weight of gate and up chunks, a
    norm replicated in every domain with each domain's own moments), its parameters spread over
    domains and buckets in a random order: every chunk's main parameter, exp_avg and exp_avg_sq
    come back bit for bit in its place, a replicated one's from the first domain. ``coalesced``: a
    domain's buckets one after another, each cut at its end (the legacy layout's distrib_optim.pt)."""
    root = tmp_path_factory.mktemp("buckets")
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    src = Source(root)
    keys = {"w": torch.randn(layers, 4 * tp, width, generator=g), "fc1": torch.randn(layers, 2 * 2 * tp, width, generator=g),
            "norm": torch.randn(layers, width, generator=g)}
    model, locals_ = [], []
    for key, whole in keys.items():
        boxes = []
        for layer in range(layers):
            if key == "norm":  # replicated: in every domain (below)
                boxes.append(([layer, 0], [1, width]))
            elif key == "w":
                for r in range(tp):
                    boxes.append(([layer, 4 * r, 0], [1, 4, width]))
                    locals_.append([(key, [layer, 4 * r, 0], [1, 4, width])])
            else:  # gate of rank r at rows 2r, up at 2 tp + 2r: one local parameter of two chunks
                for r in range(tp):
                    gate, up = ([layer, 2 * r, 0], [1, 2, width]), ([layer, 2 * tp + 2 * r, 0], [1, 2, width])
                    boxes += [gate, up]
                    locals_.append([(key, *gate), (key, *up)])
        model.append(model_tensor(src, key, whole, boxes))
    rng.shuffle(locals_)
    want: dict[str, dict[str, torch.Tensor]] = {s: {k: torch.full(v.shape, float("nan")) for k, v in keys.items()}
                                                 for s in STATES}
    buckets = []
    domain_buckets: dict[int, dict[tuple[str, str], dict[str, TensorSpec]]] = {}
    norms = [[("norm", [layer, 0], [1, width])] for layer in range(layers)]
    per_domain = [rng.sample(locals_[d::domains] + norms, len(locals_[d::domains]) + layers) for d in range(domains)]
    for d, params in enumerate(per_domain):
        cut = rng.randrange(len(params) + 1) if params else 0
        for b, group in enumerate(x for x in (params[:cut], params[cut:]) if x):
            states = []
            for param in group:
                chunks = []
                for key, offsets, shape in param:
                    where = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
                    st_ = {"param": keys[key][where].clone(), "exp_avg": torch.randn(shape, generator=g),
                           "exp_avg_sq": torch.rand(shape, generator=g)}
                    if key != "norm" or d == 0:  # a replicated chunk takes the first domain's state
                        for s in STATES:
                            want[s][key][where] = st_[s]
                    chunks.append(st_)
                states.append(chunks)
            buckets.append(bucket_states(states, rng, splits))
        if coalesced:  # each bucket's runs kept; the buffer's whole as one tensor per state
            whole = {s: torch.cat([b[0][s] for b in buckets]) for s in STATES}
            starts, at = [], 0
            for b in buckets:
                starts += [at + x for x in b[1]]
                at += b[0]["param"].numel()
            domain_buckets[d] = {s: stored(src, f"rank{d}.{s}", whole[s], starts) for s in STATES}
        else:
            for b, (states_, starts) in enumerate(buckets):
                domain_buckets[d * 10 + b] = {s: stored(src, f"{DOMAIN.format(d)}.{BUCKET.format(b)}.{s}", t, starts)
                                              for s, t in states_.items()}
        buckets = []
    src.save()
    if coalesced:
        found = states_by_value(model, {(f"rank{d}", "buffer 0"): v for d, v in domain_buckets.items()}, root, "src",
                                coalesced=True)
    else:
        found = per_parameter(model + [t for v in domain_buckets.values() for t in v.values()], root, "src")
    out = {t.key: t for t in model + found}
    assert not any("distributed" in k for k in out)
    for key in keys:
        assert bits(assemble(root, out[key])) == bits(keys[key])
        assert bits(assemble(root, out[f"optimizer.fp32_from_fp16_params.{key}"])) == bits(want["param"][key])
        for s in ("exp_avg", "exp_avg_sq"):
            assert out[f"optimizer.state.{key}.{s}"].path == ["optimizer", "state", key, s]
            assert bits(assemble(root, out[f"optimizer.state.{key}.{s}"])) == bits(want[s][key]), (key, s)


def _two_norms(tmp_path: Path, norm_a: torch.Tensor, norm_b: torch.Tensor, avg_a: torch.Tensor, avg_b: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> tuple[list[TensorSpec], Path]:
    src = Source(tmp_path)
    model = [model_tensor(src, "a", norm_a.to(dtype), [([0], [8])]), model_tensor(src, "b", norm_b.to(dtype), [([0], [8])])]
    params = [[{"param": norm_a, "exp_avg": avg_a, "exp_avg_sq": avg_a * avg_a}],
              [{"param": norm_b, "exp_avg": avg_b, "exp_avg_sq": avg_b * avg_b}]]
    specs = model + bucket_tensors(src, 0, 0, params, random.Random(0), splits=0)
    src.save()
    return specs, tmp_path


def test_chunks_of_equal_values_are_accepted_only_where_their_states_agree(tmp_path):
    ones, avg = torch.ones(8), torch.randn(8)
    specs, root = _two_norms(tmp_path, ones, ones, avg, avg.clone())
    out = {t.key: t for t in per_parameter(specs, root, "src")}
    assert bits(assemble(root, out["optimizer.state.a.exp_avg"])) == bits(assemble(root, out["optimizer.state.b.exp_avg"])) \
        == bits(avg)
    (tmp_path / "differ").mkdir()
    specs, root = _two_norms(tmp_path / "differ", ones, ones, avg, avg + 1)
    with pytest.raises(UnsupportedValueError, match=r"src: 2 chunks hold equal values \('a' \[0\], 'b' \[0\]\) but their "
                                                    r"optimizer state \('exp_avg'\) differs"):
        per_parameter(specs, root, "src")


def test_bfloat16_weights_are_found_by_their_fp32_main_params(tmp_path):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    # main params that round to the bf16 weights (the optimizer's copy after a step)
    main_a, main_b = a.bfloat16().float() + 1e-4, b.bfloat16().float() - 1e-4
    specs, root = _two_norms(tmp_path, main_a, main_b, torch.randn(8, generator=g), torch.randn(8, generator=g),
                             dtype=torch.bfloat16)
    out = {t.key: t for t in per_parameter(specs, root, "src")}
    assert bits(assemble(root, out["optimizer.fp32_from_fp16_params.a"])) == bits(main_a)
    assert bits(assemble(root, out["optimizer.fp32_from_fp16_params.b"])) == bits(main_b)
    assert out["optimizer.fp32_from_fp16_params.a"].dtype == "float32" and out["a"].dtype == "bfloat16"


def test_a_main_param_that_is_not_the_weight_is_named(tmp_path):
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    src = Source(tmp_path)
    model = [model_tensor(src, "a", a, [([0], [8])]), model_tensor(src, "b", b, [([0], [8])])]
    bent = b.clone()
    bent[5] += 1
    params = [[{s: a for s in STATES}], [{s: bent for s in STATES}]]
    specs = model + bucket_tensors(src, 2, 0, params, random.Random(0), splits=0)
    src.save()
    with pytest.raises(CorruptCheckpointError, match=r"src: no model tensor's chunk holds the values at element 64 of "
                                                     r"optimizer.distributed.dp_group_idx_2 gbuf_idx_0.*bucket_idx_0 'param'"):
        per_parameter(specs, tmp_path, "src")


def test_a_tensor_found_only_in_part_and_a_bucket_without_main_params_are_refused(tmp_path):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(2, 8, generator=g)
    src = Source(tmp_path)
    model = [model_tensor(src, "w", w, [([0, 0], [1, 8]), ([1, 0], [1, 8])])]
    buckets = bucket_tensors(src, 0, 0, [[{s: w[:1] for s in STATES}]], random.Random(0), splits=0)
    src.save()
    with pytest.raises(CorruptCheckpointError, match=r"src: the distributed optimizer's buckets hold 'w' only in part: "
                                                     r"its chunk at \[1, 0\] \[1, 8\] is in none"):
        per_parameter(model + buckets, tmp_path, "src")
    with pytest.raises(CorruptCheckpointError, match=r"bucket_idx_0 has no 'param' state"):
        per_parameter(model + [t for t in buckets if not t.key.endswith(".param")], tmp_path, "src")
