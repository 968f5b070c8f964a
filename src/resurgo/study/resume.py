"""Resumable study runs: the journal of completed units of measurement, checkpointed with resurgo.

This module owns ``<out>/study-journal``, a resurgo checkpoint holding the study's configuration,
the machine description of each session, and one record per completed unit of measurement (a
pair of runs without and with checkpoints and its formats row, a determinism experiment, a scale
world, a framework's results): its JSON result, the progress steps it took and its seconds. The
journal is saved again (``resurgo.save(..., overwrite=True)``, an atomic replace) as each unit
completes, so a killed run leaves the journal of its last completed unit.

A run started again with the same configuration replays the recorded units, measuring none of
them again, and measures the rest; each pair of runs is measured back to back inside one unit,
so a resumed run compares no run of one session with a run of another. A different configuration
raises StudyError naming each field that differs; ``restart=True`` removes the journal first.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from resurgo.api import load_dict, save
from resurgo.errors import ResurgoError, StudyError
from resurgo.wording import plural

__all__ = ["JOURNAL", "Journal", "config_differences"]

JOURNAL = "study-journal"
KIND = "resurgo-study-journal"
VERSION = 1


class Counter(Protocol):
    """What a unit's progress is counted on: ``done`` progress steps so far."""

    done: int


def _plain(value: Any) -> Any:
    """``value`` as results.json holds it (tuples become lists): a replayed unit and a measured one
    give the same results."""
    return json.loads(json.dumps(value, allow_nan=False))


def config_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"field: recorded X, now Y"`` for each field whose value differs, in the config's order."""
    names = list(dict.fromkeys([*current, *recorded]))
    missing = object()
    diffs = []
    for name in names:
        a, b = recorded.get(name, missing), current.get(name, missing)
        if a != b:
            shown = ["(absent)" if v is missing else json.dumps(v) for v in (a, b)]
            diffs.append(f"{name}: recorded {shown[0]}, now {shown[1]}")
    return diffs


class Journal:
    """The completed units of one study's output directory (see the module docstring)."""

    def __init__(self, out: Path, config: dict[str, Any], environment: dict[str, Any],
                 restart: bool = False) -> None:
        self.path = Path(out) / JOURNAL
        self.config = _plain(config)
        self.units: dict[str, dict[str, Any]] = {}
        self.sessions: list[dict[str, Any]] = []
        self.replayed = self.measured = 0
        self.replayed_s = 0.0  # what the replayed units took when they were measured
        if restart and self.path.exists():
            shutil.rmtree(self.path) if self.path.is_dir() else self.path.unlink()
        if self.path.exists():
            self._read()
        self.sessions.append(_plain(environment))
        self.recorded_at_start = len(self.units)

    @property
    def environment(self) -> dict[str, Any]:
        """The machine as the first session found it (what the report describes)."""
        return self.sessions[0]

    def _read(self) -> None:
        try:
            state = load_dict(self.path, collective=False)
        except ResurgoError as e:
            raise StudyError(f"{self.path}: the study's journal cannot be read ({e}); pass --restart to measure "
                             "again from the start") from None
        if not isinstance(state, dict) or state.get("kind") != KIND or state.get("version") != VERSION:
            raise StudyError(f"{self.path}: not a study journal of version {VERSION} (key 'kind' is "
                             f"{state.get('kind') if isinstance(state, dict) else type(state).__name__!r}); "
                             "pass --restart to replace it, or choose another --out")
        diffs = config_differences(json.loads(state["config"]), self.config)
        if diffs:
            raise StudyError(f"{self.path}: this study was started with another configuration ({'; '.join(diffs)}); "
                             "run it with the same options to continue it, or pass --restart to measure again "
                             "from the start")
        self.sessions = json.loads(state["sessions"])
        self.units = {u["key"]: u for u in state["units"]}

    def _write(self) -> None:
        units = [dict(u) for u in self.units.values()]
        state = {"kind": KIND, "version": VERSION, "config": json.dumps(self.config),
                 "sessions": json.dumps(self.sessions), "units": units}
        save(state, self.path, overwrite=True, collective=False)

    def has(self, key: str) -> bool:
        """Whether an earlier run recorded the unit ``key``."""
        return key in self.units

    def unit(self, key: str, measure: Callable[[], Any], progress: Counter) -> Any:
        """``measure()``'s result, recorded in the journal before it is returned; or, when an
        earlier run recorded ``key``, that result, with the progress steps it took counted."""
        record = self.units.get(key)
        if record is not None:
            self.replayed += 1
            self.replayed_s += record["seconds"]
            progress.done += record["starts"]
            return json.loads(record["result"])
        before, t0 = progress.done, time.perf_counter()
        result = _plain(measure())
        self.units[key] = {"key": key, "result": json.dumps(result, allow_nan=False),
                           "starts": progress.done - before, "seconds": time.perf_counter() - t0}
        self.measured += 1
        self._write()
        return result

    def summary(self) -> dict[str, Any]:
        """What results.json says of the journal: where, how many sessions, units replayed and measured."""
        return {"path": str(self.path), "sessions": len(self.sessions), "units_replayed": self.replayed,
                "units_measured": self.measured, "session_environments": self.sessions}

    def describe(self) -> str:
        """One line for the console: what an earlier run had recorded."""
        return (f"{plural(self.recorded_at_start, 'unit')} of measurement recorded by an earlier run in {self.path}; "
                "they are not measured again (--restart measures everything again)")

