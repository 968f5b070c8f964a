"""resurgo.import_checkpoint(source="dcp") and `resurgo import --from dcp`: checkpoints written by
torch.distributed.checkpoint.save itself, in one process and on 2 gloo ranks (FSDP2 with uneven
shards, tensor parallelism). Every import is loaded back with resurgo.load as full tensors and as
a Shard of rows, and compared bit for bit with DCP's own consolidation (dcp_to_torch_save).
Bad input: a truncated .distcp file, a missing rank's file, crafted .metadata pickles, and
non-plain items that need allow_pickle.
"""

from __future__ import annotations

import datetime
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from typer.testing import CliRunner

import resurgo
from dist_harness import run_ranks
from resurgo.cli import app
from resurgo.errors import CorruptCheckpointError, PickleNotAllowedError
from resurgo.interop import spec as spec_lang
from resurgo.interop.dcp import spec_from_dcp

runner = CliRunner()


def save_one_process(state: dict, path: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)


def flat(node: object, prefix: str = "") -> dict:
    """DCP's flat names of a nested state dict: dicts, and lists that hold dicts or tensors
    (optimizer param_groups), joined by '.'; other lists are values."""
    if isinstance(node, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in node):
        node = dict(enumerate(node))
    if isinstance(node, dict):
        return {k: v for key, sub in node.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def consolidated(src: Path, tmp: Path) -> dict:
    """DCP's own consolidated view of a checkpoint, flattened to DCP's names."""
    dcp_to_torch_save(src, tmp / "consolidated.pt")
    return flat(torch.load(tmp / "consolidated.pt", weights_only=False))


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def check_import(src: Path, tmp: Path) -> dict:
    """Import ``src``; the result equals DCP's consolidation bit for bit, in full and as row shards."""
    expected = consolidated(src, tmp)
    dst = tmp / "imported"
    report = resurgo.import_checkpoint(src, dst, source="dcp")
    tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    assert report.num_tensors == len(tensors) and report.num_values == len(expected) - len(tensors)
    assert report.tensor_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    got = resurgo.load_dict(dst)
    assert set(got) == set(expected)
    for key, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert got[key].dtype == want.dtype and got[key].shape == want.shape and bits(got[key]) == bits(want), key
        else:
            assert got[key] == want, key
    for key, want in tensors.items():  # rows 1.. of every matrix, as a row-parallel rank would load them
        if want.dim() == 2 and want.shape[0] > 1:
            local = torch.zeros(want.shape[0] - 1, want.shape[1], dtype=want.dtype)
            resurgo.load({key: resurgo.Shard(local, tuple(want.shape), (1, 0))}, dst, strict=False)
            assert bits(local) == bits(want[1:]), key
    assert runner.invoke(app, ["verify", str(dst)]).exit_code == 0
    return got


def test_one_process_nested_strided_and_plain_values(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(5, 3, generator=g), "t": torch.randn(3, 4, generator=g).t(),
                       "h": torch.randn(6, 2, generator=g).bfloat16(), "b": torch.arange(4), "scalar": torch.tensor(2.5),
                       "empty": torch.empty(0, 3)},
             "extra": {"step": 3, "name": "run-1", "lst": [1, 2.5, None, True], "cfg": {"lr": 0.1, "betas": [0.9, 0.99]}}}
    save_one_process(state, tmp_path / "dcp")
    got = check_import(tmp_path / "dcp", tmp_path)
    assert got["extra.step"] == 3 and got["extra.cfg.lr"] == 0.1 and got["extra.cfg.betas"] == [0.9, 0.99]
    result = runner.invoke(app, ["import", str(tmp_path / "dcp"), str(tmp_path / "cli"), "--from", "dcp", "--json"])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def dist_saves(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dcp-dist")
    run_ranks(2, "dcp_import_workers:fsdp2_then_tp", str(root / "fsdp2"), str(root / "tp"))
    return {"fsdp2": root / "fsdp2", "tp": root / "tp"}


@pytest.mark.parametrize("kind", ["fsdp2", "tp"])
def test_two_rank_saves_import_bit_for_bit(dist_saves, tmp_path, kind):
    src = dist_saves[kind]
    assert sorted(p.name for p in src.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    spec = spec_from_dcp(src)
    pieces = {t.key: [(p.box.offsets, p.box.shape) for p in t.pieces] for t in spec.tensors}
    if kind == "fsdp2":  # 7 rows over 2 ranks: 4 and 3; 3 rows: 2 and 1
        assert pieces["model.0.weight"] == [([0, 0], [4, 5]), ([4, 0], [3, 5])]
        assert pieces["optim.state.2.weight.exp_avg"] == [([0, 0], [2, 7]), ([2, 0], [1, 7])]
    else:  # column-parallel splits the first layer's rows, row-parallel the second's columns
        assert pieces["model.0.weight"] == [([0, 0], [4, 5]), ([4, 0], [4, 5])]
        assert pieces["model.2.weight"] == [([0, 0], [3, 4]), ([0, 4], [3, 4])]
    got = check_import(src, tmp_path)
    assert got["extra.step"] == 7 and got["extra.tags"] == ["a", "b"]


def test_missing_rank_file_is_named(dist_saves, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(dist_saves["fsdp2"], src)
    (src / "__1_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp: missing; .*\.metadata places tensor '.*' chunk "
                                                     r"at offsets \[\d+(, 0)?\] in it"):
        resurgo.import_checkpoint(src, tmp_path / "out", source="dcp")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, ["import", str(src), str(tmp_path / "out"), "--from", "dcp"])
    assert result.exit_code == 3 and "__1_0.distcp" in result.output


def test_truncated_distcp_file_is_named(tmp_path):
    save_one_process({"w": torch.randn(50, 4), "v": torch.randn(30)}, tmp_path / "dcp")
    data = tmp_path / "dcp" / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CorruptCheckpointError, match=rf"__0_0\.distcp: tensor '.' chunk at offsets \[0\]? ?.*needs bytes "
                                                     rf"\[\d+, {size}\) but the file holds {size - 100} bytes; it is truncated"):
        resurgo.import_checkpoint(tmp_path / "dcp", tmp_path / "out", source="dcp")
    result = runner.invoke(app, ["import", str(tmp_path / "dcp"), str(tmp_path / "out"), "--from", "dcp"])
    assert result.exit_code == 3 and not (tmp_path / "out").exists()


def crafted(module: str, name: str, arg: str) -> bytes:
    """A pickle that calls ``module.name(arg)`` when loaded by an unrestricted unpickler."""
    return f"c{module}\n{name}\n(V{arg}\ntR.".encode("raw_unicode_escape")


@pytest.mark.parametrize("module, name, arg_of", [
    ("os", "system", lambda m: f"touch {m}"),
    ("builtins", "eval", lambda m: f"open({str(m)!r}, 'w')"),
    ("builtins", "exec", lambda m: f"open({str(m)!r}, 'w')"),
    ("importlib", "import_module", lambda m: "antigravity"),
])
def test_crafted_metadata_is_refused_and_has_no_effect(tmp_path, module, name, arg_of):
    save_one_process({"w": torch.randn(3)}, tmp_path / "dcp")
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / ".metadata").write_bytes(crafted(module, name, arg_of(marker)))
    with pytest.raises(PickleNotAllowedError, match=rf"\.metadata: the pickle needs the global {module}\.{name}, which "
                                                    r"a torch.distributed.checkpoint \.metadata never holds"):
        resurgo.import_checkpoint(tmp_path / "dcp", tmp_path / "out", source="dcp")
    result = runner.invoke(app, ["import", str(tmp_path / "dcp"), str(tmp_path / "out"), "--from", "dcp"])
    assert result.exit_code == 2 and not marker.exists() and not (tmp_path / "out").exists()


def test_non_plain_item_needs_allow_pickle(tmp_path):
    save_one_process({"w": torch.randn(3), "extra": {"when": datetime.timedelta(seconds=5), "n": 1}}, tmp_path / "dcp")
    spec = spec_from_dcp(tmp_path / "dcp")
    assert set(spec.objects) == {"extra.when"} and spec.values == {"extra.n": 1}
    assert spec_lang.loads(spec_lang.dumps(spec)) == spec
    with pytest.raises(PickleNotAllowedError, match=r"__0_0\.distcp: 'extra\.when' is a pickled Python object "
                                                    r"\(bytes \[\d+, \d+\)\) .* pass allow_pickle=True"):
        resurgo.import_checkpoint(tmp_path / "dcp", tmp_path / "out", source="dcp")
    assert not (tmp_path / "out").exists()
    assert runner.invoke(app, ["import", str(tmp_path / "dcp"), str(tmp_path / "cli"), "--from", "dcp"]).exit_code == 2
    assert runner.invoke(app, ["import", str(tmp_path / "dcp"), str(tmp_path / "cli"), "--from", "dcp",
                               "--allow-pickle"]).exit_code == 0
    report = resurgo.import_checkpoint(tmp_path / "dcp", tmp_path / "out", source="dcp", allow_pickle=True)
    assert report.num_values == 2
    got = resurgo.load_dict(tmp_path / "out", allow_pickle=True)
    assert got["extra.when"] == datetime.timedelta(seconds=5) and got["extra.n"] == 1
