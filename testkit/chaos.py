"""An evening of friends coming and going, on emulated homes: the chaos harness.

    from testkit.chaos import chaos_available, evening
    report = evening(seed=7, seconds=300, clients=3, workdir=tmp)   # bench/chaos.py prints it

Three homes in network namespaces (testkit/homenet.py): the host's behind a router with
UPnP, one friend behind a port-preserving NAT, one behind a symmetric NAT, a relay and a
STUN server on the public host, every home's link shaped (tbf). Each home runs what the
app runs, `potluck node`: the host's hosts the default model with both friends (POST
/host, the invite code), the friends join with the code (POST /join). Clients inside the
host's home use its OpenAI API the whole time (testkit/chaos_client.py: streamed chats,
n=2 with a seed, forced tool calls, long prompts), while the seeded schedule
(testkit/chaos_plan.py) breaks things one episode at a time: a node killed or frozen, a
home's line cut or collapsed to 1 Mbit/s, the relay restarted, a router's NAT table
flushed, a friend's sharing switched off and on, the host's node restarted, two faults at
once, a second fault while the first is recovered from.

Afterwards every request's outcome is judged against the same request on the undisturbed
pipeline (chaos_plan.check), every process's RSS, descriptors and threads are compared
after warm-up at quiet moments (the clients held, nothing in flight, the ring whole), and
every process ever seen must be gone.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engine.model.device import QUIET_TRIM_S
from testkit.chaos_plan import COMBOS, KINDS, Episode, Fault, answer, check, grew, requests, schedule
from testkit.homenet import HomeSpec, home_internet, homenet_available, stun_available, upnp_available

API_PORT = 8000
RELAY_PORT = 8765
LISTEN = "0.0.0.0:7870"
BASE_RATE = 50e6           # each home's line: 50 Mbit/s both ways
SLOW_RATE = 1e6
WHOLE_TIMEOUT_S = 240.0    # an episode's faults undone: the ring must be whole again by then
SAMPLE_S = 3.0
QUIET_EVERY_S = 300.0      # how often the clients are held for a quiet sample (at most)
QUIET_SETTLE_S = QUIET_TRIM_S + 2.0   # a quiet node's freed cache is trimmed by then
HOMES = (HomeSpec(nat="eim", upnp=True), HomeSpec(nat="eim"), HomeSpec(nat="symmetric"))


def chaos_available() -> tuple[bool, str]:
    for probe in (homenet_available, upnp_available, stun_available):
        ok, why = probe()
        if not ok:
            return False, why
    from shutil import which
    if which("conntrack") is None:
        return False, "conntrack not found (apt-get install -y conntrack)"
    return True, ""


def _http(port: int, token: str, method: str, path: str, body=None, timeout: float = 60.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _tree(pid: int) -> list[int]:
    """pid and its descendants (network namespaces share this machine's pid space)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _sample(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        if st.get("State", "").strip().startswith("Z"):
            return None
        kb = lambda k: int(st.get(k, "0 kB").split()[0]) * 1024  # noqa: E731
        # anon: the process's own memory; file: pages of mapped files (the model's, the
        # libraries'), which the kernel may drop and read again as it likes
        return {"rss": kb("VmRSS"), "anon": kb("RssAnon"), "file": kb("RssFile"), "threads": int(st["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}
    except (OSError, KeyError, ValueError):
        return None


@dataclass
class NodeProc:
    """One home's `potluck node`, as the app starts it (its token on stdin; it exits when
    stdin closes)."""
    name: str
    ns: str
    home: Path
    log: Path
    api_port: int = 0
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    proc: subprocess.Popen | None = None
    port: int = 0

    def start(self, net):
        env = dict(os.environ, POTLUCK_HOME=str(self.home), POTLUCK_KEYSTORE="file", HF_HUB_OFFLINE="1",
                   TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "engine", "node", "--token-stdin", "--threads", "1", "--poll", "0.5",
                "--share-host", "127.0.0.1", "--share-port", "0", "--api-port", str(self.api_port)]
        logf = open(self.log, "ab")
        self.proc = net.popen(self.ns, argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf)
        logf.close()
        self.proc.stdin.write((self.token + "\n").encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().decode()
        if not line.startswith("POTLUCK_NODE_PORT="):
            raise RuntimeError(f"{self.name}'s node did not start: {line!r}\n{self.log.read_text()[-3000:]}")
        self.port = int(line.split("=")[1])
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()

    def _drain(self, stream):
        for _ in iter(stream.readline, b""):
            pass

    def call(self, net, method: str, path: str, body=None, timeout: float = 60.0):
        return net.call_in(self.ns, _http, self.port, self.token, method, path, body, timeout,
                           timeout=timeout + 10)

    def status(self, net) -> dict:
        try:
            return self.call(net, "GET", "/status", timeout=15)[1]
        except (OSError, TimeoutError):
            return {}

    def pids(self) -> list[int]:
        return _tree(self.proc.pid) if self.proc is not None and self.proc.poll() is None else []

    def signal(self, sig: int):
        for p in self.pids():
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 30.0):
        """As the app quits: stdin closes, the node lets everything go and exits."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)


class Evening:
    """The homes, the relay, the three nodes and the clients, and every fault's doing and undoing."""

    def __init__(self, net, workdir: Path, seed: int, say=print):
        self.net, self.dir, self.seed, self.say = net, workdir, seed, say
        self.t0 = time.monotonic()
        self.wall0 = time.time()      # the clients' clock: their times map onto episodes by it
        self.relay: subprocess.Popen | None = None
        self.host = NodeProc("host", net.host(0), workdir / "host", workdir / "host.log", api_port=API_PORT)
        self.friends = [NodeProc(f"friend{i}", net.host(i), workdir / f"friend{i}", workdir / f"friend{i}.log")
                        for i in (1, 2)]
        self.code = ""
        self.samples: list[dict] = []          # every few seconds, whatever the state
        # growth is judged on these: the ring whole, the clients held, nothing in flight.
        # Under load a node's RSS is mostly its conversations' cache, which comes and goes
        self.quiet_samples: list[dict] = []
        self.pause = workdir / "clients.pause"
        self.quiet_every, self.quiet_from, self._quiet_at = QUIET_EVERY_S, 0.0, -1e9
        self.events: dict[tuple, dict] = {}     # the head's recovery records, by (time, event)
        self.seen_pids: dict[int, str] = {}
        self.episodes: list[dict] = []
        self.injected: dict[str, int] = {}
        self._stop = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---- setting up ---------------------------------------------------------------
    def start_relay(self):
        log = open(self.dir / "relay.log", "ab")
        self.relay = self.net.popen(self.net.public, [sys.executable, "-m", "engine", "relay", "--port",
                                                      str(RELAY_PORT)], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 60
        while f"Relay listening" not in (self.dir / "relay.log").read_text(errors="replace"):
            if time.monotonic() > deadline or self.relay.poll() is not None:
                raise RuntimeError("the relay did not start:\n" + (self.dir / "relay.log").read_text()[-2000:])
            time.sleep(0.2)

    def host_body(self) -> dict:
        return {"model": "default", "stages": 1, "friends": len(self.friends), "listen": LISTEN,
                "relay": f"ws://{self.net.public_addr}:{RELAY_PORT}"}

    def start_host(self, timeout: float = 240.0):
        self.host.start(self.net)
        status, r = self.host.call(self.net, "POST", "/host", self.host_body())
        if status != 200:
            raise RuntimeError(f"hosting refused: {r}")

    def wait_code(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.host.status(self.net)
            code = ((st.get("loading") or {}).get("invite") or (st.get("hosting") or {}).get("invite"))
            if code:
                return code
            if st.get("error"):
                raise RuntimeError(f"hosting failed: {st['error']}")
            time.sleep(0.3)
        raise RuntimeError("no invite code from the host")

    def join(self, f: NodeProc):
        status, r = f.call(self.net, "POST", "/join", {"code": self.code}, timeout=180)
        if status != 200:
            self.say(f"  {f.name}: join refused: {r}")
        return status == 200

    def setup(self):
        for i in range(len(HOMES)):
            self.net.shape(i, BASE_RATE)
        self.start_relay()
        self.start_host()
        self.code = self.wait_code()
        for f in self.friends:
            f.start(self.net)
        for f in self.friends:
            self.join(f)
        self.wait_whole(WHOLE_TIMEOUT_S, strict=True)

    def whole(self) -> tuple[bool, dict]:
        st = self.host.status(self.net)
        h = st.get("hosting") or {}
        ok = (st.get("state") == "serving" and len(h.get("stages") or []) == 1 + len(self.friends)
              and not h.get("recovering") and not h.get("error"))
        return ok, st

    def wait_whole(self, timeout: float, strict: bool = False) -> float | None:
        """Seconds until the host serves with every friend in the ring (None: not by timeout)."""
        t = time.monotonic()
        st: dict = {}
        while time.monotonic() - t < timeout:
            ok, st = self.whole()
            if ok:
                return time.monotonic() - t
            time.sleep(1.0)
        if strict:
            raise RuntimeError(f"the ring was not whole after {timeout:.0f} s: {json.dumps(st)[:3000]}")
        return None

    # ---- faults ---------------------------------------------------------------------
    def _router_ns(self, home: int) -> str:
        return self.net.router(home)

    def do(self, fault: Fault):
        """Start a fault; returns what undoes it."""
        k, i = fault.kind, fault.target
        self.injected[k] = self.injected.get(k, 0) + 1
        if k == "kill":
            f = self.friends[i - 1]
            f.signal(signal.SIGKILL)
            f.proc.wait(10)
            return lambda: (f.start(self.net), self.join(f))
        if k == "freeze":
            f = self.friends[i - 1]
            f.signal(signal.SIGSTOP)
            return lambda: f.signal(signal.SIGCONT)
        if k == "cut":
            rule = ["-m", "comment", "--comment", "chaos-cut", "-j", "DROP"]
            for chain in ("FORWARD", "INPUT"):
                self.net.exec(self._router_ns(i), ["iptables", "-I", chain, "1", *rule])
            return lambda: [self.net.exec(self._router_ns(i), ["iptables", "-D", chain, *rule], check=False)
                            for chain in ("FORWARD", "INPUT")]
        if k == "slow":
            self.net.shape(i, SLOW_RATE)
            return lambda: self.net.shape(i, BASE_RATE)
        if k == "nat_flush":
            self.net.exec(self._router_ns(i), ["conntrack", "-F"], check=False)
            return lambda: None
        if k == "share":
            f = self.friends[i - 1]
            f.call(self.net, "POST", "/share", {"on": False})
            return lambda: f.call(self.net, "POST", "/share", {"on": True}, timeout=180)
        if k == "relay":
            self.relay.kill()
            self.relay.wait(10)
            return self.start_relay
        if k == "host_restart":
            self.host.stop()
            self.host.start(self.net)
            status, r = self.host.call(self.net, "POST", "/host", self.host_body())
            if status != 200:
                self.say(f"  the restarted host refused to host: {r}")
            return lambda: None
        raise ValueError(k)

    def run_episode(self, ep: Episode, end: float) -> dict:
        rec = {"name": ep.name, "t": round(self.now(), 1),
               "faults": [f"{f.kind}@{f.target}" + (f" {f.duration_s:g}s" if f.duration_s else "") for f in ep.faults]}
        self.say(f"[{self.now():6.0f}s] {ep.name}: {', '.join(rec['faults'])}")
        undo = []
        started = time.monotonic()
        for n, fault in enumerate(ep.faults):
            if n and ep.after_recovery_starts:
                self._wait_recovering(30.0)
            undo.append((time.monotonic() + fault.duration_s, self.do(fault)))
        for due, fn in sorted(undo, key=lambda u: u[0]):
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 -- recorded: the run goes on
                rec["undo_error"] = f"{type(exc).__name__}: {exc}"
        whole = self.wait_whole(WHOLE_TIMEOUT_S)
        rec["whole_after_s"] = None if whole is None else round(time.monotonic() - started, 1)
        if whole is None:
            self.say(f"  not whole again after {WHOLE_TIMEOUT_S:.0f} s: rejoining")
            self._rejoin_missing()
        elif self.now() >= self.quiet_from and self.now() - self._quiet_at >= self.quiet_every:
            # one state for every sample: the ring whole (each node holding its usual share;
            # between episodes a node holds more or fewer layers, or none) and quiet
            self.quiet_sample(clients=True)
        time.sleep(min(ep.calm_s, max(0.0, end - time.monotonic())))
        return rec

    def _wait_recovering(self, timeout: float):
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            h = self.host.status(self.net).get("hosting") or {}
            if h.get("recovering"):
                return
            time.sleep(0.2)

    def _rejoin_missing(self):
        """A friend left out of the ring after an episode: as its owner would, start its
        node if it is gone and join again."""
        for f in self.friends:
            if f.proc is None or f.proc.poll() is not None:
                f.start(self.net)
            st = f.status(self.net)
            if not (st.get("sharing") or {}).get("running"):
                self.join(f)
        self.wait_whole(WHOLE_TIMEOUT_S)

    # ---- watching -------------------------------------------------------------------
    def quiet_sample(self, clients: bool, wait_s: float = 120.0) -> bool:
        """Hold the clients (no request starts), wait for those in flight to end and for the
        nodes' freed caches to be trimmed, sample every process, let the clients go on."""
        ack = Path(f"{self.pause}.ack")
        ack.unlink(missing_ok=True)
        self.pause.touch()
        try:
            deadline = time.monotonic() + wait_s
            while clients and not ack.exists():
                if time.monotonic() > deadline:
                    self.say(f"  no quiet moment within {wait_s:.0f} s: no sample")
                    return False
                time.sleep(0.2)
            time.sleep(QUIET_SETTLE_S)
            self._quiet_at = self.now()
            held = self._held()
            self.quiet_samples.extend(dict(s, **held.get(s["role"], {})) for s in self._sample_all(self._quiet_at))
            return True
        finally:
            self.pause.unlink(missing_ok=True)

    def _held(self) -> dict[str, dict]:
        """What each node says it holds now, by role: its layers, and the bytes of its
        slice of the weights plus its cache (RSS beyond these is the process itself)."""
        out = {}
        st = (self.host.status(self.net).get("hosting") or {}).get("stages") or []
        if st:
            mem = st[0].get("memory") or {}
            out["host node"] = {"layers": st[0].get("layers"),
                                "held": (mem.get("weights") or 0) + (mem.get("cache") or 0)}
        for f in self.friends:
            sh = f.status(self.net).get("sharing") or {}
            out[f"{f.name} node"] = {"layers": sh.get("layers"),
                                     "held": (sh.get("weights_bytes") or 0) + (sh.get("kv_bytes") or 0)}
        return out

    def _sample_all(self, t: float) -> list[dict]:
        """RSS, descriptors, threads and children of every node (and its children) and the relay."""
        out = []
        for role, node in [("host node", self.host), *((f"{f.name} node", f) for f in self.friends)]:
            pids = node.pids()
            for p in pids:
                s = _sample(p)
                if s is None:
                    continue
                r = role if p == pids[0] else f"{role} child"
                self.seen_pids.setdefault(p, r)
                out.append({"t": t, "pid": p, "role": r, "children": len(pids) - 1 if p == pids[0] else 0, **s})
        if self.relay is not None and self.relay.poll() is None:
            s = _sample(self.relay.pid)
            if s is not None:
                self.seen_pids.setdefault(self.relay.pid, "relay")
                out.append({"t": t, "pid": self.relay.pid, "role": "relay", "children": 0, **s})
        return out

    def _watch(self):
        while not self._stop.wait(SAMPLE_S):
            self.samples.extend(self._sample_all(self.now()))
            h = self.host.status(self.net).get("hosting") or {}
            for e in h.get("events") or []:
                self.events.setdefault((e.get("t"), e.get("event")), e)

    # ---- the evening ----------------------------------------------------------------
    def run(self, seconds: float, clients: int, warmup_s: float, short: bool, kinds=None) -> dict:
        self.say("setting up: three homes, the relay, the host and two friends")
        self.setup()
        self.say(f"[{self.now():6.0f}s] the ring is whole; the undisturbed replies")
        ref_file = self.dir / "reference.jsonl"
        self._clients(ref_file, ["--reference"]).wait(600)
        ref_outcomes = [json.loads(x) for x in ref_file.read_text().splitlines()]
        reference = {o["key"]: answer(o) for o in ref_outcomes if o.get("status") == "done"}
        missing = [r.key for r in requests() if r.key not in reference]
        if missing:
            raise RuntimeError(f"the undisturbed pipeline did not answer {missing}: "
                               f"{[o for o in ref_outcomes if o['key'] in missing][:2]}")
        watcher = threading.Thread(target=self._watch, daemon=True)
        watcher.start()
        run_t0 = self.now()
        out_file = self.dir / "outcomes.jsonl"
        client = self._clients(out_file, ["--clients", str(clients), "--seconds", str(seconds),
                                          "--seed", str(self.seed), "--pause-file", str(self.pause)])
        self.quiet_from = run_t0 + warmup_s
        self.quiet_every = min(QUIET_EVERY_S, seconds / 4)
        end = time.monotonic() + seconds
        time.sleep(min(warmup_s, seconds) / 2)  # a calm start: the clients' first requests
        for ep in schedule(self.seed, seconds, len(self.friends), short=short, kinds=kinds or KINDS + COMBOS):
            if time.monotonic() > end - 30:
                break
            self.episodes.append(self.run_episode(ep, end))
        self.say(f"[{self.now():6.0f}s] the last faults are undone; the clients finish")
        client.wait(seconds + 700)
        final_whole = self.wait_whole(WHOLE_TIMEOUT_S)
        if final_whole is not None:
            self.quiet_sample(clients=False)   # the clients are done: the last quiet moment
        self._stop.set()
        watcher.join(30)
        outcomes = [json.loads(x) for x in out_file.read_text().splitlines()]
        verdict = check(reference, outcomes)
        recoveries = sorted((e for e in self.events.values() if e.get("event") in ("recovered", "rejoined")),
                            key=lambda e: e["t"])
        samples = [dict(s, t=s["t"] - run_t0) for s in self.quiet_samples]
        born: dict[int, float] = {}
        for s_ in self.samples + self.quiet_samples:
            born[s_["pid"]] = min(born.get(s_["pid"], s_["t"] - run_t0), s_["t"] - run_t0)
        peaks: dict[str, float] = {}
        for s_ in self.samples:
            peaks[s_["role"]] = max(peaks.get(s_["role"], 0.0), round(s_["rss"] / 2**20))
        return {"seed": self.seed, "seconds": seconds, "clients": clients, "injected": dict(sorted(self.injected.items())),
                "episodes": self.episodes, "verdict": verdict, "requests": len(outcomes), "wall0": self.wall0,
                "recoveries": [{k: e.get(k) for k in ("event", "seconds", "replan_s", "load_s", "stages", "replayed")}
                               for e in recoveries],
                "worst_recovery_s": max((e.get("seconds") or 0.0 for e in recoveries), default=None),
                "head_events": sorted({e.get("event") for e in self.events.values()}),
                "whole_at_end": final_whole is not None,
                "growth": grew(samples, warmup_s, min_life_s=min(seconds / 4, 120.0), born=born),
                "quiet_samples": len({s_["t"] for s_ in samples}), "quiet": samples,
                "peak_rss_mb": dict(sorted(peaks.items()))}

    def _clients(self, out: Path, extra: list[str]) -> subprocess.Popen:
        log = open(self.dir / "clients.log", "ab")
        p = self.net.popen(self.net.host(0), [sys.executable, "-m", "testkit.chaos_client", "--url",
                                              f"http://127.0.0.1:{API_PORT}", "--out", str(out), *extra],
                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        return p

    def close(self) -> list[str]:
        """Every node quits as the app would; the relay stops. Returns the processes still
        alive afterwards (none should be)."""
        self._stop.set()
        for node in [*self.friends, self.host]:
            for p in node.pids():
                self.seen_pids.setdefault(p, node.name)
            try:
                node.signal(signal.SIGCONT)   # a node left frozen must still be able to quit
                node.stop()
            except Exception:  # noqa: BLE001
                pass
        if self.relay is not None and self.relay.poll() is None:
            self.relay.terminate()
            self.relay.wait(20)
        time.sleep(1.0)
        alive = []
        for pid, role in self.seen_pids.items():
            try:
                with open(f"/proc/{pid}/status") as f:
                    if "zombie" not in f.read():
                        alive.append(f"{pid} ({role})")
            except OSError:
                pass
        return alive


def evening(seed: int, seconds: float, clients: int, workdir: Path, warmup_s: float | None = None,
            short: bool = False, kinds=None, say=print, subnet: int = 54) -> dict:
    """Set up three homes, run the evening, judge it; the report (bench/chaos.py prints it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    warmup = warmup_s if warmup_s is not None else min(60.0, seconds / 5)
    with home_internet(HOMES, stun=True, subnet=subnet) as net:
        ev = Evening(net, workdir, seed, say)
        try:
            report = ev.run(seconds, clients, warmup, short, kinds)
        finally:
            outlived = ev.close()
        report["outlived"] = outlived
        return report
