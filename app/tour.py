"""A walk through the running app that saves what a person would see: the chat window
answering, the tray menu, the host dialog's plan, (with `wait_link`) the join dialog
a `potluck://join/…` link opened, and (with `friend`) hosting for one friend from the
Host dialog, the friend's computer joining with the invite link it shows, the ring drawn, the friend leaving, the rearrangement and the chat going
on. Each step records the engine's words a person would have seen (none, we hope). `potluck app --tour DIR` runs it inside the real app,
started the way the Start menu starts it, and quits; DIR gets the PNGs and tour.json
(what each step saw). It is how CI sees the installed Windows app work (under wine,
offscreen), and a way for a user to show what their screen shows in a bug report.
`python -m app.screenshots` (the README's pictures) uses the same steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

QUESTION = "What is the capital of France?"
LINK_READY = "waiting-for-link"   # a file in DIR: the tour now waits for a link to arrive


def wait(app, pred, timeout: float, what: str):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError(f"timed out waiting for {what}")
        app.processEvents()
        time.sleep(0.03)


def settle(app, seconds: float = 0.4):
    t0 = time.time()
    while time.time() - t0 < seconds:
        app.processEvents()
        time.sleep(0.02)


def shoot(widget, path: Path) -> str:
    if not widget.grab().save(str(path)):
        raise OSError(f"could not write {path}")
    print(f"  saved {path}", flush=True)
    return path.name


class Tour:
    def __init__(self, app, shell, controller, out: Path, load_timeout: float = 900):
        self.app, self.shell, self.c, self.out = app, shell, controller, Path(out)
        self.load_timeout = load_timeout
        self.report: dict = {"steps": []}

    def _step(self, name: str, **seen):
        self.report["steps"].append({"step": name, **seen})
        (self.out / "tour.json").write_text(json.dumps(self.report, indent=1), encoding="utf-8")

    def pipeline(self):
        """Until the hosted model answers (hosting it if the app was told not to)."""
        app, c = self.app, self.c
        wait(app, lambda: c.client.base is not None or c.lost, self.load_timeout, "the engine")
        if c.lost:
            raise RuntimeError(c.lost)
        if not c.status.get("hosting") and not c.status.get("loading"):
            c.host({"model": c.settings.default_model, "stages": c.settings.local_stages})
        wait(app, lambda: bool((c.status.get("hosting") or {}).get("openai_url")) or c.lost,
             self.load_timeout, "the pipeline")
        if c.lost:
            raise RuntimeError(c.lost)
        self._step("pipeline", status=c.status.get("state"), model=c.status["hosting"].get("model"))

    def chat(self, question: str = QUESTION, name: str = "chat-answered.png", size=(1000, 680)):
        # greedy for this session only (never saved): the same answer every run
        self.c.settings.temperature = 0.0
        chat = self.shell.chat
        chat.resize(*size)
        self.shell.open_chat()
        settle(self.app, 1.0)
        chat.send(question)
        wait(self.app, lambda: not chat.generating, min(600, self.load_timeout), "the reply")
        settle(self.app, 1.0)
        reply = chat.messages[-1].content if chat.messages and chat.messages[-1].role == "assistant" else ""
        self._step("chat", question=question, reply=reply, png=shoot(chat, self.out / name))
        return reply

    def tray_menu(self):
        from PySide6.QtCore import QPoint

        self.shell.on_status(self.c.status)
        self.shell.menu.popup(QPoint(600, 40))   # without a tray, the same menu as a popup
        settle(self.app, 0.5)
        png = shoot(self.shell.menu, self.out / "tray-menu.png")
        self.shell.menu.hide()
        self._step("tray-menu", png=png, items=[a.text() for a in self.shell.menu.actions() if a.text() and a.isVisible()])

    def host_dialog(self):
        host = self.shell.open_host()
        self.plain("host-dialog", host)
        host.check()
        wait(self.app, lambda: host.last_plan is not None or host.last_error is not None, 300, "the plan")
        settle(self.app, 0.5)
        png = shoot(host, self.out / "host-dialog.png")
        self._step("host-dialog", png=png, plan=host.last_plan is not None, error=host.last_error)
        host.close()

    def link(self, timeout: float = 600):
        """Until another launch hands this app a potluck:// link (the join dialog opens)."""
        (self.out / LINK_READY).write_text("", encoding="utf-8")
        shell = self.shell
        wait(self.app, lambda: (shell.dialogs.get("join") is not None and shell.dialogs["join"].isVisible()
                                and bool(shell.dialogs["join"].code.text())), timeout, "a potluck:// link")
        join = shell.dialogs["join"]
        settle(self.app, 0.5)
        self._step("link", code=join.code.text(), png=shoot(join, self.out / "join-from-link.png"))
        join.close()

    def plain(self, name: str, widget) -> list:
        """The engine's words a person would see in widget now (none, we hope): recorded."""
        from .visible_text import engine_words

        found = engine_words(widget)
        self.report.setdefault("engine_words", {})[name] = found
        return found

    def friend(self, question: str = QUESTION):
        """A friend's computer joins with the invite code, the ring is drawn, the friend
        leaves mid-evening, the pipeline rearranges, and the chat goes on. The friend's
        computer is a second node (what their app runs), with its own home folder."""
        import os
        import urllib.request

        from .nodeproc import NodeProcess

        from .links import parse_link

        app, c, chat = self.app, self.c, self.shell.chat
        # hosting with one friend, as a person does it: the Host dialog, one friend to invite
        # (this tour's friend is on this computer: friends are accepted on loopback)
        host = self.shell.open_host()
        host.stages.setValue(1)
        host.invitees.setValue(1)
        host.listen.setText("127.0.0.1:0")
        host.start_button.click()
        if host.start_button.text() == "Stop it and host":   # the chat's pipeline runs: confirmed, as a person would
            host.start_button.click()
        wait(app, lambda: bool(host.invite_link.text()) and host.invite_box.isVisible(), 120, "the invite link")
        settle(app, 0.5)
        link = host.invite_link.text()
        self._step("invite", link=link, png=shoot(host, self.out / "invite.png"), words=self.plain("invite", host))
        home = self.out / "friend-home"
        friend = NodeProcess(["--threads", "1", "--share-host", "127.0.0.1", "--share-port", "0"],
                             env={**os.environ, "POTLUCK_HOME": str(home)})
        friend.start(timeout=120)
        try:
            # the friend clicks the link: their app reads it (app/links.py) and joins with
            # what it carries, as its join dialog does
            got = parse_link(link)
            body = {"code": got.code, **({"relay": got.relay} if got.relay else {})}
            req = urllib.request.Request(f"{friend.url}/join", json.dumps(body).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {friend.token}"})
            with urllib.request.urlopen(req, timeout=180) as r:
                joined = json.loads(r.read())
            # the friend appears in the Host dialog as they join: name, computer, memory, path
            wait(app, lambda: "joined" in host.result.text(), 120, "the friend in the Host dialog")
            settle(app, 0.3)
            self._step("friend-joined", seen=host.result.text(), png=shoot(host, self.out / "friend-joined.png"),
                       words=self.plain("friend-joined", host))
            wait(app, lambda: len((c.status.get("hosting") or {}).get("ring") or []) == 2, self.load_timeout,
                 "the ring with the friend")
            host.close()
            settle(app, 1.0)
            chat.on_status(c.status)
            reply = self.chat(question, name="ring.png")
            self._step("ring", joined=(joined.get("sharing") or {}).get("joined"),
                       ring=c.status["hosting"].get("ring_text"), reply=reply, words=self.plain("ring", chat))
        finally:
            friend.stop()      # their app quits: the node hands its layers back and leaves
        wait(app, lambda: any(r.get("state") == "left" for r in (c.status.get("hosting") or {}).get("ring") or []),
             120, "the friend shown as gone")
        chat.on_status(c.status)
        settle(app, 0.5)
        self._step("friend-left", headline=chat.model_label.text(), ring=c.status["hosting"].get("ring_text"),
                   png=shoot(chat, self.out / "friend-left.png"), words=self.plain("friend-left", chat))
        wait(app, lambda: not (c.status.get("hosting") or {}).get("recovering")
             and (c.status.get("hosting") or {}).get("openai_url") is not None, 300, "the rearrangement")
        reply = self.chat(question, name="chat-after.png")
        self._step("after", headline=chat.model_label.text(), reply=reply, words=self.plain("after", chat))

    def run(self, wait_link: bool = False, friend: bool = False) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self.pipeline()
            self.plain("first-launch", self.shell.chat)
            self.chat()
            self.tray_menu()
            self.host_dialog()
            if wait_link:
                self.link()
            if friend:
                self.friend()
            self.report["ok"] = True
            return 0
        except Exception as exc:   # the report says where it stopped; the app still quits
            self.report["ok"] = False
            self.report["error"] = f"{type(exc).__name__}: {exc}"
            node = getattr(self.c, "node", None)   # and what the engine said last
            self.report["engine_log"] = list(getattr(node, "log_lines", None) or [])[-40:]
            self.report["status"] = {k: self.c.status.get(k) for k in ("state", "error")}
            return 1
        finally:
            self._step("end")
