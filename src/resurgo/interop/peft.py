"""A spec from a PEFT adapter folder, as ``PeftModel.save_pretrained`` writes it: ``adapter_config.json``
and ``adapter_model.safetensors`` at the top (the adapter ``default``), and each other adapter in a
folder of its name holding the same two files.

The checkpoint holds them as a model saved adapter-only does (:mod:`resurgo.format.adapter`), under
``model``: ``resurgo.load({"model": AdapterOnly(peft_model)}, dst)`` loads them, and so does a
``TrainState(model=AdapterOnly(peft_model), rng=False)``. The base model's digest is the one
``resurgo convert --to peft`` leaves in the weights' metadata, else None (nothing to check on load).
Only the safetensors headers and the configs are read here; the tensors are pieces at their offsets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from resurgo.errors import CheckpointNotFoundError, CorruptCheckpointError, NotACheckpointError
from resurgo.format import adapter as fmt
from resurgo.format.safetensors_file import read_header
from resurgo.interop.hf import _safetensors_tensors, _shard_path
from resurgo.interop.source_files import open_file_inside
from resurgo.interop.spec import ImportSpec

MODEL_KEY = "model"
MAX_CONFIG_BYTES = 1 << 24  # an adapter_config.json is a few KiB
_DIGEST = re.compile(rf"{re.escape(fmt.DIGEST_ALGORITHM)}:[0-9a-f]{{32}}")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9_\-]+")


def spec_from_peft(directory: str | Path) -> ImportSpec:
    root = Path(directory)
    if not root.exists():
        raise CheckpointNotFoundError(f"{root}: not found")
    if not (root / fmt.PEFT_CONFIG_FILE).is_file():
        raise NotACheckpointError(f"{root}: not a PEFT adapter folder (expected {fmt.PEFT_CONFIG_FILE} and "
                                  f"{fmt.PEFT_WEIGHTS_FILE}, as PeftModel.save_pretrained writes them)")
    folders = {fmt.DEFAULT_ADAPTER: ""}
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.is_symlink() and (sub / fmt.PEFT_CONFIG_FILE).is_file() \
                and _ADAPTER_NAME.fullmatch(sub.name) and sub.name != fmt.DEFAULT_ADAPTER:
            folders[sub.name] = f"{sub.name}/"
    tensors = []
    configs: dict[str, dict[str, str]] = {}
    digests = set()
    for name, folder in folders.items():
        weights = folder + fmt.PEFT_WEIGHTS_FILE
        if not (root / weights).is_file():
            what = (f"{fmt.PEFT_TORCH_WEIGHTS_FILE} (a pickle): load it with PeftModel.from_pretrained and save it "
                    "with safe_serialization=True" if (root / folder / fmt.PEFT_TORCH_WEIGHTS_FILE).is_file()
                    else "no weights")
            raise NotACheckpointError(f"{root / weights}: not found; adapter {name!r} has {what}")
        configs[name] = {fmt.CONFIG_KEY: _config_text(root, folder + fmt.PEFT_CONFIG_FILE)}
        digests.add(_digest_of(root, weights))
        for t in _safetensors_tensors(root, weights):
            path = [MODEL_KEY, fmt.ADAPTERS_KEY, name, fmt.WEIGHTS_KEY, t.key]
            tensors.append(t.model_copy(update={"key": ".".join(path), "path": path}))
    if len(digests) != 1:
        raise CorruptCheckpointError(f"{root}: its adapters name different base models ({sorted(map(str, digests))}): "
                                     "import each folder apart")
    value = {fmt.FORMAT_KEY: fmt.FORMAT, fmt.DIGEST_KEY: digests.pop(), fmt.ADAPTERS_KEY: configs}
    return ImportSpec(tensors=tensors, values={MODEL_KEY: value})


def _config_text(root: Path, rel: str) -> str:
    """The config file's text, checked to be a JSON object (kept as written)."""
    path = _shard_path(root, rel)
    with open_file_inside(path) as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise CorruptCheckpointError(f"{root / rel}: larger than {MAX_CONFIG_BYTES} bytes; not an adapter config")
    try:
        text = data.decode()
        if not isinstance(json.loads(text), dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise CorruptCheckpointError(f"{root / rel}: not a valid adapter config ({e})") from None
    return text


def _digest_of(root: Path, rel: str) -> str | None:
    """The base model's digest a conversion left in the weights' metadata, if well formed."""
    with open_file_inside(_shard_path(root, rel)) as f:
        try:
            header = read_header(f.read(8), f.read)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{root / rel}: not a valid safetensors file ({e})") from None
    metadata = header.raw.get("__metadata__")
    digest = metadata.get(fmt.DIGEST_METADATA) if isinstance(metadata, dict) else None
    return digest if isinstance(digest, str) and _DIGEST.fullmatch(digest) else None
