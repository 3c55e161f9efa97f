"""The app's brain, without widgets: it owns the node process, polls its status, and
turns the user's actions (host, share, join, stop) into control-API calls.

Widgets connect to its signals; tests drive it directly. If the node dies, `nodeLost`
says so and `restart()` brings it back (hosting again what was hosted).
"""

from __future__ import annotations

import logging
import os
import re

from PySide6.QtCore import QObject, QTimer, Signal

from . import paths
from .client import AsyncWorker, NodeClient
from .nodeproc import NodeProcess, NodeStartError
from .settings import Settings
from .store import History

log = logging.getLogger("potluck.app")

POLL_MS = 1000
STATUS_TIMEOUT_S = 5.0
ACTIVITY_EVERY = 5   # polls between idle-time reports to the node
# the node lets a shared stage go within 3 s of hearing the computer is going to sleep;
# logind holds a suspend back 5 s at most (InhibitDelayMaxSec), so we never wait longer
SLEEP_ANSWER_S = 4.5


class Controller(QObject):
    statusChanged = Signal(dict)
    nodeLost = Signal(str)          # plain-language reason
    nodeStarted = Signal()
    notice = Signal(str)            # something to tell the user (history damage, failed action)
    news = Signal(str)              # good news to tell them (not shown as a problem)
    historyCleared = Signal()       # every conversation was deleted (the chat starts afresh)

    def __init__(self, settings: Settings | None = None, node_args: list[str] | None = None,
                 history: History | None = None, host_on_start: bool | None = None, parent=None,
                 idle_reader=None, sleep_watcher=None):
        super().__init__(parent)
        self.settings = settings or Settings.load()
        self.node_args = list(node_args or [])
        self.history = history or History(paths.data_dir() / "history.sqlite3", keep=self.settings.keep_history)
        self.host_on_start = self.settings.host_on_start if host_on_start is None else host_on_start
        self.worker = AsyncWorker()
        self.client = NodeClient(self.worker, self)
        self.node: NodeProcess | None = None
        self.status: dict = {"state": "idle"}
        self._hosting_asked = 0    # host requests sent, not yet answered
        self.last_host: dict | None = None
        # a restart's host request with friends, sent once the chat's pipeline serves
        self._friends_back: dict | None = None
        self.lost: str | None = None
        self._closing = False
        self._polling = False
        self._fails = 0
        self.status_timeout = STATUS_TIMEOUT_S
        if idle_reader is None:
            from .idle import owner_idle_seconds as idle_reader
        self.idle_reader = idle_reader  # the owner's idle time (app/idle.py), for only-when-idle
        self._polls = 0
        # the computer going to sleep: a shared GPU hands its work over first (app/power.py)
        if sleep_watcher is None:
            from .power import SleepWatcher

            sleep_watcher = SleepWatcher(self)
            sleep_watcher.start()
        self.sleep_watcher = sleep_watcher
        sleep_watcher.sleeping.connect(self._on_sleeping)
        sleep_watcher.woke.connect(self._on_woke)
        self._exit_relay = _ExitRelay(self)
        self._exit_relay.exited.connect(self._on_exit)
        self._exit_relay.ready.connect(self._on_ready)
        self.timer = QTimer(self)
        self.timer.setInterval(POLL_MS)
        self.timer.timeout.connect(self.poll)

    # ---- node lifecycle ---------------------------------------------------------------
    def start_node(self, wait: bool = True) -> bool:
        """Starts the node. wait=True returns once it answers (True) or failed (False,
        `lost` says why); wait=False returns at once and finishes from the event loop
        (`nodeStarted` or `nodeLost`): the app's windows paint and answer meanwhile
        instead of staying blank for as long as the engine takes to start (a minute on a
        slow disk, the first time)."""
        api_port = self.settings.api_port if 0 <= self.settings.api_port < 65536 else 0   # a hand-edited file
        args = ["--share-port", str(self.settings.share_port), "--pipeline", self.settings.pipeline_name,
                "--api-port", str(api_port), "--limits", _json(self.settings.limits)] + self.node_args
        env = dict(os.environ)
        try:
            from .secrets_store import get_secret

            hf = get_secret("hf_token")
            if hf:
                env["HF_TOKEN"] = hf  # the node's environment is readable by this user only
        except Exception:
            pass
        self.node = NodeProcess(args, env=env, on_exit=self._exit_relay.exited.emit)
        if not wait:
            node = self.node
            self.status = {"state": "starting", "loading": {"message": "Starting the Potluck engine…", "stages": {}}}
            self.statusChanged.emit(self.status)
            self.node.start(wait=False, on_ready=lambda err: self._exit_relay.ready.emit(node, err or ""))
            return True
        try:
            self.node.start()
        except (NodeStartError, OSError) as exc:
            self._lose(f"The Potluck engine could not start: {exc}.")
            return False
        return self._attach()

    def _on_ready(self, node: NodeProcess, error: str):
        if node is not self.node or self._closing:
            return   # a node since replaced (restart) or the app is quitting
        if error:
            self._lose(f"The Potluck engine could not start: {error}.")
        else:
            self._attach()

    def _attach(self) -> bool:
        self.client.attach(self.node.url, self.node.token)
        self.lost = None
        self._fails = 0
        self.timer.start()
        self.nodeStarted.emit()
        with_friends = self.last_host if self.last_host is not None else \
            (self.settings.host_with_friends or None) if self.host_on_start else None
        if with_friends is not None:
            again = dict(with_friends)
            if again.get("friends"):
                # the friends' tunnels ended with the engine. This computer hosts alone first,
                # so the chat answers; once it does, the same request with the friends again:
                # their Potluck rejoins by itself (members need no new invite), and the chat
                # goes on answering until they have
                self._friends_back = dict(again)
                for key in ("friends", "listen", "relay"):
                    again.pop(key, None)
                self.news.emit("Potluck restarted: the chat answers on this computer, and your friends' "
                               "computers join again by themselves when their Potluck is running.")
            self.host(again, restoring=True)
        elif self.host_on_start:
            self.host({"model": self.settings.default_model, "stages": self.settings.local_stages})
        if self.settings.share_on_start:   # (the status still says "starting" until the poll)
            self._act("POST", "/share", {"on": True, **self._name()})
        self.poll()
        return True

    def restart(self) -> bool:
        """The engine anew, finishing from the event loop as the first start does: a
        restart that waited froze every window for as long as the engine took to start."""
        if self.node is not None:
            self.node.stop()
        return self.start_node(wait=False)

    def _on_exit(self, code: int):
        if not self._closing:
            log.warning("the node exited with %s; its last words: %s", code,
                        " | ".join((self.node.log_lines if self.node else [])[-5:]))
            self._lose(stopped_words(code, self.node.log_lines if self.node else []))

    def _lose(self, why: str):
        self.timer.stop()
        self.lost = why
        self.status = {"state": "error", "error": why}
        self.statusChanged.emit(self.status)
        self.nodeLost.emit(why)

    def delete_history(self):
        """Every conversation deleted, from whichever window asked; the chat hears it."""
        self.history.delete_all()
        self.historyCleared.emit()

    @property
    def closing(self) -> bool:
        """Whether shutdown() has begun (the node is being stopped)."""
        return self._closing

    def shutdown(self):
        """Quit: stop the node and everything it started; leaves no process behind."""
        self._closing = True
        self.timer.stop()
        if self.node is not None:
            self.node.stop()
        self.worker.close()
        self.history.close()

    # ---- status ----------------------------------------------------------------------
    def poll(self):
        if self._polling or not self.client.base or self.lost or self._closing:
            return
        self._polling = True
        self._polls += 1
        if self._polls % ACTIVITY_EVERY == 1:
            self.report_activity()

        def done(result, error):
            self._polling = False
            if self.lost or self._closing:
                return
            if error:
                self._fails += 1
                if self.node is not None and not self.node.alive():
                    return  # _on_exit reports it
                if self._fails >= 3:
                    self._lose(f"The Potluck engine is not answering ({error}).")
                return
            self._fails = 0
            if self._hosting_asked and result.get("state") == "idle" and not result.get("loading"):
                # the host request is on its way: not "no pipeline" for the seconds it takes
                result = dict(result, loading={"message": "Starting the model…", "stages": {}})
            self.status = result
            self.statusChanged.emit(result)
            if self._friends_back is not None and result.get("hosting") and not result.get("loading") \
                    and not self._hosting_asked:
                again, self._friends_back = self._friends_back, None
                self.host(again, restoring=True)

        import aiohttp

        self.client.call("GET", "/status", cb=done, timeout=aiohttp.ClientTimeout(total=self.status_timeout))

    def report_activity(self):
        """Tell the node how long the owner has been away (None: cannot tell)."""
        try:
            idle = self.idle_reader()
        except Exception:
            idle = None
        self.client.call("POST", "/activity", {"idle_seconds": idle}, cb=lambda result, error: None)

    def _on_sleeping(self):
        def done(result, error):
            self.sleep_watcher.ready()  # told (or it cannot be): the suspend may go on
            self.poll()

        import aiohttp

        self.client.call("POST", "/power", {"state": "sleeping"}, cb=done,
                         timeout=aiohttp.ClientTimeout(total=SLEEP_ANSWER_S))

    def _on_woke(self):
        self._act("POST", "/power", {"state": "awake"})

    # ---- actions -----------------------------------------------------------------------
    def _act(self, method, path, body=None, cb=None, timeout=None, told: bool | None = None):
        """told: whether the caller shows a failure itself (a dialog that asked: by default,
        any caller with a callback); else it goes to the chat and the tray as a notice. A
        join refused in its own window used to stay in the chat after the join succeeded."""
        told = cb is not None if told is None else told

        def done(result, error):
            if error and not told:
                self.notice.emit(error)
            if cb:
                cb(result, error)
            self.poll()

        if timeout is None:
            self.client.call(method, path, body, cb=done)
        else:
            import aiohttp

            self.client.call(method, path, body, cb=done, timeout=aiohttp.ClientTimeout(total=timeout))

    def host(self, request: dict, cb=None, *, restoring: bool = False):
        """restoring: a restart's own requests (the chat's pipeline, then the friends); any
        other is the person's, which replaces what a restart would have brought back."""
        if not restoring:
            self._friends_back = None
            if not request.get("friends"):
                self._keep_host({})
        self._hosting_asked += 1

        def done(result, error):
            self._hosting_asked -= 1
            if not error:
                self.last_host = dict(request)  # what a restart hosts again
                if request.get("friends"):   # and the next start of Potluck
                    self._keep_host({k: v for k, v in request.items() if k not in ("api_key", "api_lan_port")})
            if cb:
                cb(result, error)

        self._act("POST", "/host", request, done, told=cb is not None)

    def reply(self, code: str, cb=None):
        """A friend's reply code for the pipeline we host (POST /host/reply)."""
        self._act("POST", "/host/reply", {"code": code}, cb)

    def models(self, cb):
        """The node's curated model list, each with its weights' size per precision."""
        self.client.call("GET", "/models", cb=cb)

    def plan(self, request: dict, cb):
        self.client.call("POST", "/plan", request, cb=cb)

    def stop_waiting(self, cb=None):
        """The invite withdrawn while no friend has joined: what serves meanwhile goes on
        (and is what a restart brings back: no invite to say has ended)."""
        if self.last_host is not None:
            for key in ("friends", "listen", "relay"):
                self.last_host.pop(key, None)
        self._friends_back = None
        self._keep_host({})
        self._act("POST", "/stop", {"what": "invite"}, cb)

    def stop_hosting(self, cb=None):
        self.last_host = self._friends_back = None
        self._keep_host({})
        self._act("POST", "/stop", {"what": "host"}, cb)

    def _keep_host(self, request: dict) -> None:
        if self.settings.host_with_friends != request:
            self.settings.host_with_friends = request
            try:
                self.settings.save()
            except OSError as exc:
                log.warning("could not save the settings: %s", exc)

    def set_share(self, on: bool, cb=None):
        self._share_next_start(on)
        if self.status.get("state") == "starting":
            # ticked while the engine starts: it shares once up (_attach reads share_on_start);
            # asked now, the request failed with "the Potluck engine is not running"
            if on:
                self.news.emit("This computer is shared as soon as Potluck's engine has started.")
            return
        self._act("POST", "/share", {"on": bool(on), **self._name()}, cb)

    def check_invite(self, code: str, cb):
        """Whose pipeline an invite code is for, without joining: cb({"pipeline", "shared_with"},
        None) or cb(None, why the code cannot be used)."""
        self._act("POST", "/join", {"code": code, "check": True}, cb)

    def _name(self) -> dict:
        """How friends see this computer when it joins them (Settings; none: its name)."""
        return {"name": self.settings.display_name} if self.settings.display_name else {}

    def _share_next_start(self, on: bool) -> None:
        """Potluck started again shares as it did when it stopped: with the friend it joined
        last (the node keeps who), where it had to be joined again by hand."""
        if self.settings.share_on_start != bool(on):
            self.settings.share_on_start = bool(on)
            try:
                self.settings.save()
            except OSError as exc:
                log.warning("could not save the settings: %s", exc)

    def join(self, code: str | None = None, pipeline: str | None = None, port: int | None = None,
             relay: str | None = None, cb=None):
        def joined(result, error):
            if not error:
                self._share_next_start(True)   # the next start shares with this friend again
            if cb is not None:
                cb(result, error)

        body = {"code": code, **self._name()} if code else {"pipeline": pipeline or ""}
        if relay:
            body["relay"] = relay
        if port is not None and not code:
            body["port"] = port
        # a tunnel to the host can take a while
        self._act("POST", "/join", body, joined, timeout=180, told=cb is not None)

    def set_limits(self, limits: dict, cb=None):
        self._act("POST", "/limits", limits, cb)


class _ExitRelay(QObject):
    """Carries the node's exit code, and its start's outcome ("" or why it failed), from
    its watcher threads to the GUI thread."""

    exited = Signal(int)
    ready = Signal(object, str)


def _json(obj) -> str:
    import json

    return json.dumps(obj)


def stopped_words(code: int, last_lines: list[str]) -> str:
    """Why the engine process is gone, for its owner: an exit code means nothing to
    people, a signal from outside (the system short of memory, most often) and the error
    it said last do."""
    if code < 0 or code in (137, 0xC0000005, 0xC0000409):   # a signal; Windows' crash codes
        return ("The Potluck engine stopped unexpectedly: the system ended it (this happens most often when "
                "the computer runs short of memory).")
    said = next((line.strip() for line in reversed(last_lines) if line.strip()), "")
    said = re.sub(r"^\d\d:\d\d:\d\d ", "", said)     # the node's log time
    # "ValueError: the message" -> "the message"; a traceback's frame lines say nothing
    kind, _, message = said.partition(": ")
    if message and kind.replace(".", "").isidentifier() and kind.endswith(("Error", "Exception")):
        said = message
    if not said or said.startswith(("File ", "Traceback", "^")):
        return "The Potluck engine stopped unexpectedly."
    return f"The Potluck engine stopped unexpectedly: {said[:200]}"
