"""The pipe a parent holds to its child's stdin: a first line (the node's token) and then
end-of-file when the parent is gone, even killed, so the child exits with it.

Read by a thread, not by `loop.connect_read_pipe`: Windows' Proactor event loop cannot
read an anonymous pipe (CPython gh-87694: `[WinError 6]`, then an AttributeError inside
asyncio), and the installed Windows app lost its node's token and every stage process
its parent-died watchdog that way. A blocking read in a daemon thread behaves the same
on every platform, so the path the tests run on Linux is the one Windows runs.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import BinaryIO

MAX_LINE = 4096   # the token is 43 characters; a parent never sends more than a line


class Lifeline:
    """Lines from `stream` (default: this process's stdin) as awaitables, and its end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: BinaryIO | None = None):
        self._loop = loop
        self._stream = stream if stream is not None else _stdin()
        self._lines: asyncio.Queue = asyncio.Queue()
        self._closed = asyncio.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="potluck-lifeline")
        self._thread.start()

    def _read(self):
        try:
            while True:
                line = self._stream.readline(MAX_LINE) if self._stream is not None else b""
                if not line:
                    break
                self._post(self._lines.put_nowait, line)
        except (OSError, ValueError):
            pass   # a broken pipe (the parent died) or a closed stream: the same end
        self._post(self._lines.put_nowait, b"")
        self._post(self._closed.set)

    def _post(self, fn, *args):
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass   # the loop has closed: nobody is waiting any more

    async def readline(self) -> str:
        """The next line without its end, or "" once the pipe has closed."""
        if self._closed.is_set() and self._lines.empty():
            return ""
        raw = await self._lines.get()
        return raw.decode("utf-8", errors="replace").rstrip("\r\n")

    async def wait_closed(self) -> None:
        """Returns when the parent has closed its end (or died)."""
        await self._closed.wait()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


def _stdin() -> BinaryIO | None:
    # pythonw.exe (the windowed app's node on Windows) has no sys.stdin object when it was
    # started without one; a parent that hands us a pipe always gives us one
    s = sys.stdin
    if s is None:
        return None
    try:
        fd = s.fileno()
    except (AttributeError, OSError, ValueError):
        return getattr(s, "buffer", None)
    # the descriptor read raw, not through sys.stdin's buffer: a thread blocked in that
    # buffer holds its lock, and a process that exits while its parent still holds the pipe
    # (a stage told to stop, a node quit from the app) aborted at shutdown ("could not
    # acquire lock for <stdin> at interpreter shutdown"), SIGABRT instead of exit code 0
    return open(fd, "rb", buffering=0, closefd=False)
