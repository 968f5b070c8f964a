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
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from resurgo.errors import CorruptCheckpointError, ManifestError
from resurgo.format import checksum, dtypes
from resurgo.format.tree import validate_tree
from resurgo.gcpause import collector_paused
from resurgo.layout.box import ChunkBox, FlatRange, Place, covers_exactly_once

FORMAT_NAME = "resurgo.checkpoint"
FORMAT_VERSION = 2  # what resurgo writes
READABLE_VERSIONS = (2,)
UNSEALED_VERSION = 1  # 2 without the manifest's own checksum: refused, nothing proves it unedited
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 30
MAX_NDIM = 64
MAX_BLOCK_BYTES = 1 << 30
MAX_METADATA_DEPTH = 64  # nested JSON arrays/objects in 'metadata' (readers' parsers have limits)
MAX_TENSOR_BYTES = (1 << 62) - 1  # with every dimension counted as at least 1
DATA_FILE_RE = re.compile(r"^data/[A-Za-z0-9_.-]{1,200}\.safetensors$")
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


class ChunkEntry(_Strict):
    """One stored piece of a tensor: where it sits in the tensor and where its bytes are."""

    box: Optional[BoxPlace] = None
    flat: Optional[FlatPlace] = None
    file: str
    name: Optional[str] = None  # the chunk's tensor name in the data file; omitted: the tensor's key
    byte_range: Annotated[list[int], Field(min_length=2, max_length=2)]  # absolute [start, stop) in the file
    block_bytes: int
    checksums: list[str]

    @property
    def place(self) -> Place:
        return place_of(self.box, self.flat)

    @property
    def nbytes(self) -> int:
        return self.byte_range[1] - self.byte_range[0]

    def name_in_file(self, key: str) -> str:
        return key if self.name is None else self.name


class TensorEntry(_Strict):
    kind: Literal["torch", "numpy"]
    dtype: str
    shape: list[int]
    chunks: list[ChunkEntry]


class FileEntry(_Strict):
    bytes: int  # total size of the data file
    header_bytes: int  # size of the safetensors header, its 8-byte length prefix included
    header_checksum: str  # xxh3-128 of those header bytes


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
    tensors: dict[str, TensorEntry]
    tree: dict[str, Any]
    manifest_checksum: Optional[str] = None  # required on read (checked against the bytes); set by seal()

    def to_json_bytes(self) -> bytes:
        """The compact JSON of the manifest, sealed: its checksum is the last member."""
        doc = self.model_dump(exclude_none=True)
        doc.pop(SEAL_FIELD, None)
        if not doc["save_info"]:  # optional: a manifest without it reads as it always did
            del doc["save_info"]
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode())

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


def declared_files(raw: bytes, source: str = MANIFEST_NAME) -> frozenset[str]:
    """The data files a manifest lists, once it parses and verifies (its seal included); what
    storage may replace along with it (:mod:`resurgo.storage.ownership`)."""
    return frozenset(parse_manifest(raw, source).files)


def _parse_manifest(raw: bytes, source: str) -> Manifest:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{source}: manifest is {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    try:
        doc = json.loads(raw)
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
    for path, entry in m.files.items():
        if not DATA_FILE_RE.fullmatch(path) or ".." in path.split("/"):
            fail(f"data file path {path[:200]!r} is not of the form data/<name>.safetensors")
        if not 8 <= entry.header_bytes <= entry.bytes:
            fail(f"data file {path!r}: header of {_short(entry.header_bytes)} bytes does not fit its {_short(entry.bytes)} bytes")
        if not _HEX128.fullmatch(entry.header_checksum):
            fail(f"data file {path!r}: header_checksum must be 32 hex characters")
    for key, t in m.tensors.items():
        if not dtypes.is_known(t.dtype) or (t.kind == "numpy" and t.dtype not in dtypes.NUMPY_DTYPES):
            fail(f"tensor {key!r}: unknown {t.kind} dtype {t.dtype[:40]!r}")
        if len(t.shape) > MAX_NDIM or any(d < 0 for d in t.shape):
            fail(f"tensor {key!r}: invalid shape {_short(t.shape)}")
        size = dtypes.itemsize(t.dtype)
        if math.prod(max(d, 1) for d in t.shape) * size > MAX_TENSOR_BYTES:  # torch/numpy strides must fit int64
            fail(f"tensor {key!r}: shape {_short(t.shape)} is too large (even with a zero dimension, strides overflow)")
        places: list[Place] = []
        for i, c in enumerate(t.chunks):
            where = f"tensor {key!r} chunk {i} in {c.file[:200]!r}"
            if (c.box is None) == (c.flat is None):
                fail(f"{where}: needs exactly one of 'box' or 'flat'")
            if c.file not in m.files:
                fail(f"{where}: the file is not listed in 'files'")
            start, stop = c.byte_range
            f = m.files[c.file]
            if not f.header_bytes <= start <= stop <= f.bytes:
                fail(f"{where}: byte range {_short([start, stop])} is outside the data area {_short([f.header_bytes, f.bytes])} of the file")
            place = c.place
            if isinstance(place, ChunkBox) and not (len(place.offsets) == len(place.shape) == len(t.shape)):
                fail(f"{where}: box rank differs from the tensor's rank {len(t.shape)}")
            if not place.fits_in(tuple(t.shape)):
                fail(f"{where}: place {_short(place)} lies outside the tensor's shape {_short(t.shape)}")
            if place.numel * size != stop - start:
                fail(f"{where}: {place.numel} elements of {t.dtype} need {place.numel * size} bytes, "
                     f"the byte range holds {_short(stop - start)}")
            if not 1 <= c.block_bytes <= MAX_BLOCK_BYTES:
                fail(f"{where}: block_bytes {_short(c.block_bytes)} out of range")
            if len(c.checksums) != checksum.block_count(stop - start, c.block_bytes):
                fail(f"{where}: {len(c.checksums)} checksums for {checksum.block_count(stop - start, c.block_bytes)} blocks")
            if not all(_HEX128.fullmatch(h) for h in c.checksums):
                fail(f"{where}: checksums must be 32 hex characters")
            places.append(place)
        if len({type(p) for p in places}) > 1:
            fail(f"tensor {key!r}: mixes box and flat chunks")
        if len(places) > 0 and not covers_exactly_once(places, tuple(t.shape)):
            fail(f"tensor {key!r}: chunks do not cover the shape {_short(t.shape)} exactly once")
        if not places and math.prod(t.shape) != 0:
            fail(f"tensor {key!r}: has no chunks but {math.prod(t.shape)} elements")
    validate_tree(m.tree, {k: t.kind for k, t in m.tensors.items()}, m.pickled, source)
