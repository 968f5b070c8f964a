"""`resurgo import --from hf` of models written by transformers itself: small models built from
their configs (odd sizes, tied embeddings; no downloads), saved with ``save_pretrained`` as one
safetensors file and sharded with ``model.safetensors.index.json``, and as ``pytorch_model.bin``,
single and sharded with ``pytorch_model.bin.index.json``. transformers 5 writes only
safetensors, so the ``.bin`` forms are written as transformers 4's ``save_pretrained(...,
safe_serialization=False)`` wrote them: ``torch.save`` of the state dict (tied weights kept, sharing
their storage), split by ``huggingface_hub.split_torch_state_dict_into_shards``, with its index.

Each import is loaded with resurgo.load into a freshly built model and compared bit for bit with
``AutoModelForCausalLM.from_pretrained``; then into FSDP2 and tensor-parallel layouts on 2 gloo
ranks, each rank reading only its own shard's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import split_torch_state_dict_into_shards  # installed with transformers
from typer.testing import CliRunner

import resurgo
from dist_harness import run_ranks
from resurgo.cli import app
from resurgo.errors import CorruptCheckpointError, ImportSpecError

runner = CliRunner()


def llama(seed: int, **overrides) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(**{"vocab_size": 101, "hidden_size": 24, "intermediate_size": 37,
                                      "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                      "tie_word_embeddings": True, **overrides})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def gpt2(seed: int) -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=13, n_embd=20, n_layer=2, n_head=4)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)


def save_bin(model: torch.nn.Module, directory: Path, max_shard_size: int | None = None) -> None:
    """What transformers 4 wrote with safe_serialization=False: the state dict as torch.save files
    (tied weights kept, sharing their storage), sharded with an index when above max_shard_size."""
    model.config.save_pretrained(directory)
    sd = model.state_dict()
    split = split_torch_state_dict_into_shards(sd, filename_pattern="pytorch_model{suffix}.bin",
                                               max_shard_size=max_shard_size or "50GB")
    for name, keys in split.filename_to_tensors.items():
        torch.save({k: sd[k] for k in keys}, directory / name)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


FORMS = {
    "safetensors": (lambda m, d: m.save_pretrained(d), ["model.safetensors"]),
    "safetensors-sharded": (lambda m, d: m.save_pretrained(d, max_shard_size="8KB"), ["model.safetensors.index.json"]),
    "bin": (lambda m, d: save_bin(m, d), ["pytorch_model.bin"]),
    "bin-sharded": (lambda m, d: save_bin(m, d, 8000), ["pytorch_model.bin.index.json"]),
}


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2-bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_import_equals_from_pretrained_bit_for_bit(tmp_path, form, build):
    save, marker = FORMS[form]
    src = tmp_path / "model"
    src.mkdir()
    save(build(seed=0), src)
    names = sorted(p.name for p in src.iterdir())
    assert set(marker) <= set(names)
    if form.endswith("sharded"):
        assert sum(n.endswith(".safetensors") or n.endswith(".bin") for n in names) >= 3, names
    result = runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--from", "hf", "--json"])
    assert result.exit_code == 0, result.output

    want = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    fresh = build(seed=1)  # other weights, all of which the load must replace
    tied = fresh.lm_head.weight is fresh.get_input_embeddings().weight
    assert tied
    report = resurgo.load(fresh.state_dict(), tmp_path / "out", strict=False)
    # safetensors holds a tied weight once (transformers drops lm_head.weight); torch.save keeps both names
    assert report.missing_keys == ([] if form.startswith("bin") else ["lm_head.weight"])
    assert report.unexpected_keys == []
    got = fresh.state_dict()
    assert set(got) == set(want)
    for key, w in want.items():
        assert got[key].dtype == w.dtype and got[key].shape == w.shape and bits(got[key]) == bits(w), key
    assert fresh.lm_head.weight is fresh.get_input_embeddings().weight  # still tied after the load
    assert runner.invoke(app, ["verify", str(tmp_path / "out")]).exit_code == 0


def test_sharded_bin_index_must_match_its_shards(tmp_path):
    save_bin(llama(seed=0), tmp_path, 8000)
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = next(iter(index["weight_map"].values()))
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=r"pytorch_model\.bin\.index\.json: lists tensors its shards do not "
                                                     r"hold.*\['model\.extra\.weight'\]"):
        resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="hf")
    index["weight_map"]["model.extra.weight"] = "../elsewhere.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(ImportSpecError, match=r"names the shard '\.\./elsewhere\.bin', which is not a file name"):
        resurgo.import_checkpoint(tmp_path, tmp_path / "out", source="hf")
    assert not (tmp_path / "out").exists()


def test_fine_tuning_start_on_fsdp2_and_tp_reads_only_each_ranks_shard(tmp_path):
    """An imported model universal-loaded into FSDP2 and TP on 2 ranks equals from_pretrained bit
    for bit, and each rank reads its own rows' bytes: half of every row-sharded tensor, not the model."""
    src = tmp_path / "model"
    model = llama(seed=0, vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(src, max_shard_size="1MB")
    resurgo.import_checkpoint(src, tmp_path / "out", source="hf")
    model_bytes = sum(t.numel() * t.element_size() for k, t in model.state_dict().items() if k != "lm_head.weight")
    results = run_ranks(2, "hf_import_workers:fsdp2_and_tp", str(src), str(tmp_path / "out"))
    for layout in ("fsdp2", "tp"):
        per_rank = [r[layout] for r in results]
        assert [r["bytes_read"] for r in per_rank] == [r["expected"] for r in per_rank], layout
    fsdp2 = [r["fsdp2"] for r in results]
    assert set(fsdp2[0]["placements"].values()) == {"(Shard(dim=0),)"} and len(fsdp2[0]["placements"]) == 11
    assert sum(r["own"] for r in fsdp2) == model_bytes
    tp_placements = results[0]["tp"]["placements"]
    assert tp_placements["model.layers.0.self_attn.k_proj.weight"] == "(Shard(dim=0),)"
    assert tp_placements["model.layers.0.mlp.down_proj.weight"] == "(Shard(dim=1),)"
    assert tp_placements["model.embed_tokens.weight"] == "(Shard(dim=0),)" and len(tp_placements) == 8
    # FSDP2: each rank reads half the model, and a little more: the norms, 1 KiB each, are one checksum block
    norms = 3 * 256 * 4
    assert all(r["bytes_read"] == model_bytes // 2 + norms // 2 for r in fsdp2)
    # TP: the column-split o_proj and down_proj (1.25 MiB) and the replicated norms are read whole
    tp = [r["tp"] for r in results]
    split_columns = 256 * 256 * 4 + 256 * 1024 * 4
    assert all(r["bytes_read"] == (model_bytes - split_columns - norms) // 2 + split_columns + norms for r in tp)
    assert all(r["bytes_read"] < 0.65 * model_bytes for r in tp)
