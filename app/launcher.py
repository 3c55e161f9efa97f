"""The `potluck` command: `potluck app` opens the desktop app, `potluck gpu --enable |
--disable` installs or removes the CUDA build of torch (app/gpu_enable.py); everything
else is the engine's command line (engine/cli/; its `join` reads a potluck://join/ link
pasted whole: engine/boot/join_link.py). The app sits above the engine, so the
dispatch lives here: the engine never imports the app, and the app process never imports
torch."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["app"]:
        from app.main import main as app_main

        return app_main(argv[1:])
    if argv[:1] == ["gpu"] and {"--enable", "--disable"} & set(argv[1:]):
        # installing the CUDA build is the app's (app/gpu_enable.py); it runs before the
        # overlay is activated, so this process never holds a torch it may replace
        from app.gpu_enable import main as gpu_main

        return gpu_main(argv[1:])
    try:
        # before engine.cli imports torch: a CUDA build the app downloaded sits first (engine/boot/overlay.py)
        from engine.boot.overlay import activate

        activate()
        from engine.cli import main as cli_main
    except KeyboardInterrupt:     # Ctrl+C while torch is imported: stopped, no traceback
        sys.stderr.write("\n")
        return 130
    return cli_main(argv)


if __name__ == "__main__":  # the PyInstaller bundle's entry script (build.spec)
    raise SystemExit(main())
