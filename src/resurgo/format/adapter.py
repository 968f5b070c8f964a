"""The tree of a model saved adapter-only: PEFT adapters without the frozen base model they adapt.

Under the model's key (``model`` in a TrainState or a ResurgoTrainer checkpoint)::

    adapter_format     "resurgo.peft-adapter/1"  (marks the subtree; conversion finds it by it)
    base_model_digest  "xxh3-128:<32 hex>": the content digest of the base model's tensors, or None
    adapters.<name>.config   the adapter's adapter_config.json, as PEFT writes it (a str)
    adapters.<name>.weights  {name in adapter_model.safetensors: tensor}

:func:`find_adapters` locates such subtrees in a manifest's tree, for ``convert --to peft``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resurgo.format import values
from resurgo.format.tree import iter_leaves, path_key

FORMAT_KEY = "adapter_format"
FORMAT = "resurgo.peft-adapter/1"
DIGEST_KEY = "base_model_digest"
ADAPTERS_KEY = "adapters"
CONFIG_KEY = "config"
WEIGHTS_KEY = "weights"
DIGEST_ALGORITHM = "xxh3-128"
# PEFT's file names, in the folder of each adapter (the one named "default" at the top, others in
# a subfolder of their name, as PeftModel.save_pretrained writes them).
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_TORCH_WEIGHTS_FILE = "adapter_model.bin"
PEFT_CONFIG_FILE = "adapter_config.json"
DEFAULT_ADAPTER = "default"
# The safetensors metadata key under which a converted adapter keeps its base model's digest.
DIGEST_METADATA = "resurgo.base_model_digest"


@dataclass
class SavedAdapter:
    """One adapter of a subtree: its config text and {its name in the PEFT file: the manifest's tensor key}."""

    name: str
    config: str | None = None
    tensors: dict[str, str] = field(default_factory=dict)


@dataclass
class SavedAdapters:
    """A subtree of adapters: where it is (its key prefix, ``""`` at the root), the base's digest, its adapters."""

    prefix: str
    base_model_digest: str | None
    adapters: dict[str, SavedAdapter]


def find_adapters(tree: dict) -> list[SavedAdapters]:
    """Every adapter subtree of a validated manifest ``tree``, in tree order."""
    leaves = list(iter_leaves(tree))
    roots = [leaf.path[:-1] for leaf in leaves
             if leaf.path and leaf.path[-1] == FORMAT_KEY and leaf.node == {"type": "str", "value": FORMAT}]
    found = []
    for root in roots:
        n = len(root)
        digest: str | None = None
        adapters: dict[str, SavedAdapter] = {}
        for leaf in leaves:
            path = leaf.path
            if path[:n] != root or len(path) <= n:
                continue
            rest = path[n:]
            if rest == (DIGEST_KEY,) and leaf.node["type"] == "str":
                digest = values.decode_scalar(leaf.node, path_key(path), allow_pickle=False)
            elif len(rest) >= 3 and rest[0] == ADAPTERS_KEY and isinstance(rest[1], str):
                adapter = adapters.setdefault(rest[1], SavedAdapter(rest[1]))
                if rest[2:] == (CONFIG_KEY,) and leaf.node["type"] == "str":
                    adapter.config = values.decode_scalar(leaf.node, path_key(path), allow_pickle=False)
                elif len(rest) == 4 and rest[2] == WEIGHTS_KEY and leaf.is_tensor:
                    adapter.tensors[str(rest[3])] = leaf.node["key"]
        found.append(SavedAdapters(path_key(root), digest, adapters))
    return found
