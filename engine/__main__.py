"""`python -m engine`: the CLI, after the app's CUDA build of torch (if any) is put first on the path."""

import sys

try:
    # first, before anything imports torch: the CUDA build, if the app installed one (engine/boot/overlay.py)
    from engine.boot.overlay import activate

    activate()

    from engine.cli import main

    code = main()
except KeyboardInterrupt:   # Ctrl+C during the imports (a stage process shares the terminal's)
    sys.stderr.write("\n")
    code = 130
raise SystemExit(code)
