"""The `potluck` command: `potluck app` opens the desktop app, `potluck gpu --enable |
--disable` installs or removes the CUDA build of torch (app/gpu_enable.py), `potluck join`
reads a potluck://join/ link into its code (app/links.py); everything else is the
engine's command line (engine/cli/). The app sits above the engine, so the
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
    if argv[:1] == ["join"] and len(argv) > 1:
        argv = _join_link_read(argv)
        if argv is None:
            return 2
    # before engine.cli imports torch: a CUDA build the app downloaded sits first (engine/boot/overlay.py)
    from engine.boot.overlay import activate

    activate()
    from engine.cli import main as cli_main

    return cli_main(argv)


def _join_link_read(argv: list[str]) -> list[str] | None:
    """`potluck join potluck://join/CODE[?relay=…]`, the link a friend sent pasted whole:
    the code (and its relay, unless --relay is given) for the engine's `join`; None, said
    why, when it is no link an invite makes. The links are the app's (app/links.py)."""
    from app.links import LinkError, is_link, parse_link

    at = next((i for i, a in enumerate(argv[1:], 1) if is_link(a)), None)
    if at is None:
        return argv
    try:
        link = parse_link(argv[at])
    except LinkError as exc:
        print(f"potluck: {exc}", file=sys.stderr)
        return None
    out = argv[:at] + [link.code] + argv[at + 1:]
    if link.relay and "--relay" not in out:
        out += ["--relay", link.relay]
    return out


if __name__ == "__main__":  # the PyInstaller bundle's entry script (build.spec)
    raise SystemExit(main())
