"""Every foreseeable failure raises the right ResurgoError subclass, naming the key and both sides."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch

import resurgo
from resurgo.errors import (
    CheckpointNotFoundError,
    DataPositionError,
    DTypeMismatchError,
    IncompleteCheckpointError,
    KeyMismatchError,
    ManifestError,
    NotACheckpointError,
    PickleNotAllowedError,
    ResurgoError,
    ShapeMismatchError,
    TypeMismatchError,
    UnsupportedValueError,
    WorldSizeMismatchError,
)

from helpers import bits_equal, sealed_manifest


def saved(tmp_path, state=None):
    state = state if state is not None else {"a": torch.arange(4.0), "b": {"c": torch.ones(2, 2)}, "step": 3}
    resurgo.save(state, tmp_path / "c")
    return tmp_path / "c"


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint") as ei:
        resurgo.load_dict(tmp_path / "nope")
    assert isinstance(ei.value, FileNotFoundError) and str(tmp_path / "nope") in str(ei.value)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotACheckpointError, match="is a file"):
        resurgo.load_dict(tmp_path / "file")
    (tmp_path / "dir").mkdir()
    with pytest.raises(NotACheckpointError, match="no manifest.json") as ei:
        resurgo.load_dict(tmp_path / "dir")
    assert not isinstance(ei.value, IncompleteCheckpointError)


def test_incomplete_checkpoint(tmp_path):
    path = saved(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        resurgo.load({"a": torch.zeros(4)}, path)


def test_strict_lists_every_missing_and_unexpected_key(tmp_path):
    path = saved(tmp_path)
    target = {"a": torch.zeros(4), "b": {"d": torch.zeros(1), "e": 1}, "extra": None}
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in target.items()}
    with pytest.raises(KeyMismatchError) as ei:
        resurgo.load(target, path)
    err = ei.value
    assert sorted(err.missing) == ["b.d", "b.e", "extra"]
    assert sorted(err.unexpected) == ["b.c", "step"]
    for k in ["b.d", "b.e", "extra", "b.c", "step"]:
        assert repr(k) in str(err)
    assert torch.equal(target["a"], before["a"])  # nothing was loaded


def test_non_strict_loads_what_matches(tmp_path):
    path = saved(tmp_path)
    target = {"a": torch.zeros(4), "b": {"d": torch.zeros(1)}}
    report = resurgo.load(target, path, strict=False)
    assert torch.equal(target["a"], torch.arange(4.0))
    assert torch.equal(target["b"]["d"], torch.zeros(1))
    assert report.missing_keys == ["b.d"] and sorted(report.unexpected_keys) == ["b.c", "step"]


def test_dtype_mismatch_never_casts(tmp_path):
    path = saved(tmp_path)
    target = {"a": torch.zeros(4, dtype=torch.float64), "b": {"c": torch.zeros(2, 2)}, "step": 0}
    with pytest.raises(DTypeMismatchError) as ei:
        resurgo.load(target, path)
    msg = str(ei.value)
    assert "'a'" in msg and "float32" in msg and "float64" in msg
    assert torch.equal(target["a"], torch.zeros(4, dtype=torch.float64))
    assert isinstance(ei.value, TypeError)


def test_shape_mismatch(tmp_path):
    path = saved(tmp_path)
    target = {"a": torch.zeros(4), "b": {"c": torch.zeros(4)}, "step": 0}
    with pytest.raises(ShapeMismatchError) as ei:
        resurgo.load(target, path)
    assert "'b.c'" in str(ei.value) and "[2, 2]" in str(ei.value) and "[4]" in str(ei.value)
    assert "ignore_mismatched=True" in str(ei.value)
    target["b"]["c"] = torch.zeros(4)
    report = resurgo.load(target, path, ignore_mismatched=True)
    assert report.mismatched_keys == ["b.c"]
    assert torch.equal(target["a"], torch.arange(4.0)) and torch.equal(target["b"]["c"], torch.zeros(4))


def test_strict_false_does_not_skip_a_mismatched_tensor(tmp_path):
    """strict is about keys: as torch's load_state_dict(strict=False), a tensor of another shape or
    dtype still raises, and nothing is loaded; only ignore_mismatched=True skips it."""
    path = saved(tmp_path)
    for bad, error in ((torch.zeros(4), ShapeMismatchError), (torch.zeros(2, 2, dtype=torch.float64), DTypeMismatchError)):
        target = {"a": torch.zeros(4), "b": {"c": bad.clone()}}
        with pytest.raises(error, match="'b.c'"):
            resurgo.load(target, path, strict=False)
        assert torch.equal(target["a"], torch.zeros(4))  # nothing was loaded
        report = resurgo.load(target, path, strict=False, ignore_mismatched=True)
        assert report.mismatched_keys == ["b.c"] and report.unexpected_keys == ["step"]
        assert torch.equal(target["a"], torch.arange(4.0)) and bits_equal(target["b"]["c"], bad)


class Refuses:
    """A Stateful that refuses what it is given back, as a data loader refuses a position past its end."""

    def state_dict(self):
        return {"pos": 7}

    def load_state_dict(self, sd):
        raise DataPositionError(f"position {sd['pos']} is past the end of a dataset of 5")


def test_every_load_error_names_the_checkpoint_and_the_key(tmp_path):
    path = saved(tmp_path, {"a": torch.arange(4.0), "b": {"c": torch.ones(2, 2)}, "r": resurgo.PerRank(3),
                            "loader": Refuses()})
    here = {"a": torch.zeros(4), "b": {"c": torch.zeros(2, 2)}, "r": resurgo.PerRank(0), "loader": Refuses()}
    cases = [
        (ShapeMismatchError, "'a'", {**here, "a": torch.zeros(5)}),
        (DTypeMismatchError, "'b.c'", {**here, "b": {"c": torch.zeros(2, 2, dtype=torch.int32)}}),
        (TypeMismatchError, "'b'", {**here, "b": torch.zeros(2)}),
        (TypeMismatchError, "'a'", {**here, "a": {"x": 1}}),
        (KeyMismatchError, "'extra'", {**here, "extra": 1}),
        (DataPositionError, "'loader'", here),
    ]
    for error, key, target in cases:
        with pytest.raises(error) as ei:
            resurgo.load(target, path)
        assert str(ei.value).startswith(f"{path}: ") and key in str(ei.value), (error, str(ei.value))
    assert "position 7 is past the end" in str(ei.value)

    # Saved by two ranks (the per-rank node holds two items), loaded by one.
    m = json.loads((path / "manifest.json").read_text())
    r = next(v for k, v in m["tree"]["items"] if k == "r")
    r["items"] = r["items"] * 2
    m["world"]["size"] = 2
    (path / "manifest.json").write_bytes(sealed_manifest(m))
    with pytest.raises(WorldSizeMismatchError) as ei:
        resurgo.load({**here, "loader": None}, path)
    assert str(ei.value).startswith(f"{path}: key 'r': saved per rank by 2 ranks, loaded by 1")


class Foreign(Refuses):
    def load_state_dict(self, sd):
        raise ValueError("loaded state dict has a different number of parameter groups")


@pytest.mark.skipif(not hasattr(Exception, "add_note"), reason="exception notes are Python 3.11+")
def test_another_librarys_error_while_loading_keeps_its_type_and_gains_a_note(tmp_path):
    path = saved(tmp_path, {"opt": Foreign()})
    with pytest.raises(ValueError, match="different number of parameter groups") as ei:
        resurgo.load({"opt": Foreign()}, path)
    assert not isinstance(ei.value, ResurgoError)
    assert ei.value.__notes__ == [f"while loading key 'opt' of the checkpoint {path}"]


def test_type_mismatch(tmp_path):
    path = saved(tmp_path)
    with pytest.raises(TypeMismatchError, match="'b'"):
        resurgo.load({"a": torch.zeros(4), "b": torch.zeros(2), "step": 0}, path)
    with pytest.raises(TypeMismatchError, match="'step'"):
        resurgo.load({"a": torch.zeros(4), "b": {"c": torch.zeros(2, 2)}, "step": torch.zeros(1)}, path)


class Opaque:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.x == self.x


def test_pickle_is_opt_in_on_both_sides(tmp_path):
    state = {"obj": Opaque(5), "t": torch.ones(1)}
    with pytest.raises(UnsupportedValueError, match="allow_pickle=True") as ei:
        resurgo.save(state, tmp_path / "c")
    assert "'obj'" in str(ei.value) and "Opaque" in str(ei.value)
    assert not (tmp_path / "c").exists()
    resurgo.save(state, tmp_path / "c", allow_pickle=True)
    with pytest.raises(PickleNotAllowedError):
        resurgo.load_dict(tmp_path / "c")
    with pytest.raises(PickleNotAllowedError):
        resurgo.load({"obj": None, "t": torch.zeros(1)}, tmp_path / "c")
    assert resurgo.load_dict(tmp_path / "c", allow_pickle=True)["obj"] == Opaque(5)


def test_loading_never_runs_code_from_the_file(tmp_path):
    """A pickle node smuggled into a manifest (with the flag saying no pickle) is refused, not run."""
    import base64
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = saved(tmp_path, {"x": 1})
    m = json.loads((path / "manifest.json").read_text())
    m["tree"]["items"][0][1] = {"type": "pickle", "class": "x", "base64": base64.b64encode(pickle.dumps(Evil())).decode()}
    (path / "manifest.json").write_bytes(sealed_manifest(m))
    # The manifest's 'pickled' flag says false: the manifest is inconsistent.
    with pytest.raises(ManifestError, match="pickle"):
        resurgo.load_dict(path)
    with pytest.raises(ManifestError, match="pickle"):
        resurgo.load({"x": 0}, path)
    m["pickled"] = True
    (path / "manifest.json").write_bytes(sealed_manifest(m))
    with pytest.raises(PickleNotAllowedError):
        resurgo.load_dict(path)
    with pytest.raises(PickleNotAllowedError):
        resurgo.load({"x": 0}, path)
    assert not marker.exists()


def test_unsupported_values_are_named(tmp_path):
    cases = {
        "sparse": torch.eye(3).to_sparse(),
        "func": len,
        "set": {1, 2},
        "objarr": np.array([object()], dtype=object),
        "tuple_key": {(1, 2): 3},
        "quantized": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
        "meta": torch.empty(2, device="meta"),
    }
    for name, value in cases.items():
        with pytest.raises(UnsupportedValueError) as ei:
            resurgo.save({name: value}, tmp_path / name)
        assert repr(name) in str(ei.value), name
        assert not (tmp_path / name).exists()
    cyc: dict = {}
    cyc["self"] = cyc
    with pytest.raises(UnsupportedValueError, match="cycle"):
        resurgo.save(cyc, tmp_path / "cyc")


def test_every_error_is_a_resurgo_error():
    import resurgo.errors as E

    classes = [v for v in vars(E).values() if isinstance(v, type) and issubclass(v, Exception)
               and not issubclass(v, Warning)]
    assert len(classes) >= 14
    assert all(issubclass(c, ResurgoError) for c in classes)
    assert issubclass(E.ResurgoWarning, UserWarning) and not issubclass(E.ResurgoWarning, ResurgoError)


def test_huge_ints_are_refused_or_pickled(tmp_path):
    with pytest.raises(UnsupportedValueError, match="'huge'"):
        resurgo.save({"huge": 10**5000}, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    resurgo.save({"huge": 10**5000, "fine": 2**8000}, tmp_path / "c", allow_pickle=True)
    out = resurgo.load_dict(tmp_path / "c", allow_pickle=True)
    assert out == {"huge": 10**5000, "fine": 2**8000}


def test_metadata_must_be_plain_shallow_json(tmp_path):
    deep: list = []
    for _ in range(100):
        deep = [deep]
    for bad in ({"t": torch.ones(1)}, {"f": float("nan")}, {1: "int key"}, {"deep": deep}):
        with pytest.raises(UnsupportedValueError, match="metadata"):
            resurgo.save({}, tmp_path / "c", metadata=bad)
    assert not (tmp_path / "c").exists()


def test_manifest_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    path = saved(tmp_path)
    outside = tmp_path / "elsewhere.json"
    (path / "manifest.json").rename(outside)
    (path / "manifest.json").symlink_to(outside)
    with pytest.raises(resurgo.CorruptCheckpointError, match="leaves the checkpoint"):
        resurgo.load_dict(path)


def test_every_error_is_exported_documented_and_has_an_exit_code():
    """Each class of resurgo.errors is a name of the package (in __all__), is listed in docs/api.md's
    Errors section, and ends a command with a documented exit code (never a traceback)."""
    from pathlib import Path

    import resurgo.errors as E
    from resurgo.cli.app import EXIT_USAGE, exit_code_of

    classes = {n: v for n, v in vars(E).items() if isinstance(v, type) and issubclass(v, Exception)}
    errors_section = (Path(__file__).parent.parent / "docs" / "api.md").read_text().split("## Errors", 1)[1]
    for name, cls in classes.items():
        assert name in resurgo.__all__ and getattr(resurgo, name) is cls, name
        assert f"`{name}`" in errors_section, name
        if not issubclass(cls, Warning):  # a warning ends no command
            assert exit_code_of(cls("x")) in (2, 3, 4), name
    assert exit_code_of(resurgo.ExpansionError("x")) == EXIT_USAGE


def test_storage_error_names_the_place_what_failed_the_reason_and_the_errno():
    from resurgo.errors import StorageError, storage_error

    err = storage_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "/ck/data/a.safetensors",
                        "write failed after 4096 bytes", "free some space and save again")
    assert type(err) is StorageError and err.errno == errno.ENOSPC
    assert str(err) == (f"[Errno {errno.ENOSPC}] /ck/data/a.safetensors: write failed after 4096 bytes: "
                        f"{os.strerror(errno.ENOSPC)}; free some space and save again")
    bare = storage_error(OSError("the link changed"), "/src/m.pt", "could not be resolved")
    assert bare.errno is None and str(bare) == "/src/m.pt: could not be resolved: the link changed"


def test_storage_errors_turns_only_a_foreign_oserror_into_a_storage_error():
    from resurgo.errors import CheckpointExistsError, StorageError, storage_errors

    with pytest.raises(StorageError) as caught:
        with storage_errors("/ck", "commit failed", "save again"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    assert caught.value.errno == errno.EIO and caught.value.__cause__ is None
    assert str(caught.value) == f"[Errno {errno.EIO}] /ck: commit failed: {os.strerror(errno.EIO)}; save again"
    mine = CheckpointExistsError("/ck: appeared while saving")
    with pytest.raises(CheckpointExistsError) as kept:
        with storage_errors("/ck", "commit failed"):
            raise mine
    assert kept.value is mine
    with pytest.raises(FileNotFoundError) as missing:
        with storage_errors("/ck", "cannot list it", passing=FileNotFoundError):
            raise FileNotFoundError(errno.ENOENT, "gone")
    assert type(missing.value) is FileNotFoundError
    with pytest.raises(ValueError):
        with storage_errors("/ck", "commit failed"):
            raise ValueError("not an OSError")


def test_every_oserror_becomes_a_storage_error_through_the_one_helper():
    """No handler of an OSError in src/ builds a StorageError by hand: each calls storage_error,
    so that every such message names the place, what failed and the system's reason alike."""
    import ast
    from pathlib import Path

    by_hand = []
    for path in sorted((Path(__file__).parents[1] / "src" / "resurgo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None and "OSError" in ast.unparse(node.type):
                by_hand += [f"{path.name}:{call.lineno}" for stmt in node.body for call in ast.walk(stmt)
                            if isinstance(call, ast.Call) and ast.unparse(call.func) == "StorageError"]
    assert by_hand == []
