"""engine/pipeline/lifeline.py and stopping.py: the parent's pipe read by a thread (what
Windows' Proactor loop could not do with connect_read_pipe), and stop requests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from engine.pipeline.lifeline import Lifeline
from engine.pipeline.stopping import StopRequests


async def test_lines_then_the_end_of_the_pipe():
    r, w = os.pipe()
    life = Lifeline(asyncio.get_running_loop(), os.fdopen(r, "rb", buffering=0))
    os.write(w, b"a-token-of-sixteen-chars\r\nsecond\n")
    assert await asyncio.wait_for(life.readline(), 5) == "a-token-of-sixteen-chars"
    assert await asyncio.wait_for(life.readline(), 5) == "second"
    assert not life.closed
    os.close(w)   # the parent is gone
    await asyncio.wait_for(life.wait_closed(), 5)
    assert life.closed and await life.readline() == ""


async def test_a_parent_that_never_writes_a_line_still_ends_it():
    r, w = os.pipe()
    life = Lifeline(asyncio.get_running_loop(), os.fdopen(r, "rb", buffering=0))
    os.write(w, b"no newline yet")
    os.close(w)
    assert await asyncio.wait_for(life.readline(), 5) == "no newline yet"
    await asyncio.wait_for(life.wait_closed(), 5)


async def test_sigterm_asks_once_and_done_lets_go():
    loop = asyncio.get_running_loop()
    asked = []
    req = StopRequests(loop, lambda: asked.append(time.monotonic())).install()
    try:
        assert req.how == "signals"
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if asked:
                break
        await asyncio.sleep(0.1)
        assert len(asked) == 1, "a second signal does not start a second leave"
        req.done()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def test_a_stage_whose_parent_dies_exits(tmp_path):
    """`potluck stage --announce` (how every local stage runs) exits when the process that
    holds its stdin is killed: the watchdog the Windows build had lost."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         "p = subprocess.Popen([sys.executable, '-m', 'engine', 'stage', '--host', '127.0.0.1', '--port', '0',"
         " '--announce'], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
         "print(p.pid, flush=True)\n"
         "p.stdout.readline()\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready"
    parent.kill()
    parent.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        try:   # reaped by init, or a zombie of nobody's: either way it has exited
            if open(f"/proc/{child}/stat").read().split()[2] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.2)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the stage outlived its parent")


def test_a_process_that_ends_while_its_parent_holds_the_pipe_exits_cleanly():
    """The reading thread blocks on stdin for the life of the process; a process that ends
    while its parent still holds the pipe (a stage told to stop, a node quit from the app)
    aborted at shutdown with SIGABRT ("could not acquire lock for <stdin>") every time."""
    code = ("import asyncio\n"
            "from engine.pipeline.lifeline import Lifeline\n"
            "async def main():\n"
            "    life = Lifeline(asyncio.get_running_loop())\n"
            "    print(await life.readline(), flush=True)\n"
            "asyncio.run(main())\n")
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        p.stdin.write(b"token\n")
        p.stdin.flush()
        assert p.stdout.readline() == b"token\n"
        err = p.stderr.read()   # the pipe stays open until the process has gone
        assert p.wait(30) == 0 and b"Fatal Python error" not in err, err[-300:]
        p.stdin.close()
