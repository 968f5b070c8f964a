"""The manifest: schema (pydantic), JSON encoding, and every check a reader needs before trusting it.

``manifest.json`` is the commit point of a checkpoint. :func:`parse_manifest` turns untrusted bytes
into a :class:`Manifest` or raises :class:`~resurgo.errors.ManifestError`: bad JSON, wrong schema,
unknown version or dtype, paths that leave the checkpoint, byte ranges past a file's end,
shapes whose byte counts disagree, chunks that do not tile their tensor, checksum lists of the
wrong length. Reading data after this check cannot go outside the declared files or allocate
more than the files hold.

The manifest also checks itself: its last member, ``manifest_checksum``, is the xxh3-128 of the
file's own bytes with that digest written as 32 zeros (:func:`seal`), so a flipped digit in a step,
a byte range or the metadata is caught before anything is read (:class:`CorruptCheckpointError`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Sequence
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from resurgo.errors import CorruptCheckpointError, ManifestError
from resurgo.format import checksum, dtypes, strict_json
from resurgo.format.tree import validate_tree
from resurgo.gcpause import collector_paused
from resurgo.layout.box import ChunkBox, FlatRange, Place, covers_exactly_once
from resurgo.layout.grid import Grid

FORMAT_NAME = "resurgo.checkpoint"
FORMAT_VERSION = 2  # what resurgo writes for a self-contained checkpoint
REFERENCING_VERSION = 3  # what it writes for one that references another checkpoint's data files
INDEXED_VERSION = 4  # a distributed save: an O(tensors) core, chunk details in one index per rank
EXTERNAL_VERSION = 5  # an import in place: chunks may lie in foreign files under a declared source root
READABLE_VERSIONS = (2, 3, 4, 5)
UNSEALED_VERSION = 1  # 2 without the manifest's own checksum: refused, nothing proves it unedited
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
MAX_BLOCK_BYTES = 1 << 30
MAX_METADATA_DEPTH = 64  # nested JSON arrays/objects in 'metadata' (readers' parsers have limits)
MAX_TENSOR_BYTES = (1 << 62) - 1  # with every dimension counted as at least 1
DATA_FILE_RE = re.compile(r"^data/[A-Za-z0-9_.-]{1,200}\.safetensors$")
# A data file of another checkpoint of the same root: "<checkpoint>/data/<name>.safetensors".
REFERENCE_RE = re.compile(r"^([A-Za-z0-9_.-]{1,200})/(data/[A-Za-z0-9_.-]{1,200}\.safetensors)$")
# A chunk's bytes in a foreign file under the manifest's external root: "external:<relative path>".
EXTERNAL_PREFIX = "external:"
MAX_EXTERNAL_PATH = 4096
TMP_MARKER = ".resurgo-tmp-"  # in a name: a save in progress, never a checkpoint
_HEX128 = re.compile(r"[0-9a-f]{32}")
SEAL_FIELD = "manifest_checksum"
_SEAL_KEY = b'"manifest_checksum":"'
_SEAL_ZEROS = b"0" * 32
_SEAL_TAIL = len(_SEAL_ZEROS) + len(b'"}')  # the digest and the closing '"}' after it
_JSON_SPACE = b" \t\r\n"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class BoxPlace(_Strict):
    offsets: list[int]
    shape: list[int]


class FlatPlace(_Strict):
    start: int
    stop: int


def place_of(box: Optional[BoxPlace], flat: Optional[FlatPlace]) -> Place:
    """The place a ``box`` or (when it is None) a ``flat`` field describes."""
    if box is not None:
        return ChunkBox(tuple(box.offsets), tuple(box.shape))
    assert flat is not None
    return FlatRange(flat.start, flat.stop)


class Extent(_Strict):
    """A run of a chunk's bytes: ``byte_range`` of ``file`` (this checkpoint's, or a reference)."""

    file: str
    byte_range: Annotated[list[int], Field(min_length=2, max_length=2)]


Span = tuple[str, int, int]  # (file, start, stop): absolute byte offsets in the file


class ChunkEntry(_Strict):
    """One stored piece of a tensor: where it sits in the tensor and where its bytes are.

    Its bytes are either one range of one data file (``file``, ``byte_range``) or, in a checkpoint
    that reuses an earlier one's bytes, the concatenation of ``extents``."""

    box: Optional[BoxPlace] = None
    flat: Optional[FlatPlace] = None
    file: Optional[str] = None
    name: Optional[str] = None  # the chunk's tensor name in the data file; omitted: the tensor's key
    byte_range: Optional[Annotated[list[int], Field(min_length=2, max_length=2)]] = None  # absolute [start, stop)
    extents: Optional[list[Extent]] = None
    block_bytes: int
    checksums: list[str]

    @property
    def place(self) -> Place:
        return place_of(self.box, self.flat)

    @property
    def spans(self) -> list[Span]:
        """Where the chunk's bytes are, in order: one span, or one per extent."""
        if self.extents is None:
            assert self.file is not None and self.byte_range is not None
            return [(self.file, self.byte_range[0], self.byte_range[1])]
        return [(e.file, e.byte_range[0], e.byte_range[1]) for e in self.extents]

    @property
    def nbytes(self) -> int:
        return sum(stop - start for _, start, stop in self.spans)

    def locate(self, start: int, stop: int) -> list[tuple[str, int, int, int]]:
        """Bytes ``[start, stop)`` of the chunk as ``(file, file offset, chunk start, chunk stop)``
        pieces, one per span they cross."""
        return locate(self.spans, start, stop)

    def name_in_file(self, key: str) -> str:
        return key if self.name is None else self.name


def locate(spans: Sequence[Span], start: int, stop: int) -> list[tuple[str, int, int, int]]:
    """Bytes ``[start, stop)`` of the concatenation of ``spans`` as ``(file, file offset, start,
    stop)`` pieces, one per span they cross."""
    out, at = [], 0
    for file, a, b in spans:
        lo, hi = max(start, at), min(stop, at + b - a)
        if lo < hi:
            out.append((file, a + lo - at, lo, hi))
        at += b - a
        if at >= stop:
            break
    return out


class GridEntry(_Strict):
    """A regular layout (version 4, :mod:`resurgo.layout.grid`): ``parts`` per dimension, and the
    rank writing cell ``c`` is ``offset + c . strides``."""

    parts: list[int]
    offset: int
    strides: list[int]

    @property
    def grid(self) -> Grid:
        return Grid(tuple(self.parts), self.offset, tuple(self.strides))


class PieceEntry(_Strict):
    """A listed chunk of a version 4 core manifest: its place and the rank whose index holds it."""

    box: Optional[BoxPlace] = None
    flat: Optional[FlatPlace] = None
    rank: int

    @property
    def place(self) -> Place:
        return place_of(self.box, self.flat)


class TensorEntry(_Strict):
    kind: Literal["torch", "numpy"]
    dtype: str
    shape: list[int]
    # Versions 2 and 3: every chunk. Version 4: the core has ``grid`` or ``pieces`` instead, and
    # ``chunks`` holds the chunks read from the ranks' indexes (those a reader asked for).
    chunks: list[ChunkEntry] = Field(default_factory=list)
    grid: Optional[GridEntry] = None
    pieces: Optional[list[PieceEntry]] = None

    def with_chunks(self, chunks: list[ChunkEntry]) -> "TensorEntry":
        return self.model_copy(update={"chunks": chunks})


class RankFiles(_Strict):
    """Per rank of a version 4 save, by rank: how many data files it wrote, and the size and
    xxh3-128 of its index file."""

    files: list[int]
    index_bytes: list[int]
    index_checksums: list[str]


class FileEntry(_Strict):
    bytes: int  # total size of the data file
    header_bytes: int  # size of the safetensors header, its 8-byte length prefix included
    header_checksum: str  # xxh3-128 of those header bytes


class ExternalFile(_Strict):
    """A foreign file an import in place reads chunks from: only its size is recorded (its bytes
    outside the chunks are never used; the chunks' block checksums cover every byte that is)."""

    bytes: int

    @property
    def header_bytes(self) -> int:  # no header of ours to verify: the data area is the whole file
        return 0

    @property
    def header_checksum(self) -> str:  # of the empty header
        return checksum.digest(b"")


class External(_Strict):
    """Version 5: the foreign files under ``root`` (absolute, canonical) whose bytes chunks name,
    by path relative to it; ``tag``: an HMAC of ``root`` and ``files`` under the key of the user who
    made the import (:mod:`resurgo.storage.external`), absent where none could be made."""

    root: str
    files: dict[str, ExternalFile]
    tag: Optional[str] = None

    def tagged_body(self) -> bytes:
        """The bytes the tag covers: the root and every file with its size, as compact JSON."""
        files = {rel: f.bytes for rel, f in sorted(self.files.items())}
        return json.dumps({"root": self.root, "files": files}, separators=(",", ":"), sort_keys=True).encode()


def external_name(rel: str) -> str:
    """How a chunk names the foreign file ``rel`` (relative to the external root)."""
    return EXTERNAL_PREFIX + rel


def is_external(name: str) -> bool:
    return name.startswith(EXTERNAL_PREFIX)


def canonical_relative(rel: str) -> bool:
    """``rel`` is a relative POSIX path in canonical form: no empty, '.' or '..' component, no
    leading '/', no backslash or NUL, at most MAX_EXTERNAL_PATH characters."""
    parts = rel.split("/")
    return (0 < len(rel) <= MAX_EXTERNAL_PATH and "\\" not in rel and "\0" not in rel
            and all(p not in ("", ".", "..") for p in parts))


def split_reference(name: str) -> tuple[str, str]:
    """``(checkpoint, data file)`` of a reference ``"<checkpoint>/data/<name>.safetensors"``."""
    match = REFERENCE_RE.fullmatch(name)
    if match is None:
        raise ValueError(f"not a reference: {name[:200]!r}")
    return match.group(1), match.group(2)


class Manifest(_Strict):
    format: Literal["resurgo.checkpoint"]
    version: int
    created_at: str
    step: Optional[int] = None
    metadata: dict[str, Any] = Field(default_factory=dict)  # describes the state: the user's
    save_info: dict[str, Any] = Field(default_factory=dict)  # describes the save: timings, host, policies
    library: dict[str, str]
    world: dict[str, int]
    checksum_algorithm: Literal["xxh3-128"]
    pickled: bool
    files: dict[str, FileEntry]
    references: dict[str, FileEntry] = Field(default_factory=dict)  # other checkpoints' data files (v3)
    tensors: dict[str, TensorEntry]
    tree: dict[str, Any]
    ranks: Optional[RankFiles] = None  # version 4: every rank's data files and index
    file_tag: Optional[str] = None  # version 4: the prefix of this save's data file names
    external: Optional[External] = None  # version 5: the foreign files an import in place reads
    manifest_checksum: Optional[str] = None  # required on read (checked against the bytes); set by seal()

    def to_json_bytes(self) -> bytes:
        """The compact JSON of the manifest, sealed: its checksum is the last member. Of a version 4
        manifest, the core: data files and chunks are in the ranks' indexes."""
        doc = self.model_dump(exclude_none=True)
        doc.pop(SEAL_FIELD, None)
        for optional in ("save_info", "references"):  # absent when empty: a manifest reads as it always did
            if not doc[optional]:
                del doc[optional]
        if self.version == INDEXED_VERSION:
            doc["files"] = {}
            for t in doc["tensors"].values():
                del t["chunks"]
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())

    @property
    def indexed(self) -> bool:
        """Version 4: chunks and data files are listed in the ranks' indexes, not here."""
        return self.version == INDEXED_VERSION

    def file_entry(self, name: str) -> "FileEntry | ExternalFile":
        """The entry of a data file a chunk names: this checkpoint's own, a reference, or a foreign file."""
        if name in self.files:
            return self.files[name]
        if is_external(name) and self.external is not None:
            return self.external.files[name[len(EXTERNAL_PREFIX):]]
        return self.references[name]

    def describe_file(self, name: str) -> str:
        """How messages name the file ``name`` a chunk names: a foreign one by its full path."""
        if is_external(name) and self.external is not None:
            return f"foreign file {self.external.root.rstrip('/')}/{name[len(EXTERNAL_PREFIX):]}"
        return name

    @property
    def external_files(self) -> dict[str, ExternalFile]:
        """The foreign files, by the names chunks give them (``external:<path>``)."""
        if self.external is None:
            return {}
        return {external_name(rel): f for rel, f in self.external.files.items()}

    @property
    def owned_bytes(self) -> int:
        """Tensor bytes stored in this checkpoint's own data files."""
        return sum(b - a for t in self.tensors.values() for c in t.chunks for f, a, b in c.spans if f in self.files)

    @property
    def referenced_bytes(self) -> dict[str, int]:
        """Tensor bytes read from each referenced data file."""
        out = dict.fromkeys(self.references, 0)
        for t in self.tensors.values():
            for c in t.chunks:
                for f, a, b in c.spans:
                    if f in self.references:
                        out[f] += b - a
        return out

    @property
    def referenced_checkpoints(self) -> frozenset[str]:
        """The names of the checkpoints (in the same root) whose data files this one reads."""
        return frozenset(split_reference(name)[0] for name in self.references)

    @property
    def tensor_bytes(self) -> int:
        return sum(c.nbytes for t in self.tensors.values() for c in t.chunks)


def seal(body: bytes) -> bytes:
    """Append ``"manifest_checksum":"<digest>"`` to the compact JSON object ``body``.

    The digest is the xxh3-128 of the result with the digest itself written as 32 zeros. Hashing
    the bytes rather than a re-encoding needs no canonical JSON: any reader checks it with a byte
    search and one hash.
    """
    if not (body.startswith(b"{") and body.endswith(b"}")):
        raise ValueError("seal() takes the bytes of one JSON object")
    sep = b"" if body[1:-1].strip(_JSON_SPACE) == b"" else b","
    head = body[:-1] + sep + _SEAL_KEY
    return head + checksum.digest_of(head, _SEAL_ZEROS + b'"}').encode() + b'"}'


def check_seal(raw: bytes, stored: object, source: str) -> None:
    """Check the manifest's own checksum, whose parsed value is ``stored``.

    ManifestError if it is not the last member as :func:`seal` writes it (the manifest was
    re-encoded); CorruptCheckpointError if the bytes changed since they were sealed.
    """
    end = len(raw.rstrip(_JSON_SPACE))
    key_at = end - _SEAL_TAIL - len(_SEAL_KEY)
    digest = raw[end - _SEAL_TAIL:end - 2]
    if (key_at < 1 or raw[key_at:end - _SEAL_TAIL] != _SEAL_KEY or raw[end - 2:end] != b'"}'
            or not isinstance(stored, str) or digest != stored.encode() or not _HEX128.fullmatch(stored)):
        raise ManifestError(
            f"{source}: {SEAL_FIELD!r} must be 32 hex digits in the manifest's last member, written compact "
            f"(\"{SEAL_FIELD}\":\"<digest>\"}}), as resurgo writes it; was the manifest re-encoded?"
        )
    actual = checksum.digest_of(memoryview(raw)[:end - _SEAL_TAIL], _SEAL_ZEROS + b'"}')
    if actual != stored:
        raise CorruptCheckpointError(
            f"{source}: the manifest's bytes do not match its {SEAL_FIELD} (stored {stored}, computed {actual}): "
            f"it changed after it was written"
        )


def parse_manifest(raw: bytes, source: str = MANIFEST_NAME) -> Manifest:
    """Parse and fully validate untrusted manifest bytes; raise ManifestError naming ``source``."""
    # Parsing creates an object per JSON value; with the collector on, a big manifest triggers
    # collections that scan every live object of the training process (2x the parse time).
    with collector_paused():
        return _parse_manifest(raw, source)


def declared_files(raw: bytes, source: str = MANIFEST_NAME) -> Collection[str]:
    """The data files a manifest lists, once it parses and verifies (its seal included); what
    storage may replace along with it (:mod:`resurgo.storage.ownership`). Of a version 4 manifest,
    every rank's data files and index, by the naming rule, answered name by name (never listed)."""
    manifest = parse_manifest(raw, source)
    if manifest.indexed:
        from resurgo.format.index import declared_names  # the index module builds on this one

        return declared_names(manifest)
    return frozenset(manifest.files)


def _parse_manifest(raw: bytes, source: str) -> Manifest:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source}: manifest is {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    try:
        doc = strict_json.loads(raw)
    except strict_json.DuplicateKeyError as e:
        raise ManifestError(f"{source}: the key {e.key[:200]!r} appears twice in one JSON object; a manifest "
                            f"names each member once (readers would disagree on which one holds)") from None
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ManifestError(f"{source}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: expected a JSON object at the top, found {type(doc).__name__}")
    if SEAL_FIELD in doc:  # first: a flipped bit anywhere is reported as corruption, whatever it hit
        check_seal(raw, doc[SEAL_FIELD], source)
    if doc.get("format") != FORMAT_NAME:
        raise ManifestError(f"{source}: 'format' is {str(doc.get('format'))[:80]!r}, expected {FORMAT_NAME!r}")
    version = doc.get("version")
    if version == UNSEALED_VERSION and type(version) is int:
        raise ManifestError(
            f"{source}: format version {version} is unsealed (that format has no {SEAL_FIELD!r}): nothing shows the "
            f"manifest was not edited after it was written, so it cannot be trusted; save the state again"
        )
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ManifestError(
            f"{source}: format version {str(version)[:40]!r} is not supported "
            f"(this resurgo reads version {', '.join(map(str, READABLE_VERSIONS))})"
        )
    if SEAL_FIELD not in doc:
        raise ManifestError(f"{source}: a version {version} manifest needs its {SEAL_FIELD!r}, and has none: "
                            f"it is unsealed and cannot be trusted")
    try:
        manifest = Manifest.model_validate(doc)
    except (ValidationError, RecursionError, ValueError) as e:
        raise ManifestError(f"{source}: does not match the v{version} schema: {str(e)[:800]}") from None
    validate_manifest(manifest, source)
    return manifest


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """True when ``value`` nests lists/tuples/dicts more than ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def _short(value: object) -> str:
    """A value for an error message, cut short (untrusted numbers may have thousands of digits)."""
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "..."


def validate_manifest(m: Manifest, source: str = MANIFEST_NAME) -> None:
    """Semantic checks that a schema cannot express. Raises ManifestError."""

    def fail(msg: str) -> None:
        raise ManifestError(f"{source}: {msg}")

    for name in ("metadata", "save_info"):
        if json_depth_exceeds(getattr(m, name), MAX_METADATA_DEPTH):
            fail(f"'{name}' is nested deeper than {MAX_METADATA_DEPTH} levels")
    if m.version < REFERENCING_VERSION and m.references:
        fail(f"'references' needs format version {REFERENCING_VERSION}, the manifest says {m.version}")
    for path, entry in m.files.items():
        if not DATA_FILE_RE.fullmatch(path) or ".." in path.split("/"):
            fail(f"data file path {path[:200]!r} is not of the form data/<name>.safetensors")
        _check_file_entry(path, entry, fail)
    for path, entry in m.references.items():
        match = REFERENCE_RE.fullmatch(path)
        if match is None or match.group(1) in (".", "..") or TMP_MARKER in match.group(1) or ".." in path.split("/"):
            fail(f"reference {path[:200]!r} is not of the form <checkpoint>/data/<name>.safetensors "
                 f"naming another committed checkpoint of the same root")
        _check_file_entry(path, entry, fail)
    _check_external(m, fail)
    if m.indexed:
        _check_core(m, fail)
    elif m.ranks is not None or m.file_tag is not None:
        fail(f"'ranks' and 'file_tag' need format version {INDEXED_VERSION}, the manifest says {m.version}")
    others: dict[str, Any] = {**m.references, **m.external_files}  # where a chunk's bytes may lie beside its own files
    for key, t in m.tensors.items():
        check_tensor_entry(key, t, fail)
        if m.indexed:
            continue
        if t.grid is not None or t.pieces is not None:
            fail(f"tensor {key!r}: 'grid' and 'pieces' need format version {INDEXED_VERSION}, the manifest says {m.version}")
        if "chunks" not in t.model_fields_set:
            fail(f"tensor {key!r}: 'chunks' is required")
        places: list[Place] = []
        for i, c in enumerate(t.chunks):
            check_chunk(key, t, i, c, m.files, others, m.version, fail)
            places.append(c.place)
        check_coverage(key, t, places, fail)
    validate_tree(m.tree, {k: t.kind for k, t in m.tensors.items()}, m.pickled, source)


def check_tensor_entry(key: str, t: TensorEntry, fail: Callable[[str], None]) -> None:
    """A tensor entry's dtype and shape (rules 5 of format.md section 5.3)."""
    if not dtypes.is_known(t.dtype) or (t.kind == "numpy" and t.dtype not in dtypes.NUMPY_DTYPES):
        fail(f"tensor {key!r}: unknown {t.kind} dtype {t.dtype[:40]!r}")
    if len(t.shape) > MAX_NDIM or any(d < 0 for d in t.shape):
        fail(f"tensor {key!r}: invalid shape {_short(t.shape)}")
    if math.prod(max(d, 1) for d in t.shape) * dtypes.itemsize(t.dtype) > MAX_TENSOR_BYTES:  # torch/numpy strides must fit int64
        fail(f"tensor {key!r}: shape {_short(t.shape)} is too large (even with a zero dimension, strides overflow)")


def check_chunk(key: str, t: TensorEntry, i: int, c: ChunkEntry, files: dict[str, "FileEntry"],
                references: dict[str, "FileEntry"], version: int, fail: Callable[[str], None]) -> None:
    """One chunk of tensor ``t``: its place, its byte ranges inside the data areas of ``files``
    (or, for an extent, ``references``), its checksums (rule 6 of format.md section 5.3)."""
    where = f"tensor {key!r} chunk {i}" + (f" in {c.file[:200]!r}" if c.file is not None else "")
    if (c.box is None) == (c.flat is None):
        fail(f"{where}: needs exactly one of 'box' or 'flat'")
    if c.extents is None and (c.file is None or c.byte_range is None):
        fail(f"{where}: needs 'file' and 'byte_range', or 'extents'")
    if c.extents is not None and (c.file is not None or c.byte_range is not None or not c.extents):
        fail(f"{where}: 'extents' (a non-empty list) replaces 'file' and 'byte_range'")
    if c.extents is not None and version != REFERENCING_VERSION:
        fail(f"{where}: 'extents' needs format version {REFERENCING_VERSION}, the manifest says {version}")
    if not 1 <= c.block_bytes <= MAX_BLOCK_BYTES:
        fail(f"{where}: block_bytes {_short(c.block_bytes)} out of range")
    spans = c.spans
    for j, (file, start, stop) in enumerate(spans):
        f = files.get(file) or references.get(file)
        if f is None:
            fail(f"{where}: file {file[:200]!r} is not listed in 'files' (nor in 'references')")
            return
        if not f.header_bytes <= start <= stop <= f.bytes:
            fail(f"{where}: byte range {_short([start, stop])} is outside the data area {_short([f.header_bytes, f.bytes])} of {file[:200]!r}")
        if c.extents is not None and (stop == start or (j < len(spans) - 1 and (stop - start) % c.block_bytes)):
            fail(f"{where}: extent {j} holds {stop - start} bytes: extents are not empty, and all but the last "
                 f"hold whole checksum blocks of {_short(c.block_bytes)} bytes")
    nbytes = c.nbytes
    place = c.place
    check_place(where, place, t, fail)
    size = dtypes.itemsize(t.dtype)
    if place.numel * size != nbytes:
        fail(f"{where}: {place.numel} elements of {t.dtype} need {place.numel * size} bytes, "
             f"the byte range holds {_short(nbytes)}")
    if len(c.checksums) != checksum.block_count(nbytes, c.block_bytes):
        fail(f"{where}: {len(c.checksums)} checksums for {checksum.block_count(nbytes, c.block_bytes)} blocks")
    if not _all_hex128(c.checksums):
        fail(f"{where}: checksums must be 32 hex characters")


def check_place(where: str, place: Place, t: TensorEntry, fail: Callable[[str], None]) -> None:
    """A chunk's or a piece's place (``where`` names it) lies inside tensor ``t``, a box of its rank."""
    if isinstance(place, ChunkBox) and not len(place.offsets) == len(place.shape) == len(t.shape):
        fail(f"{where}: box rank differs from the tensor's rank {len(t.shape)}")
    if not place.fits_in(tuple(t.shape)):
        fail(f"{where}: place {_short(place)} lies outside the tensor's shape {_short(t.shape)}")


def check_coverage(key: str, t: TensorEntry, places: list[Place], fail: Callable[[str], None]) -> None:
    """The places of a tensor's chunks tile it exactly once (rule 7 of format.md section 5.3)."""
    if len({type(p) for p in places}) > 1:
        fail(f"tensor {key!r}: mixes box and flat chunks")
    if len(places) > 0 and not covers_exactly_once(places, tuple(t.shape)):
        fail(f"tensor {key!r}: chunks do not cover the shape {_short(t.shape)} exactly once")
    if not places and math.prod(t.shape) != 0:
        fail(f"tensor {key!r}: has no chunks but {math.prod(t.shape)} elements")


MAX_FILES_PER_RANK = 1000
FILE_TAG_RE = re.compile(r"(?:[0-9a-f]{12}-)?")


def _check_core(m: Manifest, fail: Callable[[str], None]) -> None:
    """A version 4 core: every rank's files and index, and each tensor's grid or listed pieces."""
    world = m.world.get("size", 0)
    if m.files or m.references:
        fail(f"a version {INDEXED_VERSION} manifest lists no data files ('files' is empty, no 'references'): "
             f"each rank's index lists its own")
    r = m.ranks
    if r is None or m.file_tag is None:
        fail(f"a version {INDEXED_VERSION} manifest needs 'ranks' and 'file_tag'")
        return
    if not FILE_TAG_RE.fullmatch(m.file_tag):
        fail(f"'file_tag' {m.file_tag[:40]!r} is not empty nor 12 hex digits and '-'")
    if world < 1 or not len(r.files) == len(r.index_bytes) == len(r.index_checksums) == world:
        fail(f"'ranks' must describe each of the world's {_short(world)} ranks")
    if any(not 0 <= n <= MAX_FILES_PER_RANK for n in r.files) or any(n < 8 for n in r.index_bytes):
        fail(f"'ranks': a rank writes 0 to {MAX_FILES_PER_RANK} data files and an index of at least 8 bytes")
    if not _all_hex128(r.index_checksums):
        fail("'ranks': index checksums must be 32 hex characters")
    for key, t in m.tensors.items():
        if "chunks" in t.model_fields_set:
            fail(f"tensor {key!r}: a version {INDEXED_VERSION} core lists no chunks, only 'grid' or 'pieces'")
        if (t.grid is None) == (t.pieces is None):
            fail(f"tensor {key!r}: needs exactly one of 'grid' or 'pieces'")
        if t.grid is not None:
            g = t.grid
            if not len(g.parts) == len(g.strides) == len(t.shape) or any(p < 1 for p in g.parts):
                fail(f"tensor {key!r}: grid of {_short(g.parts)} parts does not fit the shape {_short(t.shape)}")
            if math.prod(t.shape) and not 0 <= min(g.grid.writer_bounds(t.shape)) <= max(g.grid.writer_bounds(t.shape)) < world:
                fail(f"tensor {key!r}: grid writers {_short(g.grid.writer_bounds(t.shape))} outside ranks 0..{world - 1}")
            continue
        assert t.pieces is not None
        for i, p in enumerate(t.pieces):
            if (p.box is None) == (p.flat is None):
                fail(f"tensor {key!r} piece {i}: needs exactly one of 'box' or 'flat'")
            check_place(f"tensor {key!r} piece {i}", p.place, t, fail)
            if not 0 <= p.rank < world:
                fail(f"tensor {key!r} piece {i}: rank {_short(p.rank)} outside ranks 0..{world - 1}")
        check_coverage(key, t, [p.place for p in t.pieces], fail)


def _check_external(m: Manifest, fail: Callable[[str], None]) -> None:
    """Version 5 and ``external`` go together; the root is absolute and canonical, every path
    under it relative and canonical (so that resolving it cannot climb out before symlinks are
    even looked at), every size non-negative."""
    ext = m.external
    if (m.version == EXTERNAL_VERSION) != (ext is not None):
        fail(f"'external' and format version {EXTERNAL_VERSION} go together (version {m.version}, "
             f"{'with' if ext is not None else 'without'} 'external')")
    if ext is None:
        return
    if m.references:
        fail(f"a version {EXTERNAL_VERSION} manifest has no 'references'")
    root = ext.root
    if (not root.startswith("/") or len(root) > MAX_EXTERNAL_PATH or "\0" in root
            or (root != "/" and not canonical_relative(root[1:]))):
        fail(f"external root {root[:200]!r} is not an absolute path in canonical form")
    if ext.tag is not None and not re.fullmatch("[0-9a-f]{64}", ext.tag):
        fail("external tag must be 64 hex digits")
    for rel, f in ext.files.items():
        if not canonical_relative(rel):
            fail(f"external file {rel[:200]!r} is not a relative path in canonical form under the external root "
                 f"(no leading '/', no '.', '..' or empty component)")
        if f.bytes < 0:
            fail(f"external file {rel[:200]!r}: size {_short(f.bytes)} is negative")


def _all_hex128(digests: list[str]) -> bool:
    """Every digest is 32 lowercase hex digits. A chunk may have 10^5 of them: their bytes, joined,
    lose every hex digit in one C pass (ten times a regex's speed) and must be left empty."""
    if not set(map(len, digests)) <= {32}:
        return False
    try:
        joined = "".join(digests).encode("ascii")
    except UnicodeEncodeError:
        return False
    return not joined.translate(None, b"0123456789abcdef")


def _check_file_entry(path: str, entry: FileEntry, fail: Callable[[str], None]) -> None:
    if not 8 <= entry.header_bytes <= entry.bytes:
        fail(f"data file {path!r}: header of {_short(entry.header_bytes)} bytes does not fit its {_short(entry.bytes)} bytes")
    if not _HEX128.fullmatch(entry.header_checksum):
        fail(f"data file {path!r}: header_checksum must be 32 hex characters")
