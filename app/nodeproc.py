"""The node process the app starts and owns (`python -m engine node --token-stdin`).

The per-launch token goes to the node on its stdin, never on a command line (which
other users can read in `ps`). The pipe stays open: when the app goes, even by
SIGKILL, the node reads EOF and exits, and its stage processes follow it the same
way. `stop()` closes the pipe, then terminates, then kills, and waits.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
from pathlib import Path

from engine.boot.selfcmd import engine_command

# a node started from the windowed app (pythonw) has no console, and must not open one
NO_WINDOW = getattr(subprocess, "CREATE_NO_WINDOW", 0)
ANNOUNCE = "POTLUCK_NODE_PORT="   # engine/node/control.py prints this (the GUI does not import the engine)
REPO_ROOT = Path(__file__).resolve().parent.parent


class NodeStartError(RuntimeError):
    pass


class NodeProcess:
    def __init__(self, extra_args: list[str] | None = None, env: dict | None = None, on_exit=None):
        self.extra_args = list(extra_args or [])
        self.env = env
        self.on_exit = on_exit            # called (from a thread) with the exit code
        self.token = secrets.token_urlsafe(32)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.log_lines: list[str] = []
        self._stopping = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 120.0, wait: bool = True, on_ready=None) -> "NodeProcess":
        """Spawns the node. wait=True blocks until it announces its port (NodeStartError if
        it does not within `timeout`); wait=False returns at once and calls on_ready("")
        or on_ready(why it failed), from a thread, when it knows."""
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        args = engine_command() + ["node", "--token-stdin"] + self.extra_args
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, start_new_session=False, creationflags=NO_WINDOW)
        self.proc.stdin.write((self.token + "\n").encode())
        self.proc.stdin.flush()
        ready = threading.Event()

        def read_stdout():
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith(ANNOUNCE) and self.port is None:
                    self.port = int(line[len(ANNOUNCE):])
                    ready.set()
            ready.set()  # EOF: it exited

        def read_stderr():
            for raw in self.proc.stderr:
                self.log_lines.append(raw.decode(errors="replace").rstrip())
                del self.log_lines[:-200]

        def watch():
            code = self.proc.wait()
            ready.set()
            # an exit before it announced its port is a start that failed: outcome() says it
            if self.on_exit is not None and not self._stopping and self.port is not None:
                self.on_exit(code)

        readers = {}
        for fn in (read_stdout, read_stderr, watch):
            readers[fn] = threading.Thread(target=fn, daemon=True, name=f"node-{fn.__name__}")
            readers[fn].start()

        def outcome() -> str:
            if ready.wait(timeout) and self.port is not None:
                return ""
            self._stopping = True   # said here, once
            try:   # its stdout's end (which woke us) comes a moment before its exit
                self.proc.wait(2.0)
                exited = True
            except subprocess.TimeoutExpired:
                exited = False
            self.stop()
            readers[read_stderr].join(2.0)   # its last words, which may trail its exit
            tail = "\n".join(self.log_lines[-5:])
            what = "it stopped before it was ready" if exited else f"it did not answer within {timeout:.0f} s"
            return f"{what}{' (its last words: ' + tail + ')' if tail else ''}"

        if not wait:
            threading.Thread(target=lambda: (on_ready or (lambda _: None))(outcome()), daemon=True,
                             name="node-ready").start()
            return self
        error = outcome()
        if error:
            raise NodeStartError(error)
        return self

    def stop(self, timeout: float = 20.0) -> int | None:
        """Ends the node and everything it started; returns its exit code."""
        p = self.proc
        if p is None:
            return None
        self._stopping = True
        try:
            p.stdin.close()  # the node's signal to shut down cleanly (closes its stages)
        except OSError:
            pass
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
        try:
            return p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            return p.wait()
