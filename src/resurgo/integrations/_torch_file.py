"""Reading a checkpoint file a framework wrote with torch.save before resurgo was added: safely
(``torch.load(weights_only=True)``) unless the caller allows pickle, and a refusal as a resurgo
error that names the file and the way out. Shared by the integrations."""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

from resurgo.errors import PickleNotAllowedError


def load_torch_file(path: str | os.PathLike, *, allow_pickle: bool, what: str, fix: str,
                    map_location: Any = "cpu") -> Any:
    """``torch.load`` of ``path``; without ``allow_pickle``, only tensors, plain containers and
    NumPy arrays (RNG states) are read. ``what`` names the file's kind in the error ("a Lightning
    checkpoint"), ``fix`` the flag that allows pickle ("pass ResurgoCheckpointIO(allow_pickle=True)")."""
    import numpy as np
    import torch

    # NumPy's RNG state is an ndarray: its reconstruction builds data, never calls the file's code.
    numpy_data = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), getattr(np, "_core", np.core).multiarray._reconstruct]
    try:
        with torch.serialization.safe_globals(numpy_data):
            return torch.load(path, map_location=map_location, weights_only=not allow_pickle)
    except pickle.UnpicklingError as err:
        # torch's message is long and advises torch's own flags: keep only what it refused.
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        detail = f"it holds {refused.group(1)}" if refused else "weights_only loading refuses it"
        raise _refused(path, what, detail, fix) from err


# The globals of a NumPy array in a torch.save pickle (the RNG states frameworks save).
_NUMPY_GLOBALS = {"numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType", "numpy._core.multiarray._reconstruct",
                  "numpy.core.multiarray._reconstruct"}


def check_torch_file(path: str | os.PathLike, *, what: str, fix: str) -> None:
    """Raise PickleNotAllowedError (naming ``path``, what it holds and ``fix``) if ``path``, a
    torch.save file, names any global beyond tensors, plain containers and NumPy arrays; its
    pickle is read, never run."""
    import torch

    unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - _NUMPY_GLOBALS)
    if unsafe:
        raise _refused(path, what, f"it holds {', '.join(unsafe)}", fix)


def refuse_dcp_folder(path: str | os.PathLike, what: str, fix: str) -> PickleNotAllowedError:
    """The error for a DCP checkpoint folder at ``path`` (``what`` wrote it): its ``.metadata``
    is a pickle that torch.distributed.checkpoint runs when it reads it."""
    return _refused(os.path.join(path, ".metadata"), f"the metadata of {what} (a DCP folder)",
                    "torch.distributed.checkpoint reads it with pickle.load", fix)


def _refused(path: str | os.PathLike, what: str, detail: str, fix: str) -> PickleNotAllowedError:
    return PickleNotAllowedError(f"{path}: {what} that needs unpickling to load ({detail}). If you trust the file, "
                                 f"{fix}; the next save is a resurgo checkpoint")
