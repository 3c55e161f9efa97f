# first, before anything imports torch: the CUDA build, if the app installed one (engine/boot/overlay.py)
from engine.boot.overlay import activate

activate()

from engine.cli import main  # noqa: E402

raise SystemExit(main())
