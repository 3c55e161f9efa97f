"""The app's GPU offer, offscreen: the tray's "Enable GPU" item appears only with an
NVIDIA GPU (a faked pynvml, the one thing that cannot exist here) next to a CPU build of
torch (a real `potluck gpu --check` child), and its dialog runs the real install against
the loopback index (testkit/pyindex.py), through success, failure and Cancel. Settings
goes back to the CPU build."""

from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
pytest.importorskip("pytestqt")

from packaging.tags import sys_tags  # noqa: E402
from packaging.version import Version  # noqa: E402

from app import gpu_enable as ge  # noqa: E402
from testkit.fake_nvml import fake_nvml  # noqa: E402
from testkit.pyindex import SimpleIndex, build_wheel, stand_in_torch  # noqa: E402

WAIT_MS = 60_000          # a child imports torch; generous for a busy 2-core machine
CUDA_BUILD = f"{Version(importlib.metadata.version('torch')).public}+cu999"
TAG = str(next(t for t in sys_tags() if t.interpreter.startswith("cp") and t.abi.startswith("cp")))


@pytest.fixture
def index(tmp_path, monkeypatch):
    ix = SimpleIndex()
    ix.torch = ix.add(stand_in_torch(tmp_path / "w", CUDA_BUILD, TAG, pad=600_000,
                                     requires=["nvidia-standin-runtime; platform_system == 'Linux'"]))
    ix.add(build_wheel(tmp_path / "w", "nvidia-standin-runtime", "1.0.0", {"nvidia/standin/__init__.py": ""}))
    with ix:
        monkeypatch.setenv(ge.ENV_INDEX, ix.url)
        yield ix


@pytest.fixture
def shell(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    monkeypatch.delenv("POTLUCK_GPU_OVERLAY", raising=False)
    monkeypatch.delenv(ge.ENV_INDEX, raising=False)
    from app.controller import Controller
    from app.settings import Settings
    from app.store import History
    from app.tray import Shell

    c = Controller(Settings(host_on_start=False), history=History(None, keep=False))
    c.restarts = 0

    def restart():
        c.restarts += 1
        return True

    c.restart = restart          # the node's own restart is test_app_gui's; here: that it is asked for
    s = Shell(c, use_tray=False)
    yield s
    s.close()
    qtbot.wait(10)   # the deleteLater()s run
    c.shutdown()


def looked(qtbot, shell, nvml):
    offer = shell.look_for_gpu(nvml)
    qtbot.waitUntil(lambda: not offer.thread.is_alive(), timeout=WAIT_MS)
    qtbot.wait(50)   # the queued signals reach the GUI thread
    return offer


def test_the_menu_offers_the_gpu_only_with_an_nvidia_gpu_and_a_cpu_build(qtbot, shell, index, tmp_path):
    assert not shell.gpu_action.isVisible() and shell.gpu_action in shell.menu.actions()
    looked(qtbot, shell, fake_nvml(init_error=OSError("NVML Shared Library Not Found")))
    assert not shell.gpu_action.isVisible()
    looked(qtbot, shell, fake_nvml(names=()))
    assert not shell.gpu_action.isVisible()

    offer = looked(qtbot, shell, fake_nvml())
    size = sum(len(f.data) for f in index.files.values())
    assert shell.gpu_action.isVisible() and offer.size == size
    assert shell.gpu_action.text() == f"Enable GPU (downloads {ge.format_size(size)})"
    # the size came from HEAD requests and metadata: no wheel was downloaded to find it
    assert not [s for s in index.log if s.method == "GET" and s.path.endswith(".whl")]

    # with the CUDA build already switched on, there is nothing to offer
    ge.enable(extras=[], gpu=offer.gpu)
    looked(qtbot, shell, fake_nvml())
    assert not shell.gpu_action.isVisible()


def test_the_dialog_enables_the_gpu_and_the_engine_restarts_on_it(qtbot, shell, index, tmp_path):
    offer = looked(qtbot, shell, fake_nvml())
    d = shell.open_gpu()
    assert "NVIDIA GeForce RTX 3060" in d.intro.text() and f"({ge.format_size(offer.size)})" in d.intro.text()
    qtbot.mouseClick(d.start_button, qtbot_left())
    qtbot.waitUntil(lambda: d.result is not None or d.error is not None, timeout=WAIT_MS)
    assert d.error is None and d.result.torch == CUDA_BUILD
    assert "The GPU is ready" in d.status.text() and "Stand-in GPU" in d.status.text()
    assert d.bar.value() == d.bar.maximum() and d.close_button.text() == "Close"
    assert shell.c.restarts == 1 and not shell.gpu_action.isVisible()
    facts, _ = ge.run_check()
    assert facts["torch"] == CUDA_BUILD and facts["overlay"] == str(tmp_path / "home" / "gpu" / "site")


def test_a_failed_install_says_why_and_that_the_cpu_stays(qtbot, shell, index, tmp_path):
    index.fault(index.torch, corrupt=True, times=1)
    looked(qtbot, shell, fake_nvml())
    d = shell.open_gpu()
    d.start()
    qtbot.waitUntil(lambda: d.result is not None or d.error is not None, timeout=WAIT_MS)
    assert "sha256" in d.error and "Potluck keeps using the CPU" in d.status.text()
    assert d.start_button.isEnabled() and d.start_button.text() == "Try again"
    assert shell.c.restarts == 0 and shell.gpu_action.isVisible()
    assert ge.installed() is None
    # the fault was one request's: trying again works
    d.start()
    qtbot.waitUntil(lambda: d.result is not None or d.error is not None, timeout=WAIT_MS)
    assert d.result is not None and shell.c.restarts == 1


def test_cancel_stops_the_install_and_keeps_the_cpu(qtbot, shell, index, tmp_path):
    looked(qtbot, shell, fake_nvml())
    d = shell.open_gpu()
    index.gate.clear()               # the install waits on the index's first answer…
    d.start()
    d.reject()                       # …while Cancel is pressed
    assert d.isVisible() and d.status.text() == "Stopping…"
    index.gate.set()
    qtbot.waitUntil(lambda: d.error is not None, timeout=WAIT_MS)
    assert d.error == "cancelled" and "resumes" in d.status.text() and "keeps using the CPU" in d.status.text()
    assert ge.installed() is None and not (tmp_path / "home" / "gpu" / "site").exists()
    d.reject()
    assert not d.isVisible()


def test_settings_goes_back_to_the_cpu_build(qtbot, shell, index, tmp_path):
    from app.settings_dialog import SettingsDialog

    d = SettingsDialog(shell.c)
    qtbot.addWidget(d)
    assert not d.cpu_button.isVisibleTo(d) and "installed with" in d.torch_label.text()
    ge.enable(extras=[], gpu=ge.GpuInfo(["x"]))
    d = SettingsDialog(shell.c)
    qtbot.addWidget(d)
    assert d.cpu_button.isVisibleTo(d) and CUDA_BUILD in d.torch_label.text()
    qtbot.mouseClick(d.cpu_button, qtbot_left())
    assert ge.installed() is None and shell.c.restarts == 1 and "processor again" in d.torch_label.text()
    assert not (tmp_path / "home" / "gpu" / "site").exists()
    facts, _ = ge.run_check()
    assert facts["overlay"] is None and facts["cuda_available"] is False


def qtbot_left():
    from PySide6.QtCore import Qt

    return Qt.LeftButton
