"""`python -m engine`: the CLI, after the app's CUDA build of torch (if any) is put first on the path."""

# first, before anything imports torch: the CUDA build, if the app installed one (engine/boot/overlay.py)
from engine.boot.overlay import activate

activate()

from engine.cli import main  # noqa: E402

raise SystemExit(main())
