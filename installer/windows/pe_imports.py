"""Which DLLs a Windows PE file (.exe, .dll, .pyd) needs, read from its headers alone.

    imports(path)        the DLL names of its import directory: the loader must find every
                         one of them, or the file does not load ("DLL load failed")
    delay_imports(path)  its delay-load imports: resolved on first call, not at load time
    unsatisfied(tree)    for each PE file under tree, the imports found neither in the tree
                         nor among Windows 10's system DLLs

Pure Python with no dependencies, so the Windows bundle can be checked on Linux without
wine (installer/windows/layout.py, tests/installer/test_windows_bundle.py). Every offset
is checked against the file's size: a malformed file raises ValueError, nothing is read
out of bounds.

    python installer/windows/pe_imports.py <tree>   prints what unsatisfied() finds
"""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

PE_SUFFIXES = (".pyd", ".dll", ".exe")

IMPORT_DIRECTORY, DELAY_IMPORT_DIRECTORY = 1, 13
_MAX_DESCRIPTORS = 4096          # a real file has tens; a malformed one could loop forever
_MAX_NAME = 512

# DLLs Windows 10 (1903 and later) carries in System32 that something in the bundle imports:
# the names that `python installer/windows/pe_imports.py build/windows/stage` reported as
# found nowhere in the tree (before layout.drop_unloadable), each then checked by hand to be
# a genuine Windows 10 system DLL, not a redistributable (the MSVC runtime, OpenSSL, ICU's
# own builds, OpenBLAS ship in the bundle); the comments say who imports them at the time of
# writing. api-ms-win-* and ext-ms-* (API sets the loader maps onto system DLLs) are
# matched by prefix.
WINDOWS_SYSTEM_DLLS = frozenset({
    # the core: every native file, CPython, Qt, torch, psutil, hf_xet, the launchers
    "kernel32.dll", "ntdll.dll", "user32.dll", "gdi32.dll", "advapi32.dll", "shell32.dll",
    "ole32.dll", "oleaut32.dll", "combase.dll", "rpcrt4.dll", "shlwapi.dll", "version.dll",
    "userenv.dll", "psapi.dll", "powrprof.dll", "setupapi.dll", "comdlg32.dll", "imm32.dll",
    "winmm.dll", "mpr.dll", "authz.dll", "netapi32.dll", "wtsapi32.dll", "propsys.dll",
    "pdh.dll",                 # psutil, hf_xet: performance counters
    "dbghelp.dll", "imagehlp.dll",     # torch's c10 (stack traces), libiomp5md
    "msvcrt.dll",              # the mingw-built launchers (Windows' own C runtime)
    # security and crypto: Qt's schannel backend, OpenSSL, CPython, cryptography's Rust
    "bcrypt.dll", "bcryptprimitives.dll", "ncrypt.dll", "crypt32.dll", "secur32.dll",
    "wintrust.dll",
    # networking: Qt Network, psutil, hf_xet, CPython's _socket
    "ws2_32.dll", "iphlpapi.dll", "dnsapi.dll", "winhttp.dll",
    # graphics and the desktop: Qt Gui, its windows/direct2d platform plugins, the C++ AMP
    # runtime (vcamp140.dll, in msvc-runtime and PySide6 / shiboken6)
    "d3d9.dll", "d3d11.dll", "d3d12.dll", "dxgi.dll", "d2d1.dll", "dwrite.dll",
    "d3dcompiler_47.dll", "dwmapi.dll", "uxtheme.dll", "mscms.dll", "uiautomationcore.dll",
    # ICU: Qt6Core uses the ICU Windows 10 carries (icuuc.dll since 1703, kept in 1903+)
    "icuuc.dll",
})

_API_SET_PREFIXES = ("api-ms-win-", "ext-ms-")


def is_system_dll(name: str) -> bool:
    n = name.lower()
    return n in WINDOWS_SYSTEM_DLLS or n.startswith(_API_SET_PREFIXES)


class _PE:
    """The parts of a PE image the import directories need, every read bounds-checked."""

    def __init__(self, f, size: int, where: str):
        self.f, self.size, self.where = f, size, where
        if self._read(0, 2) != b"MZ":
            raise self.bad("no MZ header")
        (pe,) = struct.unpack("<I", self._read(0x3C, 4))
        if self._read(pe, 4) != b"PE\0\0":
            raise self.bad("no PE signature")
        _, nsections, _, _, _, opt_size, _ = struct.unpack("<HHIIIHH", self._read(pe + 4, 20))
        opt = pe + 24
        (magic,) = struct.unpack("<H", self._read(opt, 2))
        if magic == 0x20B:                                   # PE32+
            base_at, base_fmt, count_at, dirs_at = 24, "<Q", 108, 112
        elif magic == 0x10B:                                 # PE32
            base_at, base_fmt, count_at, dirs_at = 28, "<I", 92, 96
        else:
            raise self.bad(f"unknown optional header magic {magic:#x}")
        if opt_size < dirs_at:
            raise self.bad("optional header too small")
        (self.image_base,) = struct.unpack(base_fmt, self._read(opt + base_at, struct.calcsize(base_fmt)))
        (self.headers_size,) = struct.unpack("<I", self._read(opt + 60, 4))   # SizeOfHeaders
        (ndirs,) = struct.unpack("<I", self._read(opt + count_at, 4))
        ndirs = min(ndirs, (opt_size - dirs_at) // 8, 16)
        self.dirs = [struct.unpack("<II", self._read(opt + dirs_at + 8 * i, 8)) for i in range(ndirs)]
        self.sections = []
        for i in range(nsections):
            s = self._read(opt + opt_size + 40 * i, 40)
            vsize, va, raw_size, raw_ptr = struct.unpack("<IIII", s[8:24])
            self.sections.append((va, max(vsize, raw_size), raw_ptr, raw_size))

    def bad(self, why: str) -> ValueError:
        return ValueError(f"{self.where}: not a valid PE file ({why})")

    def _read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise self.bad(f"{n} bytes at {offset:#x} lie outside the file's {self.size} bytes")
        self.f.seek(offset)
        data = self.f.read(n)
        if len(data) != n:
            raise self.bad(f"short read at {offset:#x}")
        return data

    def offset(self, rva: int) -> tuple[int, int]:
        """The file offset of rva, and how many bytes of its section's raw data follow it."""
        for va, vsize, raw_ptr, raw_size in self.sections:
            if va <= rva < va + vsize:
                delta = rva - va
                if delta >= raw_size:
                    raise self.bad(f"RVA {rva:#x} lies in a section's uninitialised part")
                return raw_ptr + delta, raw_size - delta
        if rva < min(self.headers_size, self.size):        # the headers are mapped as they are
            return rva, min(self.headers_size, self.size) - rva
        raise self.bad(f"RVA {rva:#x} lies in no section")

    def read_rva(self, rva: int, n: int) -> bytes:
        off, avail = self.offset(rva)
        if n > avail:
            raise self.bad(f"{n} bytes at RVA {rva:#x} run past their section")
        return self._read(off, n)

    def name_at(self, rva: int) -> str:
        off, avail = self.offset(rva)
        data = self._read(off, min(avail, _MAX_NAME, self.size - off))
        end = data.find(b"\0")
        if end <= 0:
            raise self.bad(f"no DLL name at RVA {rva:#x}")
        try:
            return data[:end].decode("ascii")
        except UnicodeDecodeError:
            raise self.bad(f"DLL name at RVA {rva:#x} is not ASCII") from None

    def directory(self, index: int, entry_size: int, name_field: int, delay: bool = False) -> list[str]:
        if index >= len(self.dirs):
            return []
        rva, size = self.dirs[index]
        if rva == 0:
            return []
        names = []
        for i in range(_MAX_DESCRIPTORS):
            entry = self.read_rva(rva + i * entry_size, entry_size)
            (name_rva,) = struct.unpack_from("<I", entry, name_field)
            # the list ends, as the loader reads it, at a descriptor with no name (an import
            # descriptor also at one with no import address table, FirstThunk at 16)
            if name_rva == 0 or (not delay and struct.unpack_from("<I", entry, 16)[0] == 0):
                return names
            if delay:
                (attributes,) = struct.unpack_from("<I", entry, 0)
                if not attributes & 1 and name_rva >= self.image_base:  # old VC6 form: a VA
                    name_rva -= self.image_base
            names.append(self.name_at(name_rva))
        raise self.bad(f"more than {_MAX_DESCRIPTORS} import descriptors")


def _open(path: Path, index: int) -> list[str]:
    path = Path(path)
    with open(path, "rb") as f:
        pe = _PE(f, os.fstat(f.fileno()).st_size, str(path))
        if index == IMPORT_DIRECTORY:       # IMAGE_IMPORT_DESCRIPTOR: 20 bytes, Name at 12
            return pe.directory(index, 20, 12)
        return pe.directory(index, 32, 4, delay=True)   # ImgDelayDescr: 32 bytes, DllName at 4


def imports(path: Path) -> list[str]:
    """The DLL names in path's import directory (data directory 1), in file order."""
    return _open(path, IMPORT_DIRECTORY)


def delay_imports(path: Path) -> list[str]:
    """The DLL names in path's delay-load import directory (data directory 13)."""
    return _open(path, DELAY_IMPORT_DIRECTORY)


def pe_files(tree: Path) -> list[Path]:
    return sorted(p for p in Path(tree).rglob("*") if p.is_file() and p.suffix.lower() in PE_SUFFIXES)


def unsatisfied(tree: Path) -> dict[str, list[str]]:
    """{relative path of each .pyd/.dll/.exe under tree: its imports that are neither a file
    anywhere in tree (a case-insensitive match of the base name) nor a Windows system DLL}.
    Only load-time imports count: a delay-loaded DLL is looked for when first called."""
    tree = Path(tree)
    present = {p.name.lower() for p in tree.rglob("*") if p.is_file()}
    missing = {}
    for p in pe_files(tree):
        lost = [n for n in imports(p) if n.lower() not in present and not is_system_dll(n)]
        if lost:
            missing[p.relative_to(tree).as_posix()] = lost
    return missing


if __name__ == "__main__":
    for rel, names in unsatisfied(Path(sys.argv[1])).items():
        print(f"{rel}: {', '.join(names)}")
