"""Killing a training script with SIGKILL at a chosen moment, for the integrations' kill-and-resume
tests: the script prints marker lines, the test kills it on one (``kill_on_line``); a script can
make one of its saves stop after writing its data files, before the commit (``hang_before_commit``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable


def hang_before_commit(armed: Callable[[], bool], message: str) -> None:
    """From now on, each save of this process writes its data files and then, if ``armed()``,
    prints ``message`` and waits to be killed before its commit (whatever it replaces is still
    in place)."""
    import resurgo.pipeline.save as pipeline_save

    write_then_commit = pipeline_save.write_then_commit

    def hanging(comm, staging, write, manifest, *rest):
        def write_then_wait():
            written = write()
            if armed():
                print(message, flush=True)
                time.sleep(600)
            return written

        return write_then_commit(comm, staging, write_then_wait, manifest, *rest)

    pipeline_save.write_then_commit = hanging


def kill_on_line(args: list[str], line: str, timeout: float = 60) -> list[str]:
    """Run ``python ARGS...`` and SIGKILL it as soon as it prints ``line``; returns the lines it
    printed. Fails (with its stderr) unless it died of that SIGKILL."""
    child = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        assert child.stdout is not None
        for out in child.stdout:
            lines.append(out.strip())
            if lines[-1] == line:
                child.send_signal(signal.SIGKILL)
                break
    finally:
        if child.poll() is None and lines[-1:] != [line]:
            child.kill()
        _, err = child.communicate(timeout=timeout)
    assert lines[-1:] == [line], f"never printed {line!r}:\n" + "\n".join(lines) + "\n" + err
    assert child.returncode == -signal.SIGKILL, err
    return lines
