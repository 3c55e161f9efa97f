"""Stage processes on this machine: a local pipeline for `potluck chat`, tests and benches.

Each child is `python -m engine stage --port 0 --announce`; it prints the port it
bound and exits when its stdin closes, so a parent that dies (even by SIGKILL) leaves
no orphans behind. Each takes a fresh secret through its environment (which only this
user's processes can read), not its command line (which every user of the machine can):
a stage on loopback is reachable by every program and every user of this computer, and
its control connection drives it (a model by path, shutdown).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

from engine.model.cores import LEASES, CoreLease, apply_openmp_env, cpu_shares, home_cores
from engine.boot.selfcmd import engine_command
from engine.wire.stage_auth import new_secret

ANNOUNCE = "POTLUCK_STAGE_PORT="


class LocalStages:
    def __init__(self, count: int, threads: int | None = None, pipeline: str = "local", device: str = "auto",
                 share_cores: bool = False):
        self.count = count
        self.threads = threads
        # share_cores: the children and the head (process 0, which holds stage 0) lease
        # this machine's cores from one another (engine/model/cores.py); head_cores is the
        # head's lease
        self._core_dir = tempfile.mkdtemp(prefix="potluck-cores-") if share_cores and LEASES else None
        self._n_cores = os.cpu_count() or 1
        self.head_cores = None
        self.cpu_shares = cpu_shares(count + 1, self._n_cores)
        # each process's home cores: the head's (process 0), then each stage's
        self.homes = [home_cores(i, count + 1, self._n_cores) for i in range(count + 1)]
        if self._core_dir:
            self.head_cores = CoreLease(self._core_dir, self.homes[0], self._n_cores)
        self.pipeline = pipeline
        self.device = device
        self.procs: list[asyncio.subprocess.Process] = []
        # 'ws://127.0.0.1:port#secret': the head keeps the secret apart from what it shows
        self.addresses: list[str] = []
        self.secret = new_secret()

    async def start(self) -> list[str]:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["POTLUCK_STAGE_SECRET"] = self.secret
        if self._core_dir:
            apply_openmp_env(env)  # the stages take turns on the cores (cores.py)
        # the folder that holds the engine package (this file is engine/pipeline/local.py)
        src_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src_root + os.pathsep + env.get("PYTHONPATH", "")
        for i in range(1, self.count + 1):
            args = engine_command() + ["stage", "--host", "127.0.0.1", "--port", "0",
                    "--announce", "--pipeline", self.pipeline, "--device", self.device]
            if self._core_dir:
                home = self.homes[i]
                args += ["--threads", str(len(home)),
                         "--core-lease", CoreLease.spec(self._core_dir, home, self._n_cores)]
            elif self.threads:
                args += ["--threads", str(self.threads)]
            proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
            self.procs.append(proc)
        try:
            for proc in self.procs:
                port = await asyncio.wait_for(self._read_port(proc), 120)
                self.addresses.append(f"ws://127.0.0.1:{port}#{self.secret}")
        except BaseException:
            await self.stop()  # the ones that did start must not outlive this failure
            raise
        return self.addresses

    @property
    def ports(self) -> list[int]:
        return [int(a.rpartition(":")[2].partition("#")[0]) for a in self.addresses]

    def reached_through(self, urls: list[str]) -> list[str]:
        """Addresses a head takes for these stages reached some other way (a shaped
        link's proxy in the benches): the same secret."""
        return [f"{u}#{self.secret}" for u in urls]

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
        if self.head_cores is not None:
            self.head_cores.close()
            self.head_cores = None
        if self._core_dir:
            shutil.rmtree(self._core_dir, ignore_errors=True)
            self._core_dir = None
