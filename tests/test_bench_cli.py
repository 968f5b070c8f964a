"""``resurgo bench``: every measurement made, Daly's interval from the medians, nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from resurgo import bench
from resurgo.cli import app
from resurgo.cli.bench import parse_duration
from resurgo.manager.daly import daly_interval
from resurgo.storage.fsspec_store import split_url

runner = CliRunner()


def test_local_bench_measures_everything_and_deletes_its_scratch(tmp_path: Path):
    report = bench.bench_storage(tmp_path, size=1 << 20, tensors=4, repeats=2, mtbf_seconds=3600)
    assert (report.state_bytes, report.tensors, report.repeats) == (1 << 20, 4, 2)
    assert sorted(report.seconds) == sorted(bench.MECHANISMS)
    assert all(len(ts) == 2 and all(t > 0 for t in ts) for ts in report.seconds.values())
    assert report.seconds["async_stall"][1] <= report.seconds["async_durable"][1]
    assert report.gb_per_s["save"] == pytest.approx((1 << 20) / 1e9 / report.medians["save"])
    assert "async_stall" not in report.gb_per_s
    assert report.interval_seconds == {"save": daly_interval(report.medians["save"], 3600),
                                       "async_save": daly_interval(report.medians["async_stall"], 3600)}
    assert list(tmp_path.iterdir()) == []


def test_url_bench_has_no_torch_reference_and_leaves_no_object(mem_url: str):
    report = bench.bench_storage(mem_url, size=1 << 16, tensors=2, repeats=1, reference=True)
    assert sorted(report.seconds) == ["async_durable", "async_stall", "load", "save"]
    fs, root = split_url(mem_url, None)
    assert not fs.exists(root) or fs.find(root) == []


def test_a_failure_midway_still_deletes_the_scratch(tmp_path: Path, monkeypatch):
    def broken_load(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(bench, "load", broken_load)
    with pytest.raises(OSError, match="disk gone"):
        bench.bench_storage(tmp_path, size=1 << 16, tensors=2, repeats=2)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_fail_before_measuring(tmp_path: Path):
    with pytest.raises(ValueError, match="mtbf_seconds"):
        bench.bench_storage(tmp_path, size=1 << 16, mtbf_seconds=0)
    with pytest.raises(ValueError, match="4 bytes a tensor"):
        bench.bench_storage(tmp_path, size=8, tensors=4)
    assert list(tmp_path.iterdir()) == []


def test_parse_duration():
    assert [parse_duration(t) for t in ("3600", "90m", "24h", "1.5d", "45s")] == [3600, 5400, 86400, 129600, 45]
    for bad in ("", "h", "-5m", "0", "soon", "inf"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_cli_prints_the_table_the_ratio_and_the_interval(tmp_path: Path):
    result = runner.invoke(app, ["bench", str(tmp_path), "--size", "1MiB", "--tensors", "4", "--repeats", "1",
                                 "--mtbf", "24h"])
    assert result.exit_code == 0, result.output
    for text in ("1.0 MiB in 4 tensors", "resurgo.async_save: stall", "torch.save + fsync (reference)",
                 "x torch.save's time", "With a failure every 1.0 d on average, save every"):
        assert text in result.stdout, (text, result.stdout)
    doc = json.loads(runner.invoke(app, ["bench", str(tmp_path), "--size", "64KiB", "--repeats", "1", "--json",
                                         "--no-reference"]).stdout)
    assert doc["state_bytes"] == 1 << 16 and sorted(doc["medians"]) == ["async_durable", "async_stall", "load", "save"]
    assert doc["interval_seconds"] == {} and doc["mtbf_seconds"] is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [(["--size", "lots"], "--size"), (["--mtbf", "soon"], "--mtbf"),
                                           (["--repeats", "0"], "repeats")])
def test_cli_bad_options_exit_2(tmp_path: Path, args: list[str], message: str):
    result = runner.invoke(app, ["bench", str(tmp_path), *args])
    assert result.exit_code == 2 and message in result.stderr
