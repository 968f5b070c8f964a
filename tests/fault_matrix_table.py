"""Run every cell of the fault-injection matrix (tests/test_fault_matrix.py), its checks included,
and print a markdown table: fault x phase -> the error on the surviving ranks, the longest time
from the fault to it, whether anything was committed, whether the earlier checkpoint is intact,
whether a following save succeeded. ``python tests/fault_matrix_table.py [phase ...]``; about 15
minutes for the whole matrix on a few cores.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

from fault_matrix_workers import PHASES  # noqa: E402
from test_fault_matrix import run_fatal, run_nonfatal  # noqa: E402

FAULTS = ("kill", "stop", "raise", "enospc")


def main(phases: list[str]) -> None:
    rows: dict[tuple[str, str], dict | str] = {}
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        for fault in ("raise", "enospc"):
            try:
                for r in run_nonfatal(Path(tmp) / fault, [(p, fault) for p in phases]):
                    rows[(r["phase"], fault)] = r
            except Exception as e:  # noqa: BLE001 - reported in the table
                for p in phases:
                    rows.setdefault((p, fault), f"FAILED: {e}")
        for fault in ("kill", "stop"):
            for phase in phases:
                with pytest.MonkeyPatch.context() as mp:
                    try:
                        rows[(phase, fault)] = run_fatal(Path(tmp) / f"{phase}-{fault}", phase, fault, mp)
                    except (AssertionError, Exception) as e:  # noqa: BLE001 - reported in the table
                        rows[(phase, fault)] = f"FAILED: {type(e).__name__}: {str(e)[:200]}"
    print("| fault | phase | error on every surviving rank | max s to error | committed? | earlier intact? "
          "| follow-up save ok? |")
    print("|---|---|---|---|---|---|---|")
    for fault in FAULTS:
        for phase in phases:
            r = rows[(phase, fault)]
            if isinstance(r, str):
                print(f"| {fault} | {phase} | {r.replace('|', '/')} | | | | |")
                continue
            follow = {True: "yes", False: "no", None: "n/a (job lost a rank)"}[r["followup"]]
            print(f"| {fault} | {phase} | {r['error']} | {r['max_delay']:.1f} | {'yes' if r['committed'] else 'no'} "
                  f"| {'yes' if r['earlier_intact'] else 'no'} | {follow} |")


if __name__ == "__main__":
    main(sys.argv[1:] or list(PHASES))
