"""What a save or a load did: bytes, files and seconds per phase."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SaveReport:
    path: str
    bytes_written: int  # every byte of every file, manifest and headers included
    tensor_bytes: int  # bytes of tensor data alone
    files: list[str]
    num_tensors: int
    seconds: dict[str, float] = field(default_factory=dict)
    """Phases: stage (copies out of the training tensors), write, checksum, fsync, commit, total.
    write, checksum and fsync are summed over the I/O threads, so they can exceed total."""

    @property
    def throughput_gbps(self) -> float:
        return self.bytes_written / max(self.seconds.get("total", 0.0), 1e-9) / 1e9


@dataclass
class LoadReport:
    path: str
    bytes_read: int  # read from storage by this rank
    files: list[str]
    num_tensors: int
    seconds: dict[str, float] = field(default_factory=dict)
    """Phases: plan, read, checksum (summed over threads), assemble, total."""
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)
    step: int | None = None
    metadata_bytes_read: int = 0
    """Bytes of metadata read before the data: the manifest, and the indexes of the ranks holding
    what this rank loads (format version 4)."""
    bytes_received: int = 0
    """Bytes this rank received from other ranks that read them for it (shared reads)."""
    shared: bool = False
    """Whether the ranks shared their reads (``share_reads``)."""
    share_plan_bytes_sent: int = 0
    """Bytes this rank sent to agree on the shared reads (0 alone or with ``share_reads=False``)."""


@dataclass
class ConvertReport:
    src: str
    dst: str
    to: str  # "safetensors", "hf" or "torch"
    files: list[str]  # the files written: the file's name, or for hf the names inside dst
    num_tensors: int
    tensor_bytes: int  # bytes of tensor data written
    bytes_written: int  # every byte of every file, headers and index included
    bytes_read: int  # bytes read from the checkpoint (checksum blocks at window edges included)
    peak_buffer_bytes: int  # the most memory held for tensor data at once (the reader's scratch at its bound)
    tensors_skipped: list[str] = field(default_factory=list)  # keys outside the ``only`` prefix
    values_dropped: list[str] = field(default_factory=list)  # non-tensor values the target does not hold
    raw_dtype_keys: list[str] = field(default_factory=list)  # stored as U8 bytes (dtype safetensors lacks)
    seconds: dict[str, float] = field(default_factory=dict)
    """Phases: read (waiting for verified tensor bytes), write, total."""


@dataclass
class ImportReport:
    src: str  # the source directory (or file)
    dst: str
    source: str  # "hf", "torch" or "spec"
    num_tensors: int
    num_values: int  # non-tensor values kept
    tensor_bytes: int  # bytes of tensor data written
    bytes_read: int  # tensor bytes read from the sources, replicas (compared) included
    bytes_written: int  # every byte of every file, manifest and headers included
    seconds: dict[str, float] = field(default_factory=dict)
    """Phases: spec (reading the source's metadata into a spec), check (file lengths, replicas),
    prepare (plan, staging), write_and_commit; within it, summed over the writer threads: read,
    checksum, write, fsync; then commit; and total. In place, also in_place_checksum: the one read
    of the referenced source bytes for their checksums."""
    in_place: bool = False  # asked to reference the source files rather than copy them
    in_place_bytes: int = 0  # tensor bytes referenced where they lie in the source files, not written
    copied: dict[str, str] = field(default_factory=dict)  # in place: the tensors copied after all, and why
