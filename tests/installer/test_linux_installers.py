"""The Linux installers in dist/ (`make installers`) install a Potluck that answers on a
machine with nothing of ours on it: an empty home, no virtualenv or checkout on PATH or
PYTHONPATH, no network for models (HF_HUB_OFFLINE=1).

Run by `make installers-test` (it builds them first); skipped when dist/ holds none,
because building the bundle takes longer than the rest of the suite."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.installers

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
DEB = sorted(DIST.glob("potluck_*_amd64.deb"))
RUN = sorted(DIST.glob("potluck-*-linux-x86_64.run"))
QUESTION = "What is the capital of France?"


def clean_env(home: Path) -> dict:
    """What a fresh user session has: no venv, no checkout, nothing of the test run."""
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "HF_HUB_OFFLINE": "1", "QT_QPA_PLATFORM": "offscreen", "TQDM_DISABLE": "1"}
    if "TMPDIR" in os.environ:
        env["TMPDIR"] = os.environ["TMPDIR"]
    return env


def run(cmd, home: Path, timeout=900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(home), cwd=str(home), **kw)


@pytest.mark.skipif(not DEB, reason="no .deb in dist/ (make installers)")
def test_the_deb_declares_what_it_needs_and_installs_a_working_potluck(tmp_path):
    deb = DEB[-1]
    fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Architecture", "Depends"],
                            capture_output=True, text=True, check=True).stdout
    assert "Package: potluck" in fields and "Architecture: amd64" in fields
    assert "libxcb-cursor0" in fields   # Qt 6.5+ will not start on xcb without it
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    assert os.readlink(root / "usr/bin/potluck") == "/opt/potluck/potluck"
    entry = (root / "usr/share/applications/potluck.desktop").read_text()
    assert "Exec=/opt/potluck/potluck app %u" in entry and "x-scheme-handler/potluck" in entry
    assert (root / "usr/share/icons/hicolor/scalable/apps/potluck.svg").is_file()
    home = tmp_path / "home"
    home.mkdir()
    exe = root / "opt/potluck/potluck"
    p = run([exe, "--version"], home, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().startswith("potluck "), p.stdout + p.stderr
    png = home / "menu.png"
    p = run([exe, "app", "--screenshot", png], home, timeout=300)
    assert p.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", p.stderr[-2000:]


@pytest.mark.skipif(not RUN, reason="no .run in dist/ (make installers)")
def test_the_run_installer_installs_for_one_user_answers_updates_and_uninstalls_keeping_data(tmp_path):
    installer = RUN[-1]
    home = tmp_path / "home"
    home.mkdir()
    env = {"POTLUCK_NO_LAUNCH": "1"}
    p = subprocess.run(["sh", str(installer)], capture_output=True, text=True, timeout=900,
                       env={**clean_env(home), **env}, cwd=str(home))
    assert p.returncode == 0 and "Done." in p.stdout, p.stdout + p.stderr
    dest = home / ".local/opt/potluck"
    link = home / ".local/bin/potluck"
    entry = home / ".local/share/applications/potluck.desktop"
    assert os.readlink(link) == str(dest / "potluck")
    assert f"Exec={dest}/potluck app %u" in entry.read_text()

    # the default model ships inside: the first question is answered offline
    p = run([link, "chat", "--stages", "2", "--max-tokens", "24", "--temperature", "0",
             "--once", QUESTION], home)
    assert p.returncode == 0 and "Paris" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    data = home / ".local/share/potluck"
    (data / "keep-me").parent.mkdir(parents=True, exist_ok=True)
    (data / "keep-me").write_text("a friend's invite")

    # running it again updates in place; the data folder is not the installer's to touch
    p = subprocess.run(["sh", str(installer)], capture_output=True, text=True, timeout=900,
                       env={**clean_env(home), **env}, cwd=str(home))
    assert p.returncode == 0 and not (home / ".local/opt/potluck.old").exists()
    assert (data / "keep-me").read_text() == "a friend's invite"

    p = run(["sh", dest / "uninstall.sh"], home, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not dest.exists() and not link.is_symlink() and not entry.exists()
    assert (data / "keep-me").is_file()   # uninstalling is not forgetting
    assert "--purge" in p.stdout


@pytest.mark.skipif(not RUN or shutil.which("xz") is None, reason="no .run in dist/")
def test_a_damaged_download_changes_nothing(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    data = RUN[-1].read_bytes()
    cut = tmp_path / "potluck-cut.run"
    cut.write_bytes(data[: len(data) // 2])   # a download that stopped half way
    p = subprocess.run(["sh", str(cut)], capture_output=True, text=True, timeout=600,
                       env={**clean_env(home), "POTLUCK_NO_LAUNCH": "1"}, cwd=str(home))
    assert p.returncode != 0 and "Nothing was changed" in p.stderr
    assert not (home / ".local/opt/potluck").exists() and not (home / ".local/opt/potluck.new").exists()


@pytest.mark.skipif(not DEB or os.geteuid() != 0 or shutil.which("dpkg") is None
                    or subprocess.run(["dpkg", "-s", "potluck"], capture_output=True).returncode == 0,
                    reason="installing a .deb for real needs root (and no potluck installed already)")
def test_the_deb_installs_with_dpkg_and_removing_it_leaves_nothing(tmp_path):
    # the Depends are checked too: a machine without Qt's libraries would refuse it here
    p = subprocess.run(["dpkg", "-i", str(DEB[-1])], capture_output=True, text=True, timeout=600)
    try:
        assert p.returncode == 0, p.stdout + p.stderr
        home = tmp_path / "home"
        home.mkdir()
        p = run(["potluck", "--version"], home, timeout=120)   # found on the plain PATH
        assert p.returncode == 0 and p.stdout.startswith("potluck "), p.stderr
    finally:
        r = subprocess.run(["dpkg", "--purge", "potluck"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for left in ("/opt/potluck", "/usr/bin/potluck", "/usr/share/applications/potluck.desktop",
                 "/usr/share/icons/hicolor/scalable/apps/potluck.svg"):
        assert not os.path.lexists(left), f"{left} is left behind"
