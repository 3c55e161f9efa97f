"""The app's side of enabling the GPU: whether to offer it (GpuOffer) and the dialog that
runs the install with a progress bar and a Cancel button (GpuEnableDialog).

Both are thin: the looking and the installing are app/gpu_enable.py's, run on a worker
thread (a child process imports torch, the network is slow), with results carried back
to the GUI thread as Qt signals.
"""

from __future__ import annotations

import html
import logging
import threading

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QProgressBar, QVBoxLayout

from . import gpu_enable as ge

log = logging.getLogger("potluck.app")


class GpuOffer(QObject):
    """Looks once, off the GUI thread: an NVIDIA GPU (NVML), a CPU build of torch (a
    `potluck gpu --check` child), then the download's size from the index."""

    offered = Signal(object)      # the menu's label, or None: nothing to offer

    def __init__(self, nvml=None, parent=None):
        super().__init__(parent)
        self.nvml = nvml
        self.gpu: ge.GpuInfo | None = None
        self.size: int | None = None
        self.thread: threading.Thread | None = None

    def start(self):
        self.thread = threading.Thread(target=self._look, daemon=True, name="gpu-offer")
        self.thread.start()

    def _look(self):
        try:
            gpu = ge.read_nvidia(self.nvml)
            if not gpu.names:
                self.offered.emit(None)
                return
            facts, err = ge.run_check()
            if not ge.should_offer(gpu, facts):
                log.info("no GPU offer: the engine's torch reports %s%s", facts, f" ({err})" if err and not facts else "")
                self.offered.emit(None)
                return
            self.gpu = gpu
            self.offered.emit(ge.offer_label())
            self.size = ge.estimate_size(gpu=gpu)
            if self.size:
                self.offered.emit(ge.offer_label(self.size))
        except Exception:  # looking must never take the app down; no offer is the safe answer
            log.warning("no GPU offer: looking failed", exc_info=True)
            self.offered.emit(None)


STAGES = {"resolve": "Finding the GPU version of Potluck's engine for this computer…",
          "unpack": "Unpacking…", "verify": "Checking that it sees your GPU…", "switch": "Switching over…",
          "done": "Done."}


class GpuEnableDialog(QDialog):
    succeeded = Signal(object)            # gpu_enable.Enabled
    _progress = Signal(str, object, object)
    _finished = Signal(object, object)    # (Enabled, None) or (None, error text)

    def __init__(self, gpu: ge.GpuInfo | None = None, size: int | None = None, parent=None):
        super().__init__(parent)
        self.gpu = gpu
        self.setWindowTitle("Enable the GPU")
        self.resize(560, 260)
        lay = QVBoxLayout(self)
        name = (gpu.names[0] if gpu and gpu.names else "your NVIDIA GPU")
        self.intro = QLabel(
            f"Potluck computes on the processor now. It can download the GPU version of its engine "
            f"({ge.format_size(size) if size else 'about 2.5 GB'}) from PyTorch's own site and use "
            f"<b>{html.escape(name)}</b> instead.<br><br>What Potluck uses now stays in place until the new version "
            "has been checked on this computer. A stopped download resumes where it stopped. "
            "Settings has the way back.")
        self.intro.setWordWrap(True)
        lay.addWidget(self.intro)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.hide()
        lay.addWidget(self.bar)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextSelectableByMouse)
        lay.addWidget(self.status, 1)
        self.buttons = QDialogButtonBox()
        self.start_button = self.buttons.addButton("Download and enable", QDialogButtonBox.AcceptRole)
        self.close_button = self.buttons.addButton(QDialogButtonBox.Cancel)
        self.start_button.clicked.connect(self.start)
        self.buttons.rejected.connect(self.reject)
        lay.addWidget(self.buttons)
        self._progress.connect(self._on_progress)
        self._finished.connect(self._on_finished)
        self.cancel = threading.Event()
        self.thread: threading.Thread | None = None
        self.result: ge.Enabled | None = None
        self.error: str | None = None

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self):
        if self.running:
            return
        self.cancel = threading.Event()
        self.result = self.error = None
        self.start_button.setEnabled(False)
        self.close_button.setText("Cancel")
        self.bar.show()
        self.bar.setValue(0)
        self.status.setText(STAGES["resolve"])
        self.thread = threading.Thread(target=self._work, daemon=True, name="gpu-enable")
        self.thread.start()

    def _work(self):
        try:
            done = ge.enable(progress=self._progress.emit, cancel=self.cancel, gpu=self.gpu)
        except ge.Cancelled:
            self._finished.emit(None, "")
        except ge.GpuEnableError as e:
            self._finished.emit(None, str(e))
        except Exception:  # anything else still ends in words and a working app
            log.exception("turning on the GPU failed")
            self._finished.emit(None, "Setting up the GPU stopped on something unexpected. Potluck goes on with "
                                      "what it used before; try again later, or send the log with a bug report.")
        else:
            self._finished.emit(done, None)

    def _on_progress(self, stage: str, done, total):
        if stage == "download":
            self.bar.setRange(0, 1000)
            self.bar.setValue(int(done * 1000 / total) if total else 0)
            self.status.setText(f"Downloading: {ge.format_size(done)} of {ge.format_size(total)}" if total
                                else f"Downloading: {ge.format_size(done)}")
        elif stage == "unpack":
            self.bar.setValue(int(done * 1000 / total) if total else 0)
            self.status.setText(STAGES["unpack"])
        elif stage in ("resolve", "verify", "switch"):
            self.bar.setRange(0, 0)   # busy: these steps have no byte count
            self.status.setText(STAGES[stage])
        elif stage == "done":
            self.bar.setRange(0, 1000)
            self.bar.setValue(1000)

    def _on_finished(self, done, error):
        self.thread = None
        self.bar.setRange(0, 1000)
        self.close_button.setText("Close")
        if done is not None:
            self.result = done
            self.bar.setValue(1000)
            self.status.setText(f"<b>The GPU is ready:</b> Potluck computes on "
                                f"{html.escape(done.device or 'the GPU')} (torch {html.escape(done.torch)}). "
                                "Potluck is restarting its engine "
                                "on it, so sharing and hosting use the GPU from now on."
                                + (f"<br>Not on the package index, so left out: "
                                   f"{html.escape(', '.join(done.skipped))}." if done.skipped else ""))
            self.succeeded.emit(done)
            return
        keeps = "the GPU build it had" if ge.installed() else "the CPU"
        self.start_button.setEnabled(True)
        self.start_button.setText("Try again")
        if error == "":
            self.error = "cancelled"
            self.status.setText(f"Stopped. What was downloaded is kept, so trying again resumes from there. "
                                f"Potluck keeps using {keeps}.")
        else:
            self.error = error
            self.status.setText(f"<span style='color:#b91c1c'>Enabling the GPU failed: {html.escape(error)}"
                                f"</span><br>Potluck keeps using {keeps}.")

    def reject(self):
        if self.running:          # Cancel stops the install; the dialog stays to say how it ended
            self.cancel.set()
            self.status.setText("Stopping…")
            return
        super().reject()

    def closeEvent(self, event):
        if self.running:
            self.cancel.set()
        super().closeEvent(event)
