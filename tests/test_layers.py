"""The layer rule of DESIGN.md holds: every module imports only from its own package or lower layers.

Each import statement of src/resurgo (at the top of a module or inside a function) is read with
``ast``; an import of a package of the same or a higher layer fails the test, naming the module,
the line and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "resurgo"

# Lowest first. A package or top-level module may import its own package and anything in a lower layer.
LAYERS: list[set[str]] = [
    {"errors", "faults", "gcpause", "version", "reports", "wording"},
    {"layout", "renamed"},  # geometry; renamed keyword arguments (on the errors)
    {"format"},  # manifest, data files, checksums, tree nodes
    {"plan", "dist"},  # pure plans; collectives
    {"state", "storage"},  # flatten/restore the user's state; backends
    {"pipeline"},  # staging, writers, readers, commit sequences
    {"api"},  # the public entry points
    {"conversion", "diff", "manager"},  # built on the public entry points
    {"interop"},  # foreign checkpoints: the save machinery, and conversion's size parsing
    {"integrations"},  # training frameworks (optional extras) on the public entry points
    {"bench", "study", "__init__"},  # programs built on the library; the package's public names
    {"cli"},  # the command line
    {"__main__"},
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
NO_DISTRIBUTED = {"layout", "plan", "format"}  # pure: no torch.distributed
NO_TENSORS = {"storage"}  # storage knows nothing of tensors


def unit_of(path: Path) -> str:
    """The package (``layout``) or top-level module (``api``) a source file belongs to."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(source: str, package: list[str]) -> list[tuple[int, str]]:
    """(line, dotted name) of every module ``source`` imports; ``package`` resolves relative imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return found


def violations(unit: str, source: str, package: list[str]) -> list[str]:
    bad = []
    for line, name in imports(source, package):
        parts = name.split(".")
        if parts[0] == "resurgo" and len(parts) > 1 and parts[1] in LAYER_OF:
            target = parts[1]
            if target != unit and LAYER_OF[target] >= LAYER_OF[unit]:
                bad.append(f"line {line}: imports {name} ({target} is not below {unit})")
        if unit in NO_DISTRIBUTED and name.startswith("torch.distributed"):
            bad.append(f"line {line}: imports {name} ({unit} is pure: no torch.distributed)")
        if unit in NO_TENSORS and parts[0] == "torch":
            bad.append(f"line {line}: imports {name} ({unit} knows nothing of tensors)")
    return bad


MODULES = sorted(SRC.rglob("*.py"))


def test_every_unit_has_a_layer():
    units = {unit_of(p) for p in MODULES}
    assert units - set(LAYER_OF) == set(), "add new packages and modules to LAYERS"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_downward(path: Path):
    package = ["resurgo", *path.relative_to(SRC).parent.parts]
    bad = violations(unit_of(path), path.read_text(), package)
    assert not bad, f"{path.relative_to(SRC)}:\n" + "\n".join(bad)


def test_the_check_sees_upward_relative_lazy_and_forbidden_imports():
    source = ("from resurgo.plan.save_plan import WriteItem\n"
              "def f():\n    from ..storage import local\n    import torch.distributed as dist\n"
              "from . import dtypes\nfrom resurgo.layout.box import ChunkBox\n")
    bad = violations("format", source, ["resurgo", "format"])
    assert [b.split(":")[0] for b in bad] == ["line 1", "line 1", "line 3", "line 3", "line 4"]
    assert violations("storage", "import torch\n", ["resurgo", "storage"]) == [
        "line 1: imports torch (storage knows nothing of tensors)"]


FRAMEWORKS = ("lightning", "lightning_fabric", "pytorch_lightning", "transformers", "accelerate", "torchtitan", "peft")


def test_no_module_outside_integrations_imports_them():
    """The frameworks are optional: nothing of resurgo's own imports an integration (so none of
    them), nor any of the frameworks themselves."""
    bad = []
    for path in MODULES:
        if unit_of(path) == "integrations":
            continue
        package = ["resurgo", *path.relative_to(SRC).parent.parts]
        bad += [f"{path.relative_to(SRC)} line {line}: {name}" for line, name in imports(path.read_text(), package)
                if name.startswith("resurgo.integrations") or name.split(".")[0] in FRAMEWORKS]
    assert bad == []
