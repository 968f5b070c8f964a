"""Every Python snippet in README.md and every page under docs/ runs, so the documentation cannot drift from the code.

The contexts a snippet runs in are described in tests/doc_snippets.py. A snippet that implies a
resume (context ``kill-resume``) is killed with SIGKILL mid-training and resumed, and must end
bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from doc_snippets import (ACCELERATE_PRELUDE, CONTEXTS, DOCS, ROOT, DISTRIBUTED_EPILOGUE, DISTRIBUTED_PRELUDE,
                          KILL_RESUME_EPILOGUE, LIGHTNING_PRELUDE, S3_SUBSTITUTIONS, TRAINING_PRELUDE,
                          TORCHTITAN_EPILOGUE, TRANSFORMERS_PRELUDE, Snippet, doc_files, snippets)

ALL = snippets()
KILL_AT = 250  # train_step calls: after the checkpoints of steps 100 and 200 were started


def by_context(context: str) -> list:
    return [pytest.param(s, id=s.name) for s in ALL if s.context == context]


def test_every_snippet_names_its_context():
    unmarked = [s.name for s in ALL if s.context not in CONTEXTS]
    assert not unmarked, f"python blocks without a known '<!-- doc-test: ... -->' marker: {unmarked}"
    assert len(ALL) >= 10  # the extraction finds the blocks (README 2, the guide's pages 12, format 1)


def test_snippets_are_looked_for_in_the_readme_and_every_page_at_any_depth(tmp_path):
    (tmp_path / "docs" / "deep" / "er").mkdir(parents=True)
    for rel in ("README.md", "docs/a.md", "docs/deep/er/b.md", "docs/notes.txt"):
        (tmp_path / rel).write_text("<!-- doc-test: standalone -->\n```python\nx = 1\n```\n")
    found = doc_files(tmp_path)
    assert [str(f.relative_to(tmp_path)) for f in found] == ["README.md", "docs/a.md", "docs/deep/er/b.md"]
    assert [(s.file, s.context, s.code) for s in snippets(found)] == [(f, "standalone", "x = 1\n") for f in found]
    # the real list: every page the site is built from, and the README
    assert set(DOCS) == {ROOT / "README.md", *(ROOT / "docs").rglob("*.md")}
    assert {s.file.name for s in ALL} >= {"README.md", "getting-started.md", "exact-resume.md", "async.md",
                                         "manager.md", "incremental.md", "distributed.md", "storage.md"}


def test_step_names_in_the_docs_are_the_ones_the_manager_and_gc_read():
    """A checkpoint named step_{n:08d} is listed by `resurgo ls` but is no step to `gc` or the
    manager: every step name a snippet writes has the padding theirs has."""
    import re

    from resurgo.manager.catalog import STEP_DIGITS

    widths = {(s.name, w) for s in ALL for w in re.findall(r"step_\{[^}:]*:0(\d+)d\}", s.code)}
    assert widths, "no snippet names a checkpoint step_{...}"
    assert {w for _, w in widths} == {str(STEP_DIGITS)}, sorted(widths)


def test_extraction_reads_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- doc-test: training -->\n```python\na = 1\n```\n```python\nb = 2\n```\n")
    found = snippets([doc])
    assert [(s.line, s.context, s.code) for s in found] == [(3, "training", "a = 1\n"), (6, None, "b = 2\n")]


def _run_script(source: str, cwd: Path, env_extra: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    script = cwd / "snippet.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _exec_here(source: str, name: str, cwd: Path, monkeypatch) -> None:
    monkeypatch.chdir(cwd)
    namespace: dict = {"__name__": "__doc_snippet__"}
    exec(compile(source, name, "exec"), namespace)


@pytest.mark.parametrize("snippet", by_context("standalone"))
def test_standalone_snippet_runs(snippet: Snippet, tmp_path, monkeypatch):
    _exec_here(snippet.code, snippet.name, tmp_path, monkeypatch)


@pytest.mark.parametrize("snippet", by_context("training"))
def test_training_snippet_runs(snippet: Snippet, tmp_path, monkeypatch):
    _exec_here(TRAINING_PRELUDE + snippet.code, snippet.name, tmp_path, monkeypatch)


@pytest.mark.parametrize("snippet", by_context("lightning"))
def test_lightning_snippet_runs(snippet: Snippet, tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    _exec_here(LIGHTNING_PRELUDE + snippet.code, snippet.name, tmp_path, monkeypatch)


@pytest.mark.parametrize("snippet", by_context("transformers"))
def test_transformers_snippet_runs(snippet: Snippet, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    _exec_here(TRANSFORMERS_PRELUDE + snippet.code, snippet.name, tmp_path, monkeypatch)


@pytest.mark.parametrize("snippet", by_context("accelerate"))
def test_accelerate_snippet_runs(snippet: Snippet, tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    pytest.importorskip("torchdata")
    _exec_here(ACCELERATE_PRELUDE + snippet.code, snippet.name, tmp_path, monkeypatch)


@pytest.mark.torchtitan
@pytest.mark.parametrize("snippet", by_context("torchtitan"))
def test_torchtitan_snippet_runs(snippet: Snippet, tmp_path, monkeypatch):
    _exec_here(snippet.code + TORCHTITAN_EPILOGUE, snippet.name, tmp_path, monkeypatch)


@pytest.mark.parametrize("snippet", by_context("s3"))
def test_s3_snippet_runs(snippet: Snippet, tmp_path, monkeypatch, seaweed):
    import uuid

    import s3fs

    bucket = f"doc-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(**seaweed.storage_options).mkdir(bucket)
    code = snippet.code
    for old, new in S3_SUBSTITUTIONS:
        code = code.replace(old, new.format(bucket=bucket, tmp=tmp_path))
    assert f"s3://{bucket}/" in code  # the snippet's URLs lead to the test server's fresh bucket
    prelude = TRAINING_PRELUDE + f"opts = {dict(seaweed.storage_options)!r}\n"
    _exec_here(prelude + code, snippet.name, tmp_path, monkeypatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("snippet", by_context("distributed"))
def test_distributed_snippet_runs(snippet: Snippet, tmp_path):
    source = TRAINING_PRELUDE + DISTRIBUTED_PRELUDE + snippet.code + DISTRIBUTED_EPILOGUE
    proc = _run_script(source, tmp_path, {"DOC_TEST_PORT": str(_free_port())})
    assert proc.returncode == 0, f"{snippet.name} failed:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("snippet", by_context("kill-resume"))
def test_snippet_resumes_exactly_after_sigkill(snippet: Snippet, tmp_path):
    source = TRAINING_PRELUDE + snippet.code + KILL_RESUME_EPILOGUE
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    ref_dir.mkdir()
    run_dir.mkdir()

    ref = _run_script(source, ref_dir, {"DOC_TEST_OUT": str(ref_dir / "out.pt")})
    assert ref.returncode == 0, f"{snippet.name}, uninterrupted run failed:\n{ref.stderr[-4000:]}"

    killed = _run_script(source, run_dir, {"DOC_TEST_OUT": str(run_dir / "out.pt"), "DOC_TEST_KILL_AT": str(KILL_AT)})
    assert killed.returncode == -signal.SIGKILL, f"{snippet.name}: expected the kill, got:\n{killed.stderr[-4000:]}"
    assert not (run_dir / "out.pt").exists()

    resumed = _run_script(source, run_dir, {"DOC_TEST_OUT": str(run_dir / "out.pt")})
    assert resumed.returncode == 0, f"{snippet.name}, resumed run failed:\n{resumed.stderr[-4000:]}"

    a = torch.load(ref_dir / "out.pt", weights_only=True)
    b = torch.load(run_dir / "out.pt", weights_only=True)
    assert a["first_step"] == 0
    assert b["first_step"] in (100, 200), f"{snippet.name}: the resumed run did not start from a checkpoint"
    assert a["step"] == b["step"]
    for key, t in a["model"].items():
        assert torch.equal(t, b["model"][key]), f"{snippet.name}: model {key} differs after the resume"
    for p, st in a["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["optimizer"]["state"][p][k]), f"{snippet.name}: optimizer state {p}.{k} differs"
