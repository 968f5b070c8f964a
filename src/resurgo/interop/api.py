"""``resurgo.import_checkpoint``: a foreign checkpoint as an ordinary resurgo checkpoint.

The importer of ``source`` emits a spec (:mod:`resurgo.interop.spec`), or the caller gives one;
:func:`resurgo.interop.execute.execute` writes it.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from resurgo.conversion import parse_size
from resurgo.errors import ImportSpecError, KeyMismatchError, UnsupportedValueError
from resurgo.interop import source_files
from resurgo.interop import spec as spec_lang
from resurgo.interop.dcp import spec_from_dcp
from resurgo.interop.deepspeed import spec_from_deepspeed
from resurgo.interop.execute import execute
from resurgo.interop.hf import spec_from_hf
from resurgo.interop.megatron import spec_from_megatron
from resurgo.interop.peft import spec_from_peft
from resurgo.interop.spec import ImportSpec
from resurgo.interop.torch_file import spec_from_torch_file
from resurgo.interop.unpickle import shown
from resurgo.renamed import renamed_keywords
from resurgo.reports import ImportReport

SOURCES = ("dcp", "deepspeed", "megatron", "hf", "peft", "torch", "spec")


# The importers that consolidate tensor-parallel shards, and so can drop the vocabulary padding.
VOCAB_SOURCES = ("megatron", "deepspeed")


def spec_of(src: str | os.PathLike, source: str, vocab_size: int | None = None) -> tuple[ImportSpec, Path]:
    """(the spec an importer emits for ``src``, validated as a user's spec is; the directory its
    file names are relative to). ``vocab_size``: the true vocabulary size, for the importers of
    :data:`VOCAB_SOURCES` (the padding rows of the word embeddings and output layer are dropped)."""
    path = Path(src)
    if vocab_size is not None and (source not in VOCAB_SOURCES or isinstance(vocab_size, bool)
                                   or not isinstance(vocab_size, int) or vocab_size < 1):
        raise UnsupportedValueError(f"vocab_size={vocab_size!r}: a positive vocabulary size, for the importers that "
                                    f"consolidate tensor-parallel shards ({', '.join(VOCAB_SOURCES)}), not {source!r}")
    if source == "spec":
        raise ImportSpecError(f"{src}: source='spec' needs spec= (an ImportSpec, or the path of a spec JSON file)")
    if source not in SOURCES:
        raise UnsupportedValueError(f"source must be one of {', '.join(map(repr, SOURCES))}, not {source!r}")
    emit = {"dcp": spec_from_dcp, "deepspeed": lambda p: spec_from_deepspeed(p, vocab_size=vocab_size),
            "hf": spec_from_hf, "peft": spec_from_peft,
            "megatron": lambda p: spec_from_megatron(p, vocab_size=vocab_size)}.get(source)
    try:
        if emit is not None:
            spec, root = emit(path), path
        else:  # torch: the file the caller names is trusted as named; its folder is the root
            real = source_files.real_root(path)
            spec, root = spec_from_torch_file(real), real.parent
    except ValidationError as e:  # a field of the foreign file of a type the spec does not take
        first = e.errors()[0]
        at = ".".join(str(x) for x in first["loc"])
        raise ImportSpecError(f"{src}: the {source} importer found a value it cannot describe: {at}: "
                              f"{first['msg']} (input {shown(first.get('input'))})") from None
    spec_lang.validate(spec, f"{src} ({source})")
    return spec, root


def load_spec(spec: ImportSpec | str | os.PathLike) -> ImportSpec:
    """An ImportSpec as given, validated, or read from a JSON file."""
    if isinstance(spec, ImportSpec):
        spec_lang.validate(spec)
        return spec
    path = Path(spec)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ImportSpecError(f"{path}: spec file not found") from None
    return spec_lang.loads(text, str(path))


def _selected(key: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(key, pattern) or key.startswith(pattern + ".")


def select(spec: ImportSpec, only: str | Sequence[str]) -> ImportSpec:
    """The part of ``spec`` whose keys match a pattern of ``only``: a glob (``*``, ``?``,
    ``[...]``, matched against the whole key, ``*`` crossing dots) or a key prefix ending at a dot
    (``model`` selects ``model.fc.weight``). KeyMismatchError names a pattern that matches nothing."""
    patterns = [only] if isinstance(only, str) else list(only)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise UnsupportedValueError(f"only must be a non-empty pattern or list of non-empty patterns, not {only!r}")
    keys = [t.key for t in spec.tensors] + list(spec.values) + list(spec.objects)
    unmatched = [p for p in patterns if not any(_selected(k, p) for k in keys)]
    if unmatched:
        shown = ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else "")
        raise KeyMismatchError(
            f"only: pattern(s) {', '.join(map(repr, unmatched))} match no key of the source "
            f"(it has {len(keys)} keys: {shown}); use a glob such as 'model.*' or a key prefix such as 'model'",
            missing=unmatched)

    def keep(key: str) -> bool:
        return any(_selected(key, p) for p in patterns)

    return spec.model_copy(update={"tensors": [t for t in spec.tensors if keep(t.key)],
                                   "values": {k: v for k, v in spec.values.items() if keep(k)},
                                   "objects": {k: v for k, v in spec.objects.items() if keep(k)}})


@renamed_keywords("resurgo.import_checkpoint", memory_budget="buffer_bytes")
def import_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, source: str,
                      spec: ImportSpec | str | os.PathLike | None = None, buffer_bytes: int | str | None = None,
                      allow_pickle: bool = False, storage_options: dict | None = None,
                      only: str | Sequence[str] | None = None, allow_expansion: bool = False,
                      in_place: bool = False, vocab_size: int | None = None) -> ImportReport:
    """Import the foreign checkpoint at ``src`` as a resurgo checkpoint at ``dst``; returns an
    :class:`ImportReport`.

    ``source``: ``"dcp"`` (a torch.distributed.checkpoint directory), ``"deepspeed"`` (a
    DeepSpeed ZeRO 1/2/3 checkpoint directory: the one holding ``latest``, or a tag folder; with tensor or
    pipeline parallelism, its weights), ``"megatron"`` (a Megatron ``torch_dist`` or legacy-layout checkpoint
    directory, consolidated to one rank), ``"hf"`` (a Hugging Face
    model directory), ``"peft"`` (a PEFT adapter folder, as ``PeftModel.save_pretrained`` writes it;
    the adapters go under ``model``, as a model saved adapter-only holds them), ``"torch"`` (a torch.save file) or ``"spec"`` (``src`` is the directory the
    spec's file names are relative to; ``spec`` is an ImportSpec or a spec JSON file). With an
    importer's source, a ``spec`` replaces the one the importer would emit. ``buffer_bytes`` (bytes or ``"2GB"``, default 1 GiB; old name
    ``memory_budget``, deprecated) bounds the buffers; source bytes are read in large slices as they are written. ``dst`` appears only
    when complete and is never replaced (CheckpointExistsError). Nothing is unpickled beyond
    tensor locations and plain values; the spec's pickled ``objects`` (DCP items that are not
    plain values) raise PickleNotAllowedError unless ``allow_pickle=True``, which unpickles them
    fully (only for a trusted source). ``storage_options`` go to fsspec for a URL ``dst``.
    ``only``: a pattern or list of patterns (:func:`select`); only the tensors and values whose
    keys match are read and written. ``allow_expansion``: write tensors that take more than
    ``MAX_EXPANSION`` (4) times the bytes of the source files they are read from (a stride-0 tensor
    such as ``torch.ones(1).expand(n)``); refused with ExpansionError otherwise. ``in_place``: copy no
    tensor bytes that lie contiguous in the source files: the checkpoint's chunks point into them
    (format version 5; the source must then stay where it is, unchanged), and the report's
    ``copied`` names the tensors copied after all, and why (:mod:`resurgo.interop.inplace`).
    ``vocab_size``: the true vocabulary size of a ``"megatron"`` or ``"deepspeed"`` (tensor-parallel)
    source whose ``args`` lack it: the padding rows of the word embeddings and output layer are dropped.
    """
    t0 = time.perf_counter()
    budget = None if buffer_bytes is None else parse_size(buffer_bytes, "buffer_bytes")
    if spec is not None:
        chosen = load_spec(spec)
        root = Path(src) if source != "torch" else source_files.real_root(src).parent
        if source not in SOURCES:
            spec_of(src, source)  # the same refusal
        if vocab_size is not None:
            raise UnsupportedValueError(f"vocab_size={vocab_size!r} with spec=: the vocabulary size shapes the spec "
                                        "an importer emits; a spec given is imported as it is (trim it there)")
    else:
        chosen, root = spec_of(src, source, vocab_size)
    if only is not None:
        chosen = select(chosen, only)
    t_spec = time.perf_counter() - t0
    report = execute(chosen, root, dst, source=source, buffer_bytes=budget, storage_options=storage_options,
                     allow_pickle=allow_pickle, allow_expansion=allow_expansion, in_place=in_place)
    report.seconds = {"spec": t_spec, **report.seconds, "total": time.perf_counter() - t0}
    report.src = str(src)
    return report
