"""The package ships py.typed: its annotations must type-check."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.typecheck  # a minute of mypy: make test runs it after the default suite

ROOT = Path(__file__).resolve().parents[1]


def test_package_type_checks_with_mypy(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success" in proc.stdout
    assert (ROOT / "src" / "resurgo" / "py.typed").exists()
