"""Stage processes on this machine: a local pipeline for `potluck chat`, tests and benches.

Each child is `python -m engine stage --port 0 --announce`; it prints the port it
bound and exits when its stdin closes, so a parent that dies (even by SIGKILL) leaves
no orphans behind.
"""

from __future__ import annotations

import asyncio
import os
import sys

ANNOUNCE = "POTLUCK_STAGE_PORT="


class LocalStages:
    def __init__(self, count: int, threads: int | None = None, pipeline: str = "local", device: str = "cpu"):
        self.count = count
        self.threads = threads
        self.pipeline = pipeline
        self.device = device
        self.procs: list[asyncio.subprocess.Process] = []
        self.addresses: list[str] = []

    async def start(self) -> list[str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        src_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = src_root + os.pathsep + env.get("PYTHONPATH", "")
        for _ in range(self.count):
            args = [sys.executable, "-m", "engine", "stage", "--host", "127.0.0.1", "--port", "0",
                    "--announce", "--pipeline", self.pipeline, "--device", self.device]
            if self.threads:
                args += ["--threads", str(self.threads)]
            proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
            self.procs.append(proc)
        try:
            for proc in self.procs:
                port = await asyncio.wait_for(self._read_port(proc), 120)
                self.addresses.append(f"ws://127.0.0.1:{port}")
        except BaseException:
            await self.stop()  # the ones that did start must not outlive this failure
            raise
        return self.addresses

    @staticmethod
    async def _read_port(proc) -> int:
        while True:
            line = await proc.stdout.readline()
            if not line:
                raise RuntimeError("a stage process exited before it was ready")
            text = line.decode(errors="replace").strip()
            if text.startswith(ANNOUNCE):
                return int(text[len(ANNOUNCE):])

    async def stop(self):
        for proc in self.procs:
            if proc.returncode is None:
                try:
                    proc.stdin.close()
                    proc.terminate()
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        self.procs.clear()
