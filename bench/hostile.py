"""Hostile-input suite: attack a live cross-home pipeline (relay, host, joiner) with
fuzzed and malformed inputs while a client keeps chatting, and print what happened.
The suite and its input generators live in testkit/hostile.py (tests run it too).

    .venv/bin/python bench/hostile.py                 # full run (a few minutes)
    .venv/bin/python bench/hostile.py --scale 0.1     # quick
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testkit.hostile import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
