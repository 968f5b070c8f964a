"""Training process for tests/test_resume_sigkill.py: reference, train (gets killed) or resume.

The training code lives in examples/kill_resume_worker.py, shared with the demonstration
(examples/demo_kill_resume.py), so the test checks exactly what the demonstration shows.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from kill_resume_worker import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
