"""A Windows 10 user's machine, as near as Debian's wine 8 gets: a fresh 64-bit prefix
whose user name has a space and accents (C:\\users\\José Núñez), plus three test-only
stand-ins for system DLLs that Windows 10 has and wine 8 lacks (testkit/wine/*.c, built
here with mingw-w64 and copied into the prefix's system32, never into the program):

  * VERSION.dll that patches ucrtbase's unimplemented complex-math stubs (numpy, torch);
  * bcryptprimitives.dll!ProcessPrng (every Rust extension: tokenizers, safetensors, …);
  * icuuc.dll with no converters (Qt6Core imports it).

and the settings wine needs to run them: WMI off (`platform` aborts in wbemprox),
OpenMP's affinity query off (KMP_AFFINITY), Qt's variables in HKCU\\Environment (wine does
not pass QT_* from Linux). Output must go through pipes: wine 8 gives the embedded Python
"Invalid handle" for a file.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import threading
from pathlib import Path

SRC = Path(__file__).resolve().parent / "wine"
USER = "José Núñez"
# what each stand-in is built from, and what it links
STANDINS = {
    "version.dll": (["ucrt_complex.c", "version.def"], ["-lm"]),
    "bcryptprimitives.dll": (["bcryptprimitives.c"], ["-ladvapi32"]),
    "icuuc.dll": (["icuuc.c"], []),
}
OVERRIDES = "mscoree,mshtml=;version=n,b;wbemprox=d"
GCC = "x86_64-w64-mingw32-gcc"
FONTS = "/usr/share/fonts/truetype/dejavu"   # fonts-dejavu-core, which make setup installs for Qt


def available() -> str | None:
    """None when this machine can run the harness, else what it lacks."""
    for tool in ("wine", "wineserver", GCC):
        if shutil.which(tool) is None:
            return f"no {tool} (installer/build-windows.sh installs wine and mingw-w64)"
    return None


def build_standins(dest: Path) -> dict[str, Path]:
    """The stand-in DLLs, compiled into dest (again only when their sources changed)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for dll, (sources, libs) in STANDINS.items():
        paths = [SRC / s for s in sources]
        key = hashlib.sha256(b"".join(p.read_bytes() for p in paths)).hexdigest()[:16]
        target = dest / key / dll
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([GCC, "-O2", "-s", "-shared", "-static-libgcc", "-o", str(target),
                            *map(str, paths), *libs], check=True, capture_output=True)
        out[dll] = target
    return out


class Wine:
    def __init__(self, base: Path, standins: dict[str, Path]):
        self.base = base
        self.home = base / "home"
        self.home.mkdir(parents=True)
        self.prefix = base / "prefix"
        self.standins = standins
        self.env = {"HOME": str(self.home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                    "USER": USER, "LOGNAME": USER, "WINEPREFIX": str(self.prefix), "WINEARCH": "win64",
                    "WINEDEBUG": "-all", "WINEDLLOVERRIDES": OVERRIDES, "HF_HUB_OFFLINE": "1",
                    "KMP_AFFINITY": "disabled", "DISPLAY": ""}
        self.run(["wineboot", "--init"], timeout=300)
        self.user = self.prefix / "drive_c/users" / USER
        assert self.user.is_dir(), sorted(p.name for p in (self.prefix / "drive_c/users").iterdir())
        self.local = self.user / "AppData/Local"
        self.roaming = self.user / "AppData/Roaming"
        self.dir = self.local / "Programs/Potluck"
        system32 = self.prefix / "drive_c/windows/system32"
        for name, path in standins.items():
            shutil.copy2(path, system32 / name)
        # fonts, as every Windows has: Qt's offscreen platform reads them from a folder
        # (QT_QPA_FONTDIR), and the prefix has none it can use (the screenshots were boxes)
        fonts = self.prefix / "drive_c/windows/Fonts"
        fonts.mkdir(parents=True, exist_ok=True)
        for ttf in sorted(Path(FONTS).glob("*.ttf")):
            shutil.copy2(ttf, fonts / ttf.name)
        # Qt reads its settings from the Windows environment, which wine builds from the registry
        for k, v in {"QT_QPA_PLATFORM": "offscreen", "QT_OPENGL": "software",
                     "QT_QPA_FONTDIR": r"C:\windows\Fonts"}.items():
            self.run(["wine", "reg", "add", r"HKCU\Environment", "/v", k, "/d", v, "/f"])

    def run(self, cmd, timeout=600, env=None, wait=True) -> subprocess.CompletedProcess:
        # stdout must be a pipe: the embedded Python under wine 8 refuses a file ("Invalid handle")
        p = subprocess.run([str(c) for c in cmd], capture_output=True, encoding="utf-8", errors="replace",
                           timeout=timeout, env={**self.env, **(env or {})}, cwd=str(self.home))
        if wait:
            self.wait()
        return p

    def popen(self, cmd, env=None, log: Path | None = None) -> subprocess.Popen:
        """A program left running. With `log`, a thread drains its output into that file
        as it comes: a pipe that nobody reads while the program runs fills at 64 KiB and
        then blocks it (and a file instead of the pipe the embedded Python refuses)."""
        p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, encoding="utf-8", errors="replace",
                             env={**self.env, **(env or {})}, cwd=str(self.home))
        if log is not None:
            def drain():
                with open(log, "w", encoding="utf-8") as f:
                    for line in p.stdout:
                        f.write(line)
                        f.flush()

            threading.Thread(target=drain, daemon=True).start()
        return p

    def wait(self, timeout: float = 600):
        """Until every process in the prefix has ended (the uninstaller re-launches itself)."""
        subprocess.run(["wineserver", "-w"], env=self.env, timeout=timeout)

    def kill_all(self):
        subprocess.run(["wineserver", "-k"], env=self.env, timeout=60)

    def reg(self, key: str) -> dict[str, str] | None:
        """The key's string and number values by name ("" is the default value); None
        when there is no such key. Read from `reg export` (UTF-16): `reg query` prints in
        the console's code page, where José Núñez's accents are lost."""
        out = self.base / "export.reg"
        out.unlink(missing_ok=True)
        p = self.run(["wine", "reg", "export", key, self.win_path(out), "/y"])
        if p.returncode != 0 or not out.exists():
            return None
        return parse_reg_section(out.read_bytes().decode("utf-16"), key)

    def merge_user_classes(self, name: str):
        """Windows reads HKEY_CLASSES_ROOT as the user's classes (HKCU\\Software\\Classes)
        over the machine's; wine 8 reads only the machine's, so a per-user URL handler (what
        our installer registers) is invisible to its ShellExecute. This copies the user's
        class, as the installer wrote it, into the machine's view."""
        out = self.base / "classes.reg"
        out.unlink(missing_ok=True)
        # wait=False: the app runs meanwhile, and `wineserver -w` would wait for it too
        p = self.run(["wine", "reg", "export", rf"HKCU\Software\Classes\{name}", self.win_path(out), "/y"],
                     wait=False)
        assert p.returncode == 0, p.stderr
        text = out.read_bytes().decode("utf-16").replace("[HKEY_CURRENT_USER\\Software\\Classes\\",
                                                         "[HKEY_LOCAL_MACHINE\\Software\\Classes\\")
        out.write_bytes(("\ufeff" + text).encode("utf-16-le"))
        p = self.run(["wine", "reg", "import", self.win_path(out)], wait=False)
        assert p.returncode == 0, p.stderr

    @staticmethod
    def win_path(p: Path) -> str:
        return "Z:" + str(p).replace("/", "\\")

    def leaked(self, tree: Path) -> list[str]:
        """Files under tree that are one of the stand-ins (by name or by content)."""
        digests = {hashlib.sha256(p.read_bytes()).digest() for p in self.standins.values()}
        names = {n.lower() for n in self.standins}
        found = []
        for f in tree.rglob("*"):
            if f.is_file() and (f.name.lower() in names or (
                    f.suffix.lower() == ".dll" and hashlib.sha256(f.read_bytes()).digest() in digests)):
                found.append(str(f.relative_to(tree)))
        return found


HIVES = {"HKCU": "HKEY_CURRENT_USER", "HKLM": "HKEY_LOCAL_MACHINE"}


def parse_reg_section(text: str, key: str) -> dict[str, str]:
    """The values of exactly `key` in a .reg export (its subkeys are other sections)."""
    hive, _, rest = key.partition("\\")
    want = f"[{HIVES.get(hive, hive)}\\{rest}]".lower()
    values: dict[str, str] = {}
    inside = False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            inside = line.lower() == want
            continue
        if not inside or "=" not in line:
            continue
        if line.startswith("@="):
            name, raw = "", line[2:]
        else:
            end = line.index('"=', 1)
            name, raw = line[1:end], line[end + 2:]
        if raw.startswith('"'):
            values[name] = raw[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        elif raw.startswith("dword:"):
            values[name] = str(int(raw[6:], 16))
        else:
            values[name] = raw
    return values
