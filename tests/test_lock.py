"""requirements/dev.lock, which ``make install`` installs with as constraints, pins every package
that the project's requirements and its dev extra name, at a version inside pyproject's range,
and the torch the Makefile installs. Read from the files alone: no network, no environment."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "dev.lock"
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


class LockFormatError(AssertionError):
    pass


def read_lock(text: str, where: str = "requirements/dev.lock") -> dict[str, Version]:
    """Package (canonical name) -> pinned version; every line but comments must be ``name==version``."""
    pins: dict[str, Version] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.fullmatch(line)
        if m is None:
            raise LockFormatError(f"{where}:{n}: expected name==version, got {line!r}; regenerate it: make lock")
        name = canonicalize_name(m.group(1))
        try:
            version = Version(m.group(2))
        except InvalidVersion:
            raise LockFormatError(f"{where}:{n}: {m.group(2)!r} is not a version; regenerate it: make lock") from None
        if name in pins:
            raise LockFormatError(f"{where}:{n}: {name} is pinned twice")
        if version.local is not None:  # 2.13.0+cpu would refuse a CUDA build of the same release
            raise LockFormatError(f"{where}:{n}: {name}=={version} has a local label; pin {version.public}")
        pins[name] = version
    return pins


def lock_problems(project: dict, pins: dict[str, Version]) -> list[str]:
    """What is wrong between pyproject's ``[project]`` table and a lock: each requirement of the
    package or of its dev extra that the lock does not pin, or pins outside its range."""
    problems = []
    for text in project.get("dependencies", []) + project.get("optional-dependencies", {}).get("dev", []):
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": "dev"}):
            continue  # not for this Python or platform
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{text}: not pinned in requirements/dev.lock; regenerate it: make lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{text}: requirements/dev.lock pins {name}=={pins[name]}, outside the range; "
                            "regenerate it: make lock")
    return problems


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_lock_pins_every_requirement_of_the_dev_environment_inside_its_range():
    pins = read_lock(LOCK.read_text())
    assert lock_problems(_pyproject(), pins) == []
    # the dev extra's own extras are pinned too: mkdocstrings[python] brings mkdocstrings-python
    assert "mkdocstrings-python" in pins and "resurgo" not in pins
    assert len(pins) > 50  # the whole environment, not only what pyproject names


def test_the_lock_pins_the_torch_the_makefile_installs():
    m = re.search(r"^TORCH := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert m is not None, "Makefile: no 'TORCH := <version>' line"
    assert read_lock(LOCK.read_text())["torch"] == Version(m.group(1))


def test_the_check_names_an_unpinned_package_and_a_pin_outside_its_range():
    project = {"dependencies": ["torch>=2.4", "numpy>=1.24"],
               "optional-dependencies": {"dev": ["peft>=0.21", "mkdocstrings[python]>=0.26",
                                                 "tomli>=2; python_version < '3'"], "docs": ["unlisted>=1"]}}
    pins = read_lock("# a comment\ntorch==2.13.0\nnumpy==1.23.5\nMkDocStrings==1.0.8\n")
    assert lock_problems(project, pins) == [
        "numpy>=1.24: requirements/dev.lock pins numpy==1.23.5, outside the range; regenerate it: make lock",
        "peft>=0.21: not pinned in requirements/dev.lock; regenerate it: make lock",
    ]
    assert lock_problems(project, {**pins, "numpy": Version("2.3.0"), "peft": Version("0.21.2")}) == []


def test_a_lock_line_that_is_no_exact_pin_is_refused_by_line():
    for text, message in [("torch>=2.4\n", r"dev.lock:1: expected name==version, got 'torch>=2.4'"),
                          ("a==1\nb @ file:///x.whl\n", r"dev.lock:2: expected name==version"),
                          ("torch==2.13.0+cpu\n", r"dev.lock:1: torch==2.13.0\+cpu has a local label; pin 2.13.0"),
                          ("Foo_Bar==1\nfoo-bar==2\n", r"dev.lock:2: foo-bar is pinned twice"),
                          ("x==not.a.version\n", r"dev.lock:1: 'not.a.version' is not a version")]:
        with pytest.raises(LockFormatError, match=message):
            read_lock(text)
