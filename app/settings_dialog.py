"""Settings: chat history, starting at sign-in, the Hugging Face token, the sharing
limits and which torch computes. Thin: the limits are the node's to apply."""

from __future__ import annotations

from PySide6.QtWidgets import (QCheckBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout, QGroupBox, QLabel,
                               QLineEdit, QMessageBox, QPushButton, QSpinBox, QVBoxLayout)

from . import autostart, gpu_enable


class SettingsDialog(QDialog):
    def __init__(self, controller, parent=None):
        super().__init__(parent)
        self.c = controller
        s = controller.settings
        lim = s.limits
        self.setWindowTitle("Potluck settings")
        lay = QVBoxLayout(self)
        chat = QGroupBox("Chat")
        cf = QFormLayout(chat)
        self.keep_history = QCheckBox("Keep chat history on this computer")
        self.keep_history.setChecked(s.keep_history)
        cf.addRow(self.keep_history)
        self.delete_all = QPushButton("Delete all history")
        self.delete_all.clicked.connect(self._delete_all)
        cf.addRow(self.delete_all)
        self.host_on_start = QCheckBox("Host the default model when Potluck starts")
        self.host_on_start.setChecked(s.host_on_start)
        cf.addRow(self.host_on_start)
        self.autostart = QCheckBox("Start Potluck when I sign in")
        self.autostart.setChecked(autostart.is_enabled())
        cf.addRow(self.autostart)
        self.hf_token = QLineEdit()
        self.hf_token.setEchoMode(QLineEdit.Password)
        self.hf_token.setPlaceholderText("for gated models only")
        self.hf_token.setToolTip("Only models whose makers ask you to accept their licence need it; it is "
                                 "kept in the system's keyring")
        cf.addRow("Hugging Face token:", self.hf_token)
        lay.addWidget(chat)
        share = QGroupBox("Sharing with friends")
        sf = QFormLayout(share)
        import socket

        self.display_name = QLineEdit(s.display_name)
        self.display_name.setMaxLength(64)
        self.display_name.setPlaceholderText(socket.gethostname()[:40])   # what friends see unless set
        self.display_name.setToolTip("What your friends' Potluck shows when this computer joins them "
                                     "(from the next time it joins)")
        sf.addRow("Your name, as friends see it:", self.display_name)
        self.vram_cap = QSpinBox()
        self.vram_cap.setRange(0, 1_000_000)
        self.vram_cap.setSuffix(" MB")
        self.vram_cap.setSpecialValueText("no cap")
        self.vram_cap.setValue(int(lim.get("vram_cap_mb") or 0))
        # it also bounds what this computer hosts: a tester capped it for sharing and then
        # read "your group has 4.2 GB" in the Host window on a 24 GB machine, unexplained
        self.vram_cap.setToolTip("The most memory Potluck takes on this computer: for a friend's model it "
                                 "shares in, and for the models it hosts itself")
        sf.addRow("GPU memory Potluck may use:", self.vram_cap)
        self.temp_pause = QDoubleSpinBox()
        self.temp_pause.setRange(40, 110)
        self.temp_pause.setSuffix(" °C")
        self.temp_pause.setValue(lim.get("temp_pause_c") or 83)
        self.temp_resume = QDoubleSpinBox()
        self.temp_resume.setRange(30, 105)
        self.temp_resume.setSuffix(" °C")
        self.temp_resume.setValue(lim.get("temp_resume_c") or 75)
        sf.addRow("Pause when the GPU reaches:", self.temp_pause)
        sf.addRow("Resume below:", self.temp_resume)
        self.other = QCheckBox("Pause while another program (a game) uses the GPU heavily")
        self.other.setChecked(bool(lim.get("pause_for_other_processes", True)))
        sf.addRow(self.other)
        # a computer without an NVIDIA GPU (the node's reading; unknown until it answers):
        # the cap holds its memory instead, and the GPU's temperature and games do not apply
        if (controller.status.get("gpu") or {}).get("available") is False:
            sf.labelForField(self.vram_cap).setText("Memory Potluck may use:")
            for row in (self.temp_pause, self.temp_resume, self.other):
                sf.setRowVisible(row, False)
        self.idle = QCheckBox("Share only while I am away from this computer")
        self.idle.setChecked(bool(lim.get("only_when_idle")))
        sf.addRow(self.idle)
        lay.addWidget(share)
        compute = QGroupBox("Computing")
        gl = QVBoxLayout(compute)
        self.torch_label = QLabel("")
        self.torch_label.setWordWrap(True)
        gl.addWidget(self.torch_label)
        self.cpu_button = QPushButton("Stop using the GPU")
        self.cpu_button.setToolTip("Goes back to the processor-only engine Potluck was installed with and deletes "
                                   "the GPU version it downloaded; the engine restarts")
        self.cpu_button.clicked.connect(self._use_cpu)
        gl.addWidget(self.cpu_button)
        lay.addWidget(compute)
        self._show_torch()
        self.error = QLabel("")
        self.error.setStyleSheet("color: #b91c1c;")
        lay.addWidget(self.error)
        buttons = QDialogButtonBox(QDialogButtonBox.Save | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.save)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)

    def _show_torch(self):
        version = gpu_enable.installed()
        self.cpu_button.setVisible(version is not None)
        self.torch_label.setText(
            f"Potluck computes on your NVIDIA GPU, with the GPU version of its engine it downloaded "
            f"(torch {version})." if version else
            "Potluck computes with the engine it was installed with. With an NVIDIA GPU, “Enable GPU” in the "
            "Potluck menu downloads the GPU version (or run `potluck gpu --enable`).")

    def _use_cpu(self):
        try:
            gpu_enable.disable()
        except gpu_enable.GpuEnableError as e:
            self.error.setText(str(e))
            return
        self._show_torch()
        self.torch_label.setText("Potluck computes on the processor again; the engine restarts.")
        self.c.restart()

    def _delete_all(self):
        if QMessageBox.question(self, "Delete all history",
                                "Delete every conversation? This cannot be undone.") == QMessageBox.Yes:
            self.c.delete_history()
            self.delete_all.setText("All chat history was deleted")
            self.delete_all.setEnabled(False)

    def save(self):
        if self.temp_resume.value() >= self.temp_pause.value():
            self.error.setText("The resume temperature must be below the pause temperature.")
            return
        s = self.c.settings
        s.display_name = " ".join(self.display_name.text().split())
        s.keep_history = self.keep_history.isChecked()
        s.host_on_start = self.host_on_start.isChecked()
        s.limits.update(vram_cap_mb=float(self.vram_cap.value()) or None, temp_pause_c=self.temp_pause.value(),
                        temp_resume_c=self.temp_resume.value(), pause_for_other_processes=self.other.isChecked(),
                        only_when_idle=self.idle.isChecked())
        s.save()
        if self.autostart.isChecked() != autostart.is_enabled():
            try:
                autostart.enable() if self.autostart.isChecked() else autostart.disable()
            except OSError as e:
                why = e.strerror or "the system refused"
                self.error.setText(f"Could not change starting at sign-in ({why.lower()}): check that your "
                                   "account may write its own settings folders, then try again.")
                return
        self.c.history.set_keep(s.keep_history)
        if self.hf_token.text():
            from .secrets_store import set_secret

            set_secret("hf_token", self.hf_token.text())
        self.c.set_limits(s.limits)
        self.accept()
