"""resurgo.import_checkpoint(source="megatron") and `resurgo import --from megatron`: Megatron-LM's
legacy layout (``iter_<N>/mp_rank_XX[_YYY]/model_optim_rng.pt``).

The checkpoints are written by tests/megatron_files.py with torch.save in Megatron's structure,
split from a consolidated model over tensor- and pipeline-parallel ranks; the import must give
back the consolidated model, its Adam state numbered as a one-rank run's, and the metadata, bit
for bit. The tests marked ``megatron`` compare with Megatron-Core's own views: of a model it builds,
and of a run it trains on 8 gloo ranks (tests/megatron_optimizer_workers.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import resurgo
from megatron_files import consolidated_optimizer, gpt_model, no_decay, trim, write_legacy
from resurgo.cli import app
from resurgo.errors import CorruptCheckpointError, NotACheckpointError, PickleNotAllowedError, UnsupportedValueError
from resurgo.interop.megatron import spec_from_megatron

runner = CliRunner()


def bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def moments_of(model: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return {n: {"exp_avg": torch.randn(t.shape, generator=g), "exp_avg_sq": torch.rand(t.shape, generator=g)}
            for n, t in model.items()}


@pytest.mark.parametrize("tp, pp, gated", [(2, 2, True), (2, 1, False), (1, 2, True)])
def test_legacy_checkpoint_imports_consolidated_bit_for_bit(tmp_path, tp, pp, gated):
    model = gpt_model(layers=4, padded_vocab=32, gated=gated)
    moments = moments_of(model)
    src = write_legacy(tmp_path / "mlm", model, tp=tp, pp=pp, layers=4, gated=gated, moments=moments, vocab_size=30)
    report = resurgo.import_checkpoint(src, tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    assert list(got["model"]) == list(model)  # global layer numbers, in model order
    for name, full in model.items():
        assert bits(got["model"][name]) == bits(trim(name, full, 30)), name
    assert got["model"]["output_layer.weight"].shape == (30, 8)  # the padding rows dropped (args.vocab_size)
    want = consolidated_optimizer(model, moments, 30)
    assert sorted(got["optimizer"]["state"]) == sorted(want)
    for i, entry in want.items():
        for moment, t in entry.items():
            assert bits(got["optimizer"]["state"][i][moment]) == bits(t), (i, moment)
        assert got["optimizer"]["state"][i]["step"].item() == 3.0
    groups = got["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    assert groups[0]["params"] + groups[1]["params"] == list(range(len(model)))
    assert got["iteration"] == got["step"] == 7
    assert got["args"]["swiglu"] is gated and got["args"]["params_dtype"] == "float32"
    assert got["opt_param_scheduler"]["num_steps"] == 28
    assert got["megatron"] == {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "num_layers": 4}
    assert got["rng"][f"mp_rank_{tp - 1:02d}_{pp - 1:03d}"][0]["torch_rng_state"].dtype == torch.uint8
    assert report.num_tensors == len(model) * 4 + 3 * tp * pp


def test_swiglu_fc1_is_gate_then_up_of_all_ranks(tmp_path):
    """A gated fc1 is two sub-parameters per rank: naively side by side, the ranks' shards would
    interleave gate and up; the import gathers each sub-parameter on its own."""
    model = gpt_model(layers=2, padded_vocab=32, gated=True)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=1, layers=2, gated=True)
    resurgo.import_checkpoint(src, tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")["model"]["decoder.layers.1.mlp.linear_fc1.weight"]
    full = model["decoder.layers.1.mlp.linear_fc1.weight"]
    assert bits(got) == bits(full)
    shards = [torch.load(src / f"iter_0000007/mp_rank_{t:02d}/model_optim_rng.pt", weights_only=False)["model"]
              ["decoder.layers.1.mlp.linear_fc1.weight"] for t in (0, 1)]
    assert bits(torch.cat(shards)) != bits(full)


def test_vocab_size_given_and_padding_kept_without_it(tmp_path):
    model = gpt_model(layers=2, padded_vocab=32, gated=False)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=1, layers=2, gated=False)
    resurgo.import_checkpoint(src, tmp_path / "padded", source="megatron")
    assert resurgo.load_dict(tmp_path / "padded")["model"]["embedding.word_embeddings.weight"].shape == (32, 8)
    spec = spec_from_megatron(src, vocab_size=29)
    resurgo.import_checkpoint(src, tmp_path / "trimmed", source="megatron", spec=spec)
    got = resurgo.load_dict(tmp_path / "trimmed")["model"]["embedding.word_embeddings.weight"]
    assert bits(got) == bits(model["embedding.word_embeddings.weight"][:29])
    with pytest.raises(CorruptCheckpointError, match="fewer than the vocabulary size 33"):
        spec_from_megatron(src, vocab_size=33)


def test_cli_imports_from_the_iteration_folder_too(tmp_path):
    model = gpt_model(layers=2, padded_vocab=32, gated=False)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=2, layers=2, gated=False)
    done = runner.invoke(app, ["import", str(src / "iter_0000007"), str(tmp_path / "ckpt"), "--from", "megatron",
                               "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["num_tensors"] == len(model) + 3 * 4
    got = resurgo.load_dict(tmp_path / "ckpt")["model"]
    assert bits(got["decoder.layers.1.self_attention.linear_proj.weight"]) == bits(
        model["decoder.layers.1.self_attention.linear_proj.weight"])


def test_malformed_checkpoints_are_named(tmp_path):
    model = gpt_model(layers=2, padded_vocab=32, gated=False)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=2, layers=2, gated=False)
    it = src / "iter_0000007"
    # a missing rank folder
    shutil.move(it / "mp_rank_01_001", tmp_path / "away")
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01_001: missing"):
        spec_from_megatron(src)
    shutil.move(tmp_path / "away", it / "mp_rank_01_001")
    # a replicated tensor that differs between tensor-parallel ranks: refused when read
    f = it / "mp_rank_01_000" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model"]["decoder.layers.0.input_layernorm.weight"] += 1
    torch.save(state, f)
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01_000/model_optim_rng.pt.*decoder.layers.0."
                                                     r"input_layernorm.weight.*replicas must be equal"):
        resurgo.import_checkpoint(src, tmp_path / "bad", source="megatron")
    assert not (tmp_path / "bad").exists()
    # a shard of another shape
    state["model"]["decoder.layers.0.self_attention.linear_proj.weight"] = torch.zeros(8, 5)
    torch.save(state, f)
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01_000/model_optim_rng.pt: 'decoder.layers.0.self_"
                                                     r"attention.linear_proj.weight' is a float32 tensor of shape "
                                                     r"\[8, 5\]"):
        spec_from_megatron(src)
    # a missing tensor
    del state["model"]["decoder.layers.0.self_attention.linear_proj.weight"]
    torch.save(state, f)
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01_000/model_optim_rng.pt: its model holds other "
                                                     r"tensors.*linear_proj.weight"):
        spec_from_megatron(src)
    # the iteration file naming a missing folder, or garbage
    (src / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(CorruptCheckpointError, match=r"names iteration '9', but .*iter_0000009 is missing"):
        spec_from_megatron(src)
    (src / "latest_checkpointed_iteration.txt").write_text("../../etc")
    with pytest.raises(CorruptCheckpointError, match="expected an iteration number or 'release'"):
        spec_from_megatron(src)
    with pytest.raises(NotACheckpointError, match="not a Megatron checkpoint"):
        spec_from_megatron(tmp_path / "away2" if (tmp_path / "away2").mkdir() is None else None)


def test_rank_grid_disagreeing_with_args_and_expert_parallel_are_refused(tmp_path):
    model = gpt_model(layers=2, padded_vocab=32, gated=False)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=1, layers=2, gated=False)
    it = src / "iter_0000007"
    shutil.rmtree(it / "mp_rank_01")
    with pytest.raises(CorruptCheckpointError, match=r"args.tensor_model_parallel_size is 2, but .* holds rank "
                                                     r"folders for 1"):
        spec_from_megatron(src)
    (it / "mp_rank_00_000_001").mkdir()
    with pytest.raises(UnsupportedValueError, match="expert-parallel"):
        spec_from_megatron(src)


def test_distributed_optimizer_in_the_legacy_layout_imports_under_each_parameter(tmp_path):
    """distrib_optim.pt beside each rank's model_optim_rng.pt, as megatron-core's DistributedOptimizer
    gathers it: per buffer, its parameters in reverse order, each at a multiple of 64 (padding
    zeros), a flat tensor per state. Found by value under each parameter, consolidated and trimmed
    to the vocabulary as the weights are (a real optimizer's files: the ``megatron`` tests)."""
    model = gpt_model(layers=2, padded_vocab=32, gated=True)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=1, layers=2, gated=True, vocab_size=30)
    groups = [{"lr": 1e-3, "weight_decay": wd, "step": 3.0} for wd in (0.1, 0.0)]

    def distrib(rank: Path, states=lambda w: {"param": w, "exp_avg": w * 2 + 1, "exp_avg_sq": w * w}) -> None:
        state = torch.load(rank / "model_optim_rng.pt", weights_only=False)
        state["optimizer"] = {"optimizer": {"param_groups": groups}}
        torch.save(state, rank / "model_optim_rng.pt")
        flat: dict[str, list[torch.Tensor]] = {"param": [], "exp_avg": [], "exp_avg_sq": []}
        at = 0
        for w in reversed([t for t in state["model"].values() if isinstance(t, torch.Tensor)]):
            start = -(-at // 64) * 64
            for kind, t in states(w.float().reshape(-1)).items():
                flat[kind] += [torch.zeros(start - at), t]
            at = start + w.numel()
        torch.save({"buckets_coalesced": True, 0: {(torch.float32, torch.float32): {
            **{k: torch.cat(v) for k, v in flat.items()}, "numel_unpadded": at}}}, rank / "distrib_optim.pt")

    for t in (0, 1):
        distrib(src / "iter_0000007" / f"mp_rank_{t:02d}")
    resurgo.import_checkpoint(src, tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    assert sorted(got["optimizer"]["state"]) == sorted(got["model"]) == sorted(model)
    for name, full in model.items():
        w = trim(name, full, 30)
        assert bits(got["model"][name]) == bits(w), name
        assert bits(got["optimizer"]["fp32_from_fp16_params"][name]) == bits(w), name
        assert bits(got["optimizer"]["state"][name]["exp_avg"]) == bits(w * 2 + 1), name
        assert bits(got["optimizer"]["state"][name]["exp_avg_sq"]) == bits(w * w), name
    assert got["optimizer"]["optimizer"]["param_groups"] == groups
    # refused: a rank without its file; chained optimizers' list; a file of another layout
    rank1 = src / "iter_0000007" / "mp_rank_01" / "distrib_optim.pt"
    rank1.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"mp_rank_01/distrib_optim.pt: missing, while other ranks' "):
        spec_from_megatron(src)
    torch.save([{}, {}], rank1)
    with pytest.raises(UnsupportedValueError, match=r"mp_rank_01/distrib_optim.pt: holds 2 chained optimizers' states"):
        spec_from_megatron(src)
    torch.save({0: {}}, rank1)
    with pytest.raises(UnsupportedValueError, match=r"mp_rank_01/distrib_optim.pt: not the distributed optimizer's "
                                                    r"state as megatron-core writes it"):
        spec_from_megatron(src)
    # a main param that is no weight of the rank
    distrib(rank1.parent, states=lambda w: {"param": w + 1, "exp_avg": w, "exp_avg_sq": w})
    with pytest.raises(CorruptCheckpointError, match=r"no model tensor's chunk holds the values at element 0 of "
                                                     r"iter_0000007/mp_rank_01/distrib_optim.pt buffer 0"):
        spec_from_megatron(src)


def test_rank_folder_linking_outside_and_crafted_pickle_are_refused(tmp_path):
    model = gpt_model(layers=2, padded_vocab=32, gated=False)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=1, layers=2, gated=False)
    it = src / "iter_0000007"
    outside = tmp_path / "outside"
    shutil.move(it / "mp_rank_01", outside)
    (it / "mp_rank_01").symlink_to(outside)
    with pytest.raises(resurgo.ResurgoError, match="outside"):
        spec_from_megatron(src)
    (it / "mp_rank_01").unlink()
    shutil.move(outside, it / "mp_rank_01")

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    f = it / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["args"].evil = Evil()
    torch.save(state, f)
    with pytest.raises(PickleNotAllowedError, match=r"mp_rank_01/model_optim_rng.pt.*_builtin.*print"):
        spec_from_megatron(src)


# -- Megatron-Core's own views (megatron-core 0.16.1 on the path: make test-megatron) --------------
HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def mcore_run(tmp_path_factory) -> Path:
    """The checkpoints of tests/megatron_workers.py: ROOT/mcore (torch_dist), ROOT/legacy, and
    ROOT/reference.pt (dist_checkpointing.load's view on one rank)."""
    return _workers("megatron_workers.py", tmp_path_factory.mktemp("megatron"))


def _workers(script: str, root: Path) -> Path:
    """``root`` after tests/``script`` ran its ranks and its reference into it."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, str(HERE / script), str(root), str(port)],
                          capture_output=True, text=True, timeout=900, env={**os.environ})
    assert done.returncode == 0, done.stderr[-4000:]
    return root


@pytest.mark.megatron
@pytest.mark.timeout(900)
def test_torch_dist_checkpoint_imports_as_megatron_loads_it(mcore_run, tmp_path):
    ref = torch.load(mcore_run / "reference.pt", weights_only=False)
    report = resurgo.import_checkpoint(mcore_run / "mcore", tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    flat = {}

    def walk(node, key):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            flat[key] = node

    walk(got, "")
    tensors = {k: v for k, v in ref["sharded"].items() if isinstance(v, torch.Tensor)}
    model = [k for k in tensors if not k.startswith("optimizer.")]
    assert len(model) == 17 and len(tensors) == 4 * 17  # the GPT's stacked layers, embeddings, output layer
    state = got["optimizer"]["state"]
    for key in model:
        w = tensors[key]
        assert bits(flat[key]) == bits(w), key
        # the distributed optimizer's state (fully_reshardable) under its parameter, as Megatron loads it
        # and as the writer computed it from the weight
        for kind, want in (("exp_avg", w * 2 + 1), ("exp_avg_sq", w * w)):
            assert bits(state[key][kind]) == bits(tensors[f"optimizer.state.{kind}.{key}"]) == bits(want), (key, kind)
        main = got["optimizer"]["fp32_from_fp16_params"][key]
        assert bits(main) == bits(tensors[f"optimizer.state.param.{key}"]) == bits(w), key
    assert sorted(state) == sorted(model)
    assert got["optimizer"]["param_state_sharding_type"] == ref["optimizer"]["param_state_sharding_type"]
    assert [g["step"] for g in got["optimizer"]["optimizer"]["param_groups"]] == [3, 3]
    # The ShardedObjects: each rank's RNG states, tensors bit for bit and Python's state as a value.
    for unique in ("rng_state/shard_0.0_2.2", "rng_state/shard_0.1_2.2", "rng_state/shard_1.0_2.2",
                   "rng_state/shard_1.1_2.2"):
        want = ref["sharded"][unique][0]
        assert bits(flat[f"{unique}.0.0.torch_rng_state"]) == bits(want["torch_rng_state"])
        assert bits(flat[f"{unique}.0.0.rng_tracker_states.model-parallel-rng"]) == bits(
            want["rng_tracker_states"]["model-parallel-rng"])
        assert flat[f"{unique}.0.0.random_rng_state"] == json.loads(json.dumps(want["random_rng_state"]))
    assert got["iteration"] == got["step"] == ref["iteration"] == 5
    assert got["args"]["swiglu"] is True and got["args"]["params_dtype"] == "float32"
    assert got["opt_param_scheduler"] == ref["opt_param_scheduler"]
    assert report.num_tensors == 4 * 17 + 12


@pytest.mark.megatron
@pytest.mark.timeout(900)
def test_legacy_files_of_a_real_model_import_as_its_torch_dist_view(mcore_run, tmp_path):
    """A real Megatron-Core GPT (2 tensor- and 2 pipeline-parallel ranks, SwiGLU) saved by its ranks
    in the legacy layout: the consolidation equals the one Megatron's sharded state dict gives (its SwiGLU
    factory for fc1, its layer axis), layer by layer."""
    ref = torch.load(mcore_run / "reference.pt", weights_only=False)["sharded"]
    resurgo.import_checkpoint(mcore_run / "legacy", tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")["model"]
    renames = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    compared = 0
    for name, t in got.items():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            rest = ".".join(parts[3:])
            for old, new in renames.items():
                rest = rest.replace(old, new) if rest.startswith(old) else rest
            want = ref[f"decoder.layers.{rest}"][int(parts[2])]
        else:
            want = ref[name]
        assert bits(t) == bits(want), name
        compared += 1
    assert compared == 53


@pytest.fixture(scope="session")
def mcore_optimizer_run(tmp_path_factory) -> Path:
    """The checkpoints of tests/megatron_optimizer_workers.py: a real DistributedOptimizer's
    ROOT/dp (dp_reshardable) and ROOT/full (fully_reshardable), and ROOT/reference.pt."""
    return _workers("megatron_optimizer_workers.py", tmp_path_factory.mktemp("megatron-optimizer"))


def _flat(node: dict, key: str = "") -> dict:
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{key}{k}."))
        else:
            out[f"{key}{k}"] = v
    return out


@pytest.mark.megatron
@pytest.mark.timeout(900)
def test_distributed_optimizer_in_bucket_space_imports_as_the_optimizer_held_it(mcore_optimizer_run, tmp_path):
    """Megatron-LM's default dp_reshardable format, written by a real training run's DistributedOptimizer
    (TP 2 x PP 2 x DP 2, several buckets per stage, tied embeddings in buckets of their own): every
    parameter's main param, exp_avg and exp_avg_sq, found in the buckets by value, equal bit for bit
    what the optimizer held, gathered from its DP shards and placed by the model's sharded state dict."""
    truth = _flat(torch.load(mcore_optimizer_run / "reference.pt", weights_only=False)["truth"])
    resurgo.import_checkpoint(mcore_optimizer_run / "dp", tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    opt = got.pop("optimizer")
    model = _flat(got)
    compared = 0
    for key, want in truth.items():
        if not isinstance(want, torch.Tensor) or not want.is_floating_point():
            continue
        if key.startswith("optimizer.state."):
            kind, name = key.removeprefix("optimizer.state.").split(".", 1)
            mine = opt["fp32_from_fp16_params"][name] if kind == "param" else opt["state"][name][kind]
        else:
            mine = model[key]
        assert bits(mine) == bits(want), key
        compared += 1
    assert compared == 4 * 16 and len(opt["state"]) == 16
    assert opt["param_state_sharding_type"] == "dp_reshardable"
    assert not any(".bucket_idx_" in k for k in _flat(opt)) and not any(".bucket_idx_" in k for k in model)
    # in place: the states' pieces point into Megatron's .distcp files, which stay as they are
    resurgo.import_checkpoint(mcore_optimizer_run / "dp", tmp_path / "inplace", source="megatron", in_place=True)
    again = _flat(resurgo.load_dict(tmp_path / "inplace"))
    assert all(bits(again[k]) == bits(v) for k, v in _flat({**got, "optimizer": opt}).items()
               if isinstance(v, torch.Tensor))


@pytest.mark.megatron
@pytest.mark.timeout(900)
def test_legacy_distributed_optimizer_imports_as_the_optimizer_held_it(mcore_optimizer_run, tmp_path):
    """The same run in the legacy layout: each rank's distrib_optim.pt (the optimizer's buffers
    gathered from its DP ranks, buckets coalesced) found under each parameter by value, bit for bit
    what the optimizer held; layers numbered globally, the tied output layer of the last stage with
    the state of the word embeddings it equals."""
    truth = _flat(torch.load(mcore_optimizer_run / "reference.pt", weights_only=False)["truth"])
    resurgo.import_checkpoint(mcore_optimizer_run / "legacy", tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    opt = got["optimizer"]
    renames = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
               "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    for name, w in got["model"].items():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            rest = ".".join(parts[3:])
            for old, new in renames.items():
                rest = rest.replace(old, new) if rest.startswith(old) else rest
            key, pick = f"decoder.layers.{rest}", (lambda t, i=int(parts[2]): t[i])
        else:
            key, pick = ("embedding.word_embeddings.weight" if name == "output_layer.weight" else name), (lambda t: t)
        assert bits(w) == bits(pick(truth[key])), name
        assert bits(opt["fp32_from_fp16_params"][name]) == bits(pick(truth[f"optimizer.state.param.{key}"])), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert bits(opt["state"][name][kind]) == bits(pick(truth[f"optimizer.state.{kind}.{key}"])), (name, kind)
    assert len(got["model"]) == len(opt["state"]) == 4 * 12 + 5
    assert [g["step"] for g in opt["optimizer"]["param_groups"]] == [3, 3]


@pytest.mark.megatron
@pytest.mark.timeout(900)
def test_megatron_job_continues_as_fsdp2_job_on_3_ranks(mcore_optimizer_run, tmp_path):
    """The real Megatron run (TP 2 x PP 2 x DP 2, distributed optimizer) saved after 3 steps and
    continued 4 more by Megatron itself (continued.json). Imported from its legacy layout, it
    continues as an FSDP2 job on 3 ranks (megatron_continue.py: a plain-torch GPT of Megatron's
    names and layouts, AdamW with the moments found in distrib_optim.pt and Megatron's param groups)
    on the same global batches, with Megatron's losses. Tolerance: relative 1e-6 (measured: under
    1e-7); the jobs differ in the order of sums (tensor-parallel partial sums, gradients reduced
    over 2 ranks vs. reduce-scattered over 3); a moment on the wrong parameter, a wrong step count,
    or the no-decay group's weight decay taken as 0 instead of as saved moves them by 3e-6 or more."""
    import subprocess
    import sys

    resurgo.import_checkpoint(mcore_optimizer_run / "legacy", tmp_path / "imported", source="megatron")
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, str(HERE / "megatron_continue.py"), "megatron", str(tmp_path / "imported"),
                           str(tmp_path / "fsdp.json"), str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fsdp, megatron = json.loads((tmp_path / "fsdp.json").read_text()), json.loads(
        (mcore_optimizer_run / "continued.json").read_text())
    # the tied output layer of the last stage: the word embeddings, which the FSDP2 model holds once
    assert "model.output_layer.weight" in fsdp["unexpected"]
    assert len(fsdp["losses"]) == len(megatron["losses"]) == 4
    assert fsdp["losses"] == pytest.approx(megatron["losses"], rel=1e-6, abs=0)


@pytest.mark.megatron
@pytest.mark.timeout(900)
def test_megatrons_own_model_space_save_of_several_buckets_is_refused(mcore_optimizer_run, tmp_path):
    """The same optimizer saved by megatron-core in fully_reshardable: its writer cuts each
    parameter's range from buffers that leave out the padding between buckets, so most states are
    another parameter's (Megatron's own load of it gives them so); the import finds main params
    that are not the weights and refuses, naming one."""
    ref = torch.load(mcore_optimizer_run / "reference.pt", weights_only=False)
    truth, full = _flat(ref["truth"]), _flat(ref["full"])
    wrong = [k for k in truth if k.startswith("optimizer.state.") and not torch.equal(truth[k], full[k])]
    assert len(wrong) >= 30  # of 48
    with pytest.raises(CorruptCheckpointError, match=r"iter_0000003: the distributed optimizer's main parameter of "
                                                     r"'.*' at \[.*\] is not the model's weight there"):
        resurgo.import_checkpoint(mcore_optimizer_run / "full", tmp_path / "ckpt", source="megatron")
    assert not (tmp_path / "ckpt").exists()


def _torch_dist_like(folder: Path) -> dict:
    """A torch_dist checkpoint as its files are laid out (DCP, common.pt, metadata.json), written
    without megatron: a tensor and the common state. (DCP's own writer pickles a bytes item where
    Megatron's writes its bytes raw, so the ShardedObjects are left to the megatron tests.)"""
    import argparse

    import torch.distributed.checkpoint as dcp

    weight = torch.randn(4, 3)
    dcp.save({"decoder.layers.mlp.linear_fc2.weight": weight}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"args": argparse.Namespace(num_layers=1, params_dtype=torch.bfloat16), "iteration": 3,
                "opt_param_scheduler": {"num_steps": 12}}, folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    (folder.parent / "latest_checkpointed_iteration.txt").write_text("3")
    return {"weight": weight}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_distributed_optimizer_state_in_model_space_goes_under_its_parameter(tmp_path):
    """The fully_reshardable format: optimizer.state.<param|exp_avg|exp_avg_sq>.<key> of each
    parameter's shape (tests/megatron_workers.py writes it through Megatron-Core; here without it)."""
    import argparse

    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "run" / "iter_0000003"
    w = torch.randn(2, 4, 3)
    states = {"param": w.clone(), "exp_avg": w * 2 + 1, "exp_avg_sq": w * w}
    key = "decoder.layers.mlp.linear_fc2.weight"

    one = {"optimizer": {"param_groups": [{"lr": 1e-3, "step": 3}]}, "param_state_sharding_type": "fully_reshardable"}

    def write(tensors: dict, optimizer: dict = one) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        dcp.save(tensors, checkpoint_id=str(folder), no_dist=True)
        torch.save({"args": argparse.Namespace(num_layers=2), "iteration": 3, "optimizer": optimizer},
                   folder / "common.pt")
        (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))

    write({key: w, **{f"optimizer.state.{k}.{key}": t for k, t in states.items()}})
    (folder.parent / "latest_checkpointed_iteration.txt").write_text("3")
    resurgo.import_checkpoint(tmp_path / "run", tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    assert bits(got[key]) == bits(w)
    assert bits(got["optimizer"]["state"][key]["exp_avg"]) == bits(states["exp_avg"])
    assert bits(got["optimizer"]["state"][key]["exp_avg_sq"]) == bits(states["exp_avg_sq"])
    assert bits(got["optimizer"]["fp32_from_fp16_params"][key]) == bits(w)
    assert got["optimizer"]["optimizer"]["param_groups"] == [{"lr": 1e-3, "step": 3}]
    # a ChainedOptimizer of two (dense and expert parameters): its tensors' keys prefixed chained_<i>.
    expert = "decoder.layers.mlp.experts.linear_fc1.weight"
    write({key: w, expert: w + 1, **{f"chained_0.optimizer.state.{k}.{key}": t for k, t in states.items()},
           **{f"chained_1.optimizer.state.{k}.{expert}": t + 1 for k, t in states.items()}}, {0: one, 1: one})
    resurgo.import_checkpoint(tmp_path / "run", tmp_path / "chained", source="megatron")
    got = resurgo.load_dict(tmp_path / "chained")
    assert bits(got["optimizer"]["state"][expert]["exp_avg_sq"]) == bits(states["exp_avg_sq"] + 1)
    assert bits(got["optimizer"]["state"][key]["exp_avg"]) == bits(states["exp_avg"])
    assert got["optimizer"]["1"]["optimizer"]["param_groups"] == [{"lr": 1e-3, "step": 3}]
    write({key: w, f"optimizer.state.exp_avg.{key}": states["exp_avg"], f"optimizer.state.param.{key}": w})
    with pytest.raises(CorruptCheckpointError, match=r"iter_0000003/.metadata: the distributed optimizer's state of "
                                                     r"'decoder.layers.mlp.linear_fc2.weight' lacks \['exp_avg_sq'\]"):
        spec_from_megatron(tmp_path / "run")
    write({key: w, **{f"optimizer.state.{k}.{key}": t for k, t in states.items()},
           "optimizer.state.exp_avg.decoder.gone.weight": w})
    with pytest.raises(CorruptCheckpointError, match=r"'optimizer.state.exp_avg.decoder.gone.weight' is not the state "
                                                     r"of a model tensor"):
        spec_from_megatron(tmp_path / "run")
    write({key: w, **{f"optimizer.state.{k}.{key}": t for k, t in states.items()},
           f"optimizer.state.exp_avg.{key}": w.reshape(8, 3)})
    with pytest.raises(CorruptCheckpointError, match=r"'optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight'"
                                                     r" has the shape \[8, 3\], its parameter .* \[2, 4, 3\]"):
        spec_from_megatron(tmp_path / "run")
    # main params that are not the weights: the state was saved out of place
    moved = {**states, "param": torch.roll(w, 1, dims=2)}
    write({key: w, **{f"optimizer.state.{k}.{key}": t for k, t in moved.items()}})
    with pytest.raises(CorruptCheckpointError, match=r"iter_0000003: the distributed optimizer's main parameter of "
                                                     r"'decoder.layers.mlp.linear_fc2.weight' at \[0, 0, 0\] is not "
                                                     r"the model's weight there"):
        spec_from_megatron(tmp_path / "run")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dist_layout_imports_and_is_checked(tmp_path):
    want = _torch_dist_like(tmp_path / "run" / "iter_0000003")
    resurgo.import_checkpoint(tmp_path / "run", tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    assert bits(got["decoder.layers.mlp.linear_fc2.weight"]) == bits(want["weight"])
    assert got["args"] == {"num_layers": 1, "params_dtype": "bfloat16"}
    assert got["iteration"] == got["step"] == 3 and got["opt_param_scheduler"] == {"num_steps": 12}
    with pytest.raises(UnsupportedValueError, match=r"iter_0000003: a torch_dist checkpoint .* vocab_size=30 "
                                                    r"applies to the legacy layout only"):
        spec_from_megatron(tmp_path / "run", vocab_size=30)
    folder = tmp_path / "run" / "iter_0000003"
    (folder / "common.pt").rename(tmp_path / "common.pt")
    with pytest.raises(CorruptCheckpointError, match=r"iter_0000003/common.pt: missing"):
        spec_from_megatron(tmp_path / "run")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(UnsupportedValueError, match=r"metadata.json: sharded_backend 'zarr'"):
        spec_from_megatron(folder)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tensor_parallel_checkpoint_continues_as_fsdp2_job_on_3_ranks(tmp_path):
    """A GPT saved by Megatron over 2 tensor- and 2 pipeline-parallel ranks (SwiGLU, grouped-query
    attention, Adam state after 3 steps), imported, continues as an FSDP2 job on 3 ranks
    (megatron_continue.py: a plain-torch GPT of Megatron-Core's names and layouts, AdamW with
    Megatron's two param groups) with the losses of one process continuing from the consolidated
    state. Tolerance: relative 1e-5; the jobs differ only in the order of sums (gradients
    reduce-scattered over 3 ranks, the loss averaged over them); a shard misplaced (gate and up
    interleaved, a row-parallel weight laid on the wrong axis) or a moment on the wrong parameter
    moves the losses by far more."""
    import socket
    import subprocess
    import sys

    from megatron_continue import LAYERS, VOCAB
    from megatron_files import consolidated_optimizer

    model = gpt_model(layers=LAYERS, padded_vocab=VOCAB, gated=True)
    g = torch.Generator().manual_seed(3)
    moments = {n: {"exp_avg": torch.randn(t.shape, generator=g) * 1e-2, "exp_avg_sq": torch.rand(t.shape, generator=g)
                   * 1e-4} for n, t in model.items()}
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=2, layers=LAYERS, gated=True, moments=moments)
    resurgo.import_checkpoint(src, tmp_path / "imported", source="megatron")
    state = consolidated_optimizer(model, moments, None)
    for entry in state.values():
        entry["step"] = torch.tensor(3.0)
    got = resurgo.load_dict(tmp_path / "imported")
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in pg.items()} for pg in got["optimizer"]["param_groups"]]
    torch.save({"model": model, "optimizer": {"state": state, "param_groups": groups}}, tmp_path / "one.pt")
    here = Path(__file__).parent
    one = subprocess.run([sys.executable, str(here / "megatron_continue.py"), "one", str(tmp_path / "one.pt"),
                          str(tmp_path / "one.json")], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fsdp = subprocess.run([sys.executable, str(here / "megatron_continue.py"), "fsdp", str(tmp_path / "imported"),
                           str(tmp_path / "fsdp.json"), str(port)], capture_output=True, text=True, timeout=300)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    want, have = json.loads((tmp_path / "one.json").read_text()), json.loads((tmp_path / "fsdp.json").read_text())
    # what is missing are AdamW's own flags (foreach, maximize, ...) the written param groups lack
    assert have["missing"] and all(re.fullmatch(r"optimizer\.param_groups\.[01]\.[a-z_]+", k) for k in have["missing"])
    assert len(have["losses"]) == 4
    assert have["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=0)


def test_mixed_precision_run_brings_its_fp32_main_params(tmp_path):
    model = gpt_model(layers=2, padded_vocab=32, gated=True)
    moments = moments_of(model)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=2, layers=2, gated=True, moments=moments, bf16=True)
    resurgo.import_checkpoint(src, tmp_path / "ckpt", source="megatron")
    got = resurgo.load_dict(tmp_path / "ckpt")
    main = got["optimizer"]["fp32_from_fp16_params"]
    assert list(main) == [n for n in model if not no_decay(n, model[n])] + [n for n in model if no_decay(n, model[n])]
    for name, full in model.items():
        assert bits(main[name]) == bits(full), name
        assert bits(got["model"][name]) == bits(full.bfloat16()), name
    want = consolidated_optimizer(model, moments, None)
    assert bits(got["optimizer"]["state"][0]["exp_avg"]) == bits(want[0]["exp_avg"])


def test_cli_vocab_size_drops_the_padding_and_is_refused_where_it_does_not_apply(tmp_path):
    model = gpt_model(layers=2, padded_vocab=32, gated=False)
    src = write_legacy(tmp_path / "mlm", model, tp=2, pp=1, layers=2, gated=False, moments=moments_of(model))
    done = runner.invoke(app, ["import", str(src), str(tmp_path / "ckpt"), "--from", "megatron", "--vocab-size", "29"])
    assert done.exit_code == 0, done.output
    got = resurgo.load_dict(tmp_path / "ckpt")
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert bits(got["model"][name]) == bits(model[name][:29]), name
    assert bits(got["optimizer"]["state"][0]["exp_avg"]) == bits(consolidated_optimizer(
        model, moments_of(model), 29)[0]["exp_avg"])  # the word embeddings' moments trimmed alike
    emitted = runner.invoke(app, ["import", str(src), "--from", "megatron", "--vocab-size", "29", "--emit-spec",
                                  str(tmp_path / "spec.json")])
    assert emitted.exit_code == 0 and '"shape":[29,8]' in (tmp_path / "spec.json").read_text()
    refused = runner.invoke(app, ["import", str(src), str(tmp_path / "no"), "--from", "megatron", "--vocab-size", "33"])
    assert refused.exit_code == 3 and "fewer than the vocabulary size 33" in refused.output
    for source, where in (("hf", str(src)), ("dcp", str(src))):
        refused = runner.invoke(app, ["import", where, str(tmp_path / "no"), "--from", source, "--vocab-size", "29"])
        assert refused.exit_code == 2 and "vocab_size=29" in refused.output, refused.output
    with pytest.raises(UnsupportedValueError, match=r"vocab_size=29 with spec="):
        resurgo.import_checkpoint(src, tmp_path / "no", source="megatron", spec=spec_from_megatron(src),
                                  vocab_size=29)
    assert not (tmp_path / "no").exists()
