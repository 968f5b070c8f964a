"""Storage backends and the commit protocol. Knows nothing of tensors: only files and bytes."""

from resurgo.storage.local import CheckpointDir, LocalStaging
from resurgo.storage.local_files import ReadHandle, WriteHandle

__all__ = ["CheckpointDir", "LocalStaging", "ReadHandle", "WriteHandle"]
