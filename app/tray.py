"""The tray icon, its menu, and the shell that ties the windows to the controller.

Everything important sits in the context menu: on Linux, clicks other than the one
that opens the menu may never reach the app. Where no tray exists (stock GNOME) the
chat window opens instead, with the same actions in its menu bar.
"""

from __future__ import annotations

from PySide6.QtCore import QObject
from PySide6.QtGui import QAction, QIcon
from PySide6.QtWidgets import QApplication, QMenu, QSystemTrayIcon

from . import paths
from .chat import ChatWindow
from .dialogs import HostDialog
from .join_dialog import JoinDialog
from .settings_dialog import SettingsDialog
from .status_dialog import StatusDialog
from .gpu_dialog import GpuEnableDialog, GpuOffer
from .gpu_enable import offer_label
from .pipeline_text import tokens_written

STATES = ("idle", "loading", "sharing", "serving", "paused", "error")


def state_icon(state: str) -> QIcon:
    name = state if state in STATES else "idle"
    path = paths.assets_dir() / f"tray-{name}.svg"
    return QIcon(str(path)) if path.exists() else QIcon(str(paths.assets_dir() / "potluck.svg"))


# the node's state, as the tray's first line says it
# ("idle" is no model running: "ready" read as if the chat answered)
TIP_WORDS = {"idle": "no model running", "loading": "starting", "sharing": "sharing", "serving": "hosting",
             "paused": "sharing paused", "error": "something went wrong"}


def tooltip(st: dict) -> str:
    state = st.get("state", "loading")
    lines = [f"Potluck — {TIP_WORDS.get(state, state)}"]
    if st.get("error"):
        lines.append(st["error"][:120])
    h = st.get("hosting")
    if h:
        lines.append(f"Hosting {h['model']}; {tokens_written(h.get('tokens_served', 0))}")
    elif st.get("loading"):
        lines.append((st["loading"].get("message") or "Loading…")[:120])
    sh = st.get("sharing") or {}
    if sh.get("on"):
        if sh.get("paused"):
            lines.append(f"Sharing paused: {sh.get('reason')}")
        elif sh.get("layers") and not sh.get("connected"):
            lines.append("Sharing: your friend's computer is not connected now")
        elif sh.get("layers"):
            a, b = sh["layers"]
            lines.append(f"Sharing: {b - a} layers of a friend's model on "
                         f"{sh.get('device_name') or sh.get('device') or '?'}")
        else:
            lines.append("Sharing: waiting for a friend to use it")
    gpu = st.get("gpu") or {}
    if gpu.get("gpus"):
        g = gpu["gpus"][0]
        lines.append(f"GPU {g['utilization_pct']:.0f}% · {g['temperature_c']:.0f} °C")
    elif gpu.get("message"):
        lines.append("No NVIDIA GPU: computing on the processor")
    return "\n".join(lines)


def has_gpu(st: dict) -> bool | None:
    """Whether the node found an NVIDIA GPU here; None until it has looked."""
    gpu = (st or {}).get("gpu") or {}
    if gpu.get("gpus"):
        return True
    return False if gpu.get("message") not in (None, "not read yet") else None


def share_news(st: dict) -> str:
    """What switching sharing on did, for the person who ticked it."""
    sh = st.get("sharing") or {}
    if sh.get("paused"):
        return f"Sharing is on but paused: {sh.get('reason')}."
    if has_gpu(st) is False:
        what = ("No NVIDIA graphics card was found, so a friend's share of the model would run on this "
                "computer's processor (slower).")
    else:
        what = f"{sh.get('device_name') or 'This computer'} is offered to your friend."
    return (f"Sharing is on. {what} To take part, paste your friend's invite code into “Join with invite "
            "code…” (Status shows this computer's address, for a host who adds it by hand).")


class Shell(QObject):
    """Actions, tray, chat window and dialogs around one Controller."""

    def __init__(self, controller, use_tray: bool | None = None, parent=None):
        super().__init__(parent)
        self.c = controller
        self.share_action = QAction("Share this GPU", self, checkable=True)
        self.share_action.toggled.connect(self._share_toggled)
        self.chat_action = QAction("Open chat", self, triggered=self.open_chat)
        self.host_action = QAction("Host a model…", self, triggered=self.open_host)
        self.join_action = QAction("Join with invite code…", self, triggered=self.open_join)
        self.status_action = QAction("Status", self, triggered=self.open_status)
        self.settings_action = QAction("Settings", self, triggered=self.open_settings)
        self.quit_action = QAction("Quit", self, triggered=self.quit)
        # shown only once look_for_gpu() finds an NVIDIA GPU next to a CPU build of torch
        self.gpu_action = QAction(offer_label(), self, triggered=self.open_gpu)
        self.gpu_action.setVisible(False)
        self.gpu_offer: GpuOffer | None = None
        self.actions = [self.share_action, None, self.chat_action, self.host_action, self.join_action,
                        self.status_action, None, self.gpu_action, self.settings_action, self.quit_action]
        self.menu = QMenu()
        for a in self.actions:
            if a is None:
                self.menu.addSeparator()
            else:
                self.menu.addAction(a)
        self.chat = ChatWindow(controller, self.actions)
        self.chat.restartRequested.connect(self.restart)
        self.dialogs: dict[str, object] = {}
        if use_tray is None:
            use_tray = QSystemTrayIcon.isSystemTrayAvailable()
        self.tray = None
        if use_tray:
            self.tray = QSystemTrayIcon(state_icon("idle"), self)
            self.tray.setContextMenu(self.menu)
            self.tray.activated.connect(self._activated)
            self.tray.setToolTip("Potluck — starting")
            self.tray.show()
        else:
            self.chat.show()  # no tray: the window holds everything (its menu bar has the actions)
        controller.statusChanged.connect(self.on_status)
        controller.nodeLost.connect(self.on_lost)
        controller.notice.connect(self.on_notice)
        controller.news.connect(self.on_news)
        self.state = "idle"
        self.closed = False
        self._share_hint: str | None = None   # the how-to-join line, while it is the chat's hint

    # ---- status --------------------------------------------------------------------
    def on_status(self, st: dict):
        self.state = st.get("state", "idle")
        sh = st.get("sharing") or {}
        self.share_action.blockSignals(True)
        self.share_action.setChecked(bool(sh.get("on")))
        self.share_action.blockSignals(False)
        # what there is to share: no GPU found, the processor is what friends would get
        self.share_action.setText("Share this computer" if has_gpu(st) is False else "Share this GPU")
        if self._share_hint and self.chat.hint.text() == self._share_hint and \
                (not sh.get("on") or sh.get("joined") or sh.get("layers")):
            # how to take part, said when sharing was switched on: done, or no longer so
            self.chat.hint.clear()
            self._share_hint = None
        if self.tray is not None:
            self.tray.setIcon(state_icon(self.state))
            self.tray.setToolTip(tooltip(st))
        self.chat.setWindowIcon(state_icon(self.state))

    def on_lost(self, why: str):
        if self.tray is not None:
            self.tray.showMessage("Potluck", why + " Open the chat window to restart it.",
                                  QSystemTrayIcon.Warning)

    def on_notice(self, text: str):
        self.chat.show_hint(text)
        if self.tray is not None and not self.chat.isVisible():
            self.tray.showMessage("Potluck", text)

    def on_news(self, text: str):
        self.chat.show_hint(text, error=False)
        if self.tray is not None and not self.chat.isVisible():
            self.tray.showMessage("Potluck", text)

    def _activated(self, reason):
        if reason in (QSystemTrayIcon.Trigger, QSystemTrayIcon.DoubleClick):
            self.open_chat()

    # ---- actions -----------------------------------------------------------------
    def _share_toggled(self, on: bool):
        self.c.set_share(on, cb=self._share_answered if on else None)

    def _share_answered(self, result, error):
        """Switched on: what is now offered, and how a friend reaches it, in words."""
        self.say(error or share_news(result or {}), error=bool(error))
        self._share_hint = None if error else self.chat.hint.text()

    def say(self, text: str, error: bool = False):
        self.chat.show_hint(text, error=error)
        if self.tray is not None and not self.chat.isVisible():
            self.tray.showMessage("Potluck", text, QSystemTrayIcon.Warning if error else QSystemTrayIcon.Information)

    def open_chat(self):
        if self.closed:
            return
        self.chat.show()
        self.chat.raise_()
        self.chat.activateWindow()

    def _dialog(self, key, cls):
        d = self.dialogs.get(key)
        if d is None or not d.isVisible():
            d = self.dialogs[key] = cls(self.c)
        d.show()
        d.raise_()
        d.activateWindow()
        return d

    def open_host(self):
        return self._dialog("host", HostDialog)

    def open_join(self):
        d = self._dialog("join", JoinDialog)
        if d.finished_join():   # still open on an earlier "Joined.": ready for a new code
            d.start_over()
        return d

    def open_link(self, text: str):
        """A potluck:// link (clicked in a chat app, or handed over by a later launch): the
        join dialog, filled in; the user still presses Join."""
        if self.closed:
            return None
        d = self.open_join()
        d.fill_from_link(text)
        return d

    def open_status(self):
        return self._dialog("status", StatusDialog)

    def open_settings(self):
        return self._dialog("settings", SettingsDialog)

    def look_for_gpu(self, nvml=None) -> GpuOffer:
        """Whether to offer the CUDA build (in the background: it asks a child process)."""
        self.gpu_offer = GpuOffer(nvml, self)
        self.gpu_offer.offered.connect(self._on_gpu_offer)
        self.gpu_offer.start()
        return self.gpu_offer

    def _on_gpu_offer(self, label):
        if label:
            self.gpu_action.setText(label)
        self.gpu_action.setVisible(bool(label))

    def open_gpu(self):
        d = self.dialogs.get("gpu")
        if d is None or not d.isVisible():
            offer = self.gpu_offer
            d = self.dialogs["gpu"] = GpuEnableDialog(offer.gpu if offer else None, offer.size if offer else None)
            d.succeeded.connect(self._gpu_enabled)
        d.show()
        d.raise_()
        d.activateWindow()
        return d

    def _gpu_enabled(self, done):
        """The next engine process imports the CUDA build: restart the node (hosting and
        sharing come back as they were, now on the GPU)."""
        self.gpu_action.setVisible(False)
        self.c.restart()

    def restart(self):
        self.chat.banner_label.setText("Restarting the Potluck engine…")
        self.chat.restart_button.hide()
        QApplication.processEvents()
        self.c.restart()

    def close(self):
        """Closes every window and has Qt delete them, the shell with them, at the next turn of
        the event loop. Left to Python's collector at interpreter exit, a second shell's
        windows and menu were torn down in an order Qt aborts on ('shared QObject was deleted
        directly'), so whoever is done with a shell closes it. Twice is harmless (a second
        Ctrl+C, a link handed over while quitting)."""
        if self.closed:
            return
        self.closed = True
        if self.chat.stream is not None:
            self.chat.stream.stop()
        for d in self.dialogs.values():
            d.close()
            d.deleteLater()
        self.dialogs.clear()
        self.chat.close()
        self.chat.deleteLater()
        if self.tray is not None:
            self.tray.hide()
        self.menu.deleteLater()
        self.deleteLater()

    def quit(self):
        self.close()
        self.c.shutdown()
        QApplication.exit(0)  # quit() may be vetoed by a window; leaving is not optional here
