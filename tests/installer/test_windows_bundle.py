"""The staged Windows bundle (build/windows/stage, left there by installer/build-windows.sh)
holds what the program needs, checked without wine:

- every .pyd/.dll/.exe in it finds each DLL it imports, in the bundle or among Windows 10's
  system DLLs (installer/windows/pe_imports.py reads the PE import tables);
- every module the program imports at start-up, recorded here on Linux with the same
  package versions (the chat path: `potluck chat --once`, with its stage process; the app
  path: `potluck app --no-host`, with its node), is in the bundle's lib/.

The second is what installer/windows/layout.py's drops answer to: it once left out
torch/testing/_internal/, which torch imports at start-up, and the installed program could
not start. Skipped when there is no staged tree (`make installers` builds it).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.installers

ROOT = Path(__file__).resolve().parents[2]
STAGE = ROOT / "build" / "windows" / "stage"
LIB = STAGE / "lib"
sys.path.insert(0, str(ROOT / "installer" / "windows"))

import layout  # noqa: E402
import pe_imports  # noqa: E402

QUESTION = "What is the capital of France?"

# Modules the Linux run imports that the Windows bundle leaves out by design. Keep it short:
# each entry says why the Windows program does not import it, and names the module Windows
# imports in its place (which must be in the bundle), if any. A key covers its submodules.
NOT_ON_WINDOWS = {
    # psutil's Linux extension (a .so); on Windows psutil imports its _psutil_windows.pyd
    "psutil._psutil_linux": "psutil._psutil_windows",
    # jaraco.context imports backports.tarfile only on Python < 3.12: the venv runs 3.11,
    # the bundle 3.13 (whose tarfile it uses)
    "backports": None,
    # optional: anyio and httpcore2 import it inside try/except ModuleNotFoundError; the
    # venv has it for openai, a test dependency, and the bundle does not ship it
    "sniffio": None,
    # numpy 2.5 (the bundle's; it needs Python 3.12+) renamed the venv's numpy 2.4 module
    "numpy._utils._convertions": "numpy._utils._conversions",
}

# The recorder: every process (the program, the node, its stage processes) that starts with
# this folder on PYTHONPATH writes, as it exits, the modules it imported (those with a file
# or a package path: the rest are built into the interpreter) to $POTLUCK_MODULES_OUT.<pid>.
SITECUSTOMIZE = '''\
import atexit, os, sys

def _potluck_record_modules():
    out = os.environ.get("POTLUCK_MODULES_OUT")
    if not out:
        return
    rows = []
    for name, m in list(sys.modules.items()):
        d = getattr(m, "__dict__", None)
        if not isinstance(d, dict):
            continue
        where = d.get("__file__") or next(iter(d.get("__path__") or ()), None)
        if where:
            rows.append(name + "\\t" + str(where))
    with open(out + "." + str(os.getpid()), "w", encoding="utf-8") as f:
        f.write("\\n".join(sorted(rows)) + "\\n")

atexit.register(_potluck_record_modules)
'''


@pytest.fixture(scope="module")
def stage() -> Path:
    if not (LIB.is_dir() and (STAGE / "python").is_dir()):
        pytest.skip(f"no staged Windows tree at {STAGE} (installer/build-windows.sh, `make installers`, builds it)")
    return STAGE


# ---- pe_imports on files made here ------------------------------------------------------

def make_pe(dlls=(), delayed=(), pe32=False) -> bytes:
    """A minimal PE image: one section holding the import and delay-import descriptors and
    the DLL names they point at."""
    opt_size = (96 if pe32 else 112) + 16 * 8
    pe_at, sect_at, raw_at, va = 0x40, 0x40 + 24 + opt_size, 0x200, 0x1000
    imp_off = 0
    delay_off = 20 * (len(dlls) + 1)
    names_off = delay_off + 32 * (len(delayed) + 1)
    names, name_rvas = b"", []
    for n in (*dlls, *delayed):
        name_rvas.append(va + names_off + len(names))
        names += n.encode() + b"\0"
    body = bytearray(names_off) + names
    for i, rva in enumerate(name_rvas[:len(dlls)]):
        struct.pack_into("<IIIII", body, imp_off + 20 * i, 0, 0, 0, rva, va)   # FirstThunk: not read
    for i, rva in enumerate(name_rvas[len(dlls):]):
        struct.pack_into("<IIIIIIII", body, delay_off + 32 * i, 1, rva, 0, 0, 0, 0, 0, 0)
    head = bytearray(raw_at)
    head[:2] = b"MZ"
    struct.pack_into("<I", head, 0x3C, pe_at)
    head[pe_at:pe_at + 4] = b"PE\0\0"
    struct.pack_into("<HHIIIHH", head, pe_at + 4, 0x14C if pe32 else 0x8664, 1, 0, 0, 0, opt_size, 0x2022)
    opt = pe_at + 24
    struct.pack_into("<H", head, opt, 0x10B if pe32 else 0x20B)
    if pe32:
        struct.pack_into("<I", head, opt + 28, 0x10000000)
    else:
        struct.pack_into("<Q", head, opt + 24, 0x180000000)
    count_at, dirs_at = (92, 96) if pe32 else (108, 112)
    struct.pack_into("<I", head, opt + count_at, 16)
    struct.pack_into("<II", head, opt + dirs_at + 8 * 1, va + imp_off, 20 * (len(dlls) + 1))
    if delayed:
        struct.pack_into("<II", head, opt + dirs_at + 8 * 13, va + delay_off, 32 * (len(delayed) + 1))
    head[sect_at:sect_at + 8] = b".rdata\0\0"
    struct.pack_into("<IIII", head, sect_at + 8, len(body), va, len(body), raw_at)
    return bytes(head + body)


@pytest.mark.parametrize("pe32", [False, True])
def test_pe_imports_reads_both_import_tables(tmp_path, pe32):
    f = tmp_path / "a.dll"
    f.write_bytes(make_pe(["KERNEL32.dll", "python313.dll"], ["ole32.dll"], pe32=pe32))
    assert pe_imports.imports(f) == ["KERNEL32.dll", "python313.dll"]
    assert pe_imports.delay_imports(f) == ["ole32.dll"]
    f.write_bytes(make_pe(["KERNEL32.dll"], pe32=pe32))
    assert pe_imports.delay_imports(f) == []


def test_pe_imports_rejects_malformed_files_with_value_error(tmp_path):
    good = make_pe(["KERNEL32.dll", "Qt6Core.dll"], ["ole32.dll"])
    f = tmp_path / "x.dll"
    for data in (b"", b"MZ", b"ELF" + good[3:], good[:0x3C] + struct.pack("<I", 1 << 30) + good[0x40:]):
        f.write_bytes(data)
        with pytest.raises(ValueError):
            pe_imports.imports(f)
    # every truncation and random corruption: the right answer or ValueError, nothing else
    # (no IndexError or struct.error from a read past the end)
    rng = random.Random(1)
    cases = [good[:n] for n in range(0, len(good), 7)]
    for _ in range(400):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        cases.append(bytes(b))
    for data in cases:
        f.write_bytes(data)
        for read in (pe_imports.imports, pe_imports.delay_imports):
            try:
                names = read(f)
            except ValueError:
                continue
            assert all(isinstance(n, str) and n for n in names)


def test_unsatisfied_matches_names_in_the_tree_case_blind_and_system_dlls(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "Needs.pyd").write_bytes(make_pe(["b.DLL", "KERNEL32.dll", "api-ms-win-crt-heap-l1-1-0.dll",
                                                        "gone.dll"], ["alsogone.dll"]))
    (tmp_path / "B.dll").write_bytes(make_pe(["ntdll.dll"]))
    assert pe_imports.unsatisfied(tmp_path) == {"a/Needs.pyd": ["gone.dll"]}


def test_layout_drops_what_cannot_load_to_a_fixed_point_and_stops_on_unknown_dlls(tmp_path, capsys):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "left.dll").write_bytes(make_pe(["Qt6Qml.dll"]))        # layout left Qt6Qml.dll out
    (lib / "onleft.pyd").write_bytes(make_pe(["left.dll"]))        # so this cannot load either
    (lib / "fine.pyd").write_bytes(make_pe(["kernel32.dll", "FINE2.dll"]))
    (lib / "fine2.dll").write_bytes(make_pe(["user32.dll"]))
    assert sorted(layout.drop_unloadable(tmp_path, {"qt6qml.dll"})) == ["lib/left.dll", "lib/onleft.pyd"]
    assert sorted(p.name for p in lib.iterdir()) == ["fine.pyd", "fine2.dll"]
    assert "dropped lib/onleft.pyd" in capsys.readouterr().out
    (lib / "odd.dll").write_bytes(make_pe(["somesystem.dll"]))     # neither left out nor known
    with pytest.raises(SystemExit, match="somesystem.dll"):
        layout.drop_unloadable(tmp_path, {"qt6qml.dll"})
    assert (lib / "odd.dll").exists()


def test_the_wheels_fetched_are_those_whose_markers_hold_on_windows_python_313():
    import tomllib
    import fetch_wheels
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    chosen = {str(r.specifier) for r in fetch_wheels.for_target(deps) if r.name == "PySide6-Essentials"}
    # the bundle's Python is 3.13: the pin kept off Pythons before 3.12 must not decide it
    assert chosen == {">=6.7"}
    picked = fetch_wheels.for_target(["pywin32-ctypes; sys_platform == 'win32'", "uvloop; sys_platform != 'win32'",
                                      "tomli; python_version < '3.11'"])
    assert [r.name for r in picked] == ["pywin32-ctypes"]


def _wheel(where: Path, name: str, version: str) -> None:
    import zipfile
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(where / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_a_cache_resolved_for_other_requirements_is_resolved_again(tmp_path, monkeypatch):
    """pip download from a local index of two versions: a warm cache keeps its wheel while
    the requirement set is the one it was resolved for, and asks the index again when the
    set changes, where a cached version the new specifier still accepts would otherwise
    be kept (a developer's bundle differed from CI's that way)."""
    import fetch_wheels
    index, dest = tmp_path / "index", tmp_path / "cache"
    index.mkdir()
    _wheel(index, "pkga", "1.0")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    cached = lambda: sorted(p.name for p in dest.glob("*.whl"))
    fetch_wheels.fetch(dest, ["pkga>=0.5"])
    assert cached() == ["pkga-1.0-py3-none-any.whl"]
    _wheel(index, "pkga", "2.0")                       # a newer release
    fetch_wheels.fetch(dest, ["pkga>=0.5"])           # same set: the cache answers
    assert cached() == ["pkga-1.0-py3-none-any.whl"]
    fetch_wheels.fetch(dest, ["pkga>=0.5; python_version >= '3.12'"])   # the set changed
    assert cached() == ["pkga-2.0-py3-none-any.whl"]
    fetch_wheels.fetch(dest, ["pkga<2"])              # one the new specifier excludes goes
    assert cached() == ["pkga-1.0-py3-none-any.whl"]


# ---- the staged tree --------------------------------------------------------------------

def test_every_dll_import_in_the_bundle_is_met(stage):
    lost = pe_imports.unsatisfied(stage)
    assert not lost, "DLLs found neither in the bundle nor in Windows 10: " + "; ".join(
        f"{rel} imports {', '.join(names)}" for rel, names in lost.items())


def test_the_system_dll_list_holds_only_what_the_bundle_imports(stage):
    """WINDOWS_SYSTEM_DLLS is curated, not a catalogue: a name nothing imports any more goes."""
    used = set()
    for p in pe_imports.pe_files(stage):
        used |= {n.lower() for n in pe_imports.imports(p) + pe_imports.delay_imports(p)}
    assert sorted(pe_imports.WINDOWS_SYSTEM_DLLS - used) == []


@pytest.mark.skipif(not shutil.which("x86_64-w64-mingw32-objdump"), reason="no mingw objdump")
def test_pe_imports_agrees_with_objdump(stage):
    files = [stage / "python" / "python313.dll", LIB / "PySide6" / "Qt6Core.dll", LIB / "PySide6" / "QtWidgets.pyd",
             next((LIB / "torch").glob("_C.*pyd")), LIB / "torch" / "lib" / "c10.dll", stage / "potluck.exe"]
    for f in files:
        out = subprocess.run(["x86_64-w64-mingw32-objdump", "-p", str(f)], capture_output=True, text=True,
                             timeout=120).stdout
        imp = out.split("The Import Tables", 1)[1].split("\nThe ", 1)[0] if "The Import Tables" in out else ""
        assert re.findall(r"\tDLL Name: (\S+)", imp) == pe_imports.imports(f), f


# ---- the modules the program imports at start-up ----------------------------------------

def _read_records(out: Path) -> dict[int, dict[str, str]]:
    recs = {}
    for f in out.parent.glob(out.name + ".*"):
        rows = (line.split("\t", 1) for line in f.read_text(encoding="utf-8").splitlines() if line)
        recs[int(f.suffix[1:])] = dict(rows)
    return recs


def _env(tmp: Path, out: Path) -> dict:
    site = tmp / "recorder"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, PYTHONPATH=str(site), POTLUCK_MODULES_OUT=str(out), POTLUCK_HOME=str(home),
                POTLUCK_KEYSTORE="file", HF_HUB_OFFLINE="1", TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false",
                QT_QPA_PLATFORM="offscreen")


@pytest.fixture(scope="module")
def chat_modules(stage, tmp_path_factory) -> dict[int, dict[str, str]]:
    """`potluck chat --once`: the head process and its stage process."""
    tmp = tmp_path_factory.mktemp("chat")
    out = tmp / "modules"
    p = subprocess.run([sys.executable, "-m", "app.launcher", "chat", "--stages", "2", "--max-tokens", "8",
                        "--temperature", "0", "--once", QUESTION], env=_env(tmp, out), cwd=tmp,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "Paris" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    recs = _read_records(out)
    assert len(recs) >= 2, f"the stage process recorded nothing: {sorted(recs)}"
    return recs


@pytest.fixture(scope="module")
def app_modules(stage, tmp_path_factory) -> tuple[int, int, dict[int, dict[str, str]]]:
    """`potluck app --no-host` until its node listens and the app has polled it, then
    SIGTERM (as a session's logout): the app closes the node and both exit normally."""
    tmp = tmp_path_factory.mktemp("app")
    out = tmp / "modules"
    log = open(tmp / "app.log", "w")
    app = subprocess.Popen([sys.executable, "-m", "app.launcher", "app", "--no-host", "--threads", "1"],
                           env=_env(tmp, out), cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, node = time.time() + 180, None
        while time.time() < deadline:
            assert app.poll() is None, (tmp / "app.log").read_text()[-3000:]
            node = next((c for c in psutil.Process(app.pid).children() if "node" in c.cmdline()), None)
            if node and any(c.status == psutil.CONN_LISTEN for c in node.net_connections("inet")):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the app's node did not start: " + (tmp / "app.log").read_text()[-3000:])
        time.sleep(3)   # the app's first requests to its node
        app.send_signal(signal.SIGTERM)
        assert app.wait(120) == 0, (tmp / "app.log").read_text()[-3000:]
        node.wait(60)
    finally:
        if app.poll() is None:
            app.kill()
        log.close()
    return app.pid, node.pid, _read_records(out)


def _ours_or_third_party(where: str) -> bool:
    """A module the bundle's lib/ must carry: a file in site-packages, or in our checkout.
    Not one without a file on disk, such as shiboken6's shibokensupport.* (and PySide6.support's
    aliases of them), whose source is embedded in shiboken6's extension and whose __file__
    is a relative pseudo-path."""
    if not os.path.isabs(where) or not os.path.exists(where):
        return False
    paths = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    w = os.path.realpath(where)
    if any(w.startswith(os.path.realpath(p) + os.sep) for p in paths):
        return True
    return w.startswith(str(ROOT) + os.sep) and not w.startswith(str(ROOT / ".venv") + os.sep)


def _in_bundle(name: str) -> bool:
    base = LIB.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or base.is_dir():
        return True   # a module, a package, a namespace package
    leaf = base.name
    return any(p.name == leaf + ".pyd" or (p.name.startswith(leaf + ".") and p.name.endswith(".pyd"))
               for p in base.parent.glob(leaf + ".*"))   # an extension: x.pyd, x.cp313-win_amd64.pyd


def _missing(records: dict[int, dict[str, str]]) -> list[str]:
    modules: dict[str, str] = {}
    for rec in records.values():
        modules.update(rec)
    missing, allowed = set(), set()
    for name, where in modules.items():
        if name.startswith("__"):   # __main__, __mp_main__, pip's editable-install finder
            continue
        if not _ours_or_third_party(where):
            continue                # the standard library: python313.zip and python/*.pyd
        # a module an extension defines inside itself (torch._C._autograd in torch._C's .so)
        while "." in name and modules.get(name.rsplit(".", 1)[0]) == where:
            name = name.rsplit(".", 1)[0]
        key = next((k for k in NOT_ON_WINDOWS if name == k or name.startswith(k + ".")), None)
        if key is not None:
            allowed.add(key)
        elif not _in_bundle(name):
            missing.add(name)
    for key in allowed:
        counterpart = NOT_ON_WINDOWS[key]
        if counterpart and not _in_bundle(counterpart):
            missing.add(counterpart)
    return sorted(missing)


def test_the_chat_path_finds_every_module_it_imports(chat_modules):
    missing = _missing(chat_modules)
    assert not missing, f"the chat path imports {len(missing)} modules the bundle lacks: {', '.join(missing)}"
    assert all("torch" in rec for rec in chat_modules.values())   # the head and its stage process


def test_the_app_path_finds_every_module_it_imports(app_modules):
    app_pid, node_pid, records = app_modules
    assert "PySide6.QtWidgets" in records[app_pid]
    assert "aiohttp" in records[node_pid]
    missing = _missing(records)
    assert not missing, f"the app path imports {len(missing)} modules the bundle lacks: {', '.join(missing)}"


def test_the_allowlist_is_all_used(chat_modules, app_modules):
    """NOT_ON_WINDOWS stays short: an entry no recorded module needs any more goes."""
    names = set()
    for rec in (*chat_modules.values(), *app_modules[2].values()):
        names |= set(rec)
    unused = [k for k in NOT_ON_WINDOWS if not any(n == k or n.startswith(k + ".") for n in names)]
    assert unused == []


def test_every_top_level_module_in_lib_is_imported(stage, chat_modules, app_modules):
    """A top-level module (lib/x.py) no package imports is a stray a wheel shipped beside
    its package (sympy's isympy.py, nvidia-ml-py's example.py): layout leaves those out."""
    imported = set()
    for rec in (*chat_modules.values(), *app_modules[2].values()):
        imported |= {n.split(".")[0] for n in rec}
    assert sorted(p.stem for p in LIB.glob("*.py") if p.stem not in imported) == []
