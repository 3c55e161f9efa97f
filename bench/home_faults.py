"""Three homes behind NAT, a reply streaming, and a fault: how long the reply stops,
whether it is the same reply, and how long until the friend is back in the pipeline.

Each run builds three homes in network namespaces (testkit/homenet.py: the host's
router with UPnP, the friends' port-preserving NATs, a STUN server; uplinks shaped with
tbf, by default host 10 Mbit/s, friend 1 10 Mbit/s, friend 2 2 Mbit/s, every download
10 Mbit/s) and runs what people type: `potluck host --listen 0.0.0.0:7870 --peers 2` in
home 0 and `potluck join <code> --name friendN` in homes 1 and 2 (each as `python -m
engine` from the checkout measured, the default model). Once the ring is whole, a
streamed chat completion (greedy, --max-tokens tokens) is answered without a fault (the
reference), and after a short pause the same request again while one fault is
injected, held and undone:

  * linkdown       friend 2's line is down (its router's cable out) for --linkdown-s
                   (default 30 s), 4 s into the reply;
  * sleep          friend 1's processes are stopped (SIGSTOP, a laptop asleep) for
                   --sleep-s (default 40 s), 4 s into the reply, then woken (SIGCONT);
  * throttle_long  friend 1's upload collapses to --throttle-rate (default 256 kbit/s)
                   for --throttle-s (default 40 s), 0.5 s into a reply to a ~1.2k-token
                   prompt (the prompt's activations cross that link);
  * hoststop       the host's processes are stopped for --hoststop-s (default 20 s),
                   4 s into the reply.

Every run starts from fresh homes and processes, so a scenario never inherits the
previous one's back-off or half-finished rearrangement. Measured per run:

  longest stall   the longest wait for the next piece of the faulted reply (counted from
                  the request, so a stop before its first token counts too)
  reply           the faulted reply's total time (beside it, the fault-free reply's)
  same text       the faulted reply's text equals the fault-free reply's
  back            seconds from undoing the fault until the ring is whole again (GET
                  /v1/potluck/status in the host's home, every 0.5 s: every friend a
                  stage, nothing being recovered) and stays so until the run ends; 0
                  when it never broke after the undo; "never" when not whole within
                  --recover-timeout
  held            the head's "slow" events from the fault on: a friend that answered
                  again but whose line, timed, could not carry the replay yet, held out
                  (engine/core/line_check.py; said once per absence)
  drops           the head's "left" events from the fault until the run ends: how many
                  times a stage was let go (one fault can cost more than one: a line down
                  behind friend 2 may first be blamed on friend 1, whose link to it
                  dropped; --json lists each one's reason, and every run's log folder
                  keeps the terminals and the head's events.jsonl)

A run ends once the reply is done and the ring has been whole for --settle seconds.

--src DIR[,DIR2] runs each scenario against one or two checkouts of Potluck, side by
side in one run (scenario by scenario, the checkouts in turn), so that a change can be
compared with the commit before it:

    git worktree add /tmp/pl-before HEAD~1
    sudo .venv/bin/python bench/home_faults.py --src /tmp/pl-before,.
        [--faults linkdown,throttle_long,sleep,hoststop] [--repeat 1] [--json out.json]

Each checkout runs with its own code (cwd and PYTHONPATH set to it) and this
repository's .venv python (--python to choose another); the homes are built by this
checkout's testkit. The table gives each measure per checkout (medians over --repeat)
and the second against the first (a ratio for times, a difference for drops).

Needs root (namespaces, iptables) and Debian's iptables, miniupnpd and coturn
(`python -m testkit.homenet --install`). About 2-3 minutes per scenario per checkout
(each run loads the model three times); the model must be in the local cache
(HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

from testkit.homenet import HomeSpec, home_internet, homenet_available, stun_available, upnp_available  # noqa: E402

API_PORT = 8000
LISTEN = "0.0.0.0:7870"
HOMES = (HomeSpec(nat="eim", upnp=True), HomeSpec(nat="eim"), HomeSpec(nat="eim"))
DOWN_BPS = 10e6
FAULTS = ("linkdown", "sleep", "throttle_long", "hoststop")
STORY = "Write a long story about a lighthouse keeper and a storm."
# ~1.2k tokens with the default model's tokenizer
NOTES = ("Here are my notes. "
         + " ".join(f"Note {i}: the lighthouse lamp was checked at {i} o'clock and the oil level was fine."
                    for i in range(60))
         + " Summarise the notes in a long story.")


# ---- the host's API, from inside its home -------------------------------------------------
def _get_status(port: int) -> dict | None:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
        c.request("GET", "/v1/potluck/status")
        r = c.getresponse()
        body = r.read()
        c.close()
        return json.loads(body) if r.status == 200 else None
    except (OSError, ValueError, http.client.HTTPException):
        return None


def _stream(port: int, body: dict, timeout: float) -> dict:
    """One streamed chat completion: the arrival time of every piece of text, the text."""
    t0 = time.monotonic()
    rec = {"times": [], "text": "", "error": None, "finish": None}
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            rec["error"] = f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"
        while rec["error"] is None:
            line = r.readline()
            if not line:
                rec["error"] = "the stream ended without [DONE]"
                break
            s = line.decode(errors="replace").strip()
            if not s.startswith("data:"):
                continue          # blank lines, ": keep-alive" comments
            data = s[5:].strip()
            if data == "[DONE]":
                break
            j = json.loads(data)
            if "error" in j:
                rec["error"] = str(j["error"])[:300]
                break
            for ch in j.get("choices", []):
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    rec["text"] += piece
                    rec["times"].append(time.monotonic() - t0)
                rec["finish"] = ch.get("finish_reason") or rec["finish"]
        c.close()
    except Exception as e:  # noqa: BLE001 -- a reply that breaks is a measurement
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["elapsed"] = time.monotonic() - t0
    marks = [0.0, *rec["times"]]
    rec["stall"] = max((b - a for a, b in zip(marks, marks[1:])), default=None)
    return rec


def request_body(kind: str, max_tokens: int) -> dict:
    text = NOTES if kind == "long" else STORY
    return {"model": "default", "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": text}]}


# ---- one checkout's pipeline across the homes ----------------------------------------------
class Checkout:
    def __init__(self, path: str, python: str):
        self.path = Path(path).resolve()
        if not (self.path / "engine" / "__main__.py").exists():
            raise SystemExit(f"{path}: not a Potluck checkout (no engine/__main__.py)")
        self.python = python

        def git(*a):
            p = subprocess.run(["git", "-C", str(self.path), *a], capture_output=True, text=True)
            return p.stdout.strip() if p.returncode == 0 else ""

        # the checkout's own engine, not one an installed (editable) package points at
        p = subprocess.run([python, "-c", "import engine; print(engine.__file__)"], cwd=self.path,
                           env=dict(os.environ, PYTHONPATH=str(self.path)), capture_output=True, text=True)
        if p.returncode != 0 or not Path(p.stdout.strip()).resolve().is_relative_to(self.path):
            raise SystemExit(f"{path}: {python} -m engine would not run this checkout's engine: "
                             f"{(p.stdout + p.stderr).strip()[-500:]}")
        rev = git("rev-parse", "--short", "HEAD") or "?"
        dirty = "+changes" if git("status", "--porcelain", "--untracked-files=no") else ""
        self.label = f"{self.path.name} ({rev}{dirty})"


class Proc:
    """A `python -m engine ...` in a home, in a process group of its own (so that SIGSTOP
    and Ctrl+C reach everything it started, as a terminal's would)."""

    def __init__(self, name: str, ns: str, argv: list[str], env: dict, cwd: Path, logdir: Path):
        self.name, self.ns, self.argv, self.env, self.cwd, self.logdir = name, ns, argv, env, cwd, logdir
        self.p: subprocess.Popen | None = None

    def start(self, net):
        with open(self.logdir / f"{self.name}.out", "ab") as so, open(self.logdir / f"{self.name}.err", "ab") as se:
            self.p = subprocess.Popen(net.argv(self.ns, self.argv), env=self.env, cwd=self.cwd, stdout=so,
                                      stderr=se, stdin=subprocess.DEVNULL, start_new_session=True)

    def signal(self, sig: int):
        if self.p is not None and self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, deadline: float):
        """After a Ctrl+C (signal(SIGINT)): wait for it until `deadline`, then kill."""
        if self.p is None:
            return
        try:
            self.p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.p.wait(10)
        try:   # anything of its group still there
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Watch:
    """The host's status every 0.5 s, from its home: whether the ring is whole, and every
    event the head reports (its status lists only the last 20)."""

    def __init__(self, net, stages: int):
        self.net, self.stages = net, stages
        self.samples: list[tuple[float, bool]] = []
        self.events: dict[str, dict] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def status(self) -> dict | None:
        try:
            return self.net.call_in(self.net.host(0), _get_status, API_PORT, timeout=15)
        except (OSError, TimeoutError):
            return None

    def whole_in(self, st: dict | None) -> bool:
        return bool(st) and len(st.get("stages") or []) == self.stages and not st.get("recovering") \
            and not st.get("error")

    def _run(self):
        while not self._stop.is_set():
            t = time.monotonic()
            st = self.status()
            self.samples.append((t, self.whole_in(st)))
            for e in (st or {}).get("events") or []:
                self.events.setdefault(json.dumps(e, sort_keys=True), e)
            self._stop.wait(max(0.0, 0.5 - (time.monotonic() - t)))

    def start(self):
        self._t.start()

    def close(self):
        self._stop.set()
        self._t.join(20)

    def whole_for(self) -> float:
        """Seconds the ring has been whole, up to the last sample (0: not whole now)."""
        since = None
        for t, ok in self.samples:
            since = (since if since is not None else t) if ok else None
        return 0.0 if since is None else self.samples[-1][0] - since

    def back_after(self, t_undo: float) -> float | None:
        """From the undo until the ring was whole for good (see the docstring)."""
        after = [(t, ok) for t, ok in self.samples if t >= t_undo]
        if not after or not after[-1][1]:
            return None
        broken = [i for i, (_, ok) in enumerate(after) if not ok]
        if not broken:
            return 0.0
        return after[broken[-1] + 1][0] - t_undo

    def of(self, event: str, wall_from: float) -> list[dict]:
        return sorted((e for e in self.events.values() if e.get("event") == event and e.get("t", 0) >= wall_from),
                      key=lambda e: e.get("t", 0))


class Homes:
    """The host and two friends of one checkout, on a built home internet."""

    def __init__(self, net, co: Checkout, args, logdir: Path):
        self.net, self.co, self.args, self.dir = net, co, args, logdir
        self.ups = [float(x) * 1e6 for x in args.up.split(",")]

        # POTLUCK_KEEP_REPLIES=0: the faulted request repeats the fault-free one, and would
        # otherwise take its kept reply over and send no prompt through the fault
        def env(name):
            return dict(os.environ, POTLUCK_HOME=str(logdir / "homes" / name), POTLUCK_KEYSTORE="file",
                        POTLUCK_KEEP_REPLIES="0",
                        HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1",
                        TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(co.path),
                        POTLUCK_STUN=",".join(f"{h}:{p}" for h, p in (net.stun_addr, net.stun_addr2)))

        self.env = env
        self.host = Proc("host", net.host(0), [co.python, "-m", "engine", "host", "--listen", LISTEN, "--peers", "2",
                                               "--port", str(API_PORT)], env("host"), co.path, logdir)
        self.friends: list[Proc] = []
        self.watch = Watch(net, 3)

    def start(self):
        for i, up in enumerate(self.ups):
            self.net.shape(i, up, "up")
            self.net.shape(i, DOWN_BPS, "down")
        self.host.start(self.net)
        code = self.wait_code(self.args.ready_timeout)
        for i in (1, 2):
            f = Proc(f"friend{i}", self.net.host(i), [self.co.python, "-m", "engine", "join", code, "--name",
                                                      f"friend{i}"], self.env(f"friend{i}"), self.co.path, self.dir)
            f.start(self.net)
            self.friends.append(f)
            # one after the other, as the host sees them arrive: the pipeline's order is the
            # order they joined, and each fault is aimed at a place in it (friend 1 the middle
            # stage, whose uplink carries the prompt's activations; friend 2 the last)
            deadline = time.monotonic() + self.args.ready_timeout
            while f"(friend{i}) connected" not in self.tail("host", 100_000):
                if f.p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"friend{i} did not connect: {self.tail(f'friend{i}')}")
                time.sleep(0.2)
        self.watch.start()
        deadline = time.monotonic() + self.args.ready_timeout
        while self.watch.whole_for() < 1.0:
            for p in (self.host, *self.friends):
                if p.p.poll() is not None:
                    raise RuntimeError(f"{p.name} exited ({p.p.returncode}): {self.tail(p.name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ring was not whole after {self.args.ready_timeout:.0f} s: "
                                   f"{self.tail('host')}")
            time.sleep(0.5)

    def tail(self, name: str, n: int = 1500) -> str:
        try:
            return (self.dir / f"{name}.err").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_code(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        out = self.dir / "host.out"
        while time.monotonic() < deadline:
            text = out.read_text(errors="replace") if out.exists() else ""
            if "Invite code" in text:
                lines = text.split("Invite code", 1)[1].splitlines()
                if len(lines) > 1 and lines[1].strip():
                    return lines[1].strip()
            if self.host.p.poll() is not None:
                raise RuntimeError(f"the host exited ({self.host.p.returncode}): {self.tail('host')}")
            time.sleep(0.3)
        raise RuntimeError(f"no invite code from the host in {timeout:.0f} s: {self.tail('host')}")

    def reply_async(self, body: dict) -> tuple[threading.Thread, dict]:
        box: dict = {}

        def go():
            try:
                box.update(self.net.call_in(self.net.host(0), _stream, API_PORT, body, 600.0, timeout=900))
            except Exception as e:  # noqa: BLE001
                box.update(error=f"{type(e).__name__}: {e}", text="", times=[], stall=None, elapsed=None)

        t = threading.Thread(target=go, daemon=True)
        t.start()
        return t, box

    def stop(self):
        self.watch.close()
        for p in (*self.friends, self.host):
            p.signal(signal.SIGCONT)
        for p in (*self.friends, self.host):       # as Ctrl+C in each terminal
            p.signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        for p in (*self.friends, self.host):
            p.stop(deadline)

    # ---- the faults: each returns (inject, undo, hold_s, delay_s, request kind) ------------
    def _line(self, i: int, state: str):
        lk = self.net.links[i]        # the hub's side of home i's line
        self.net.exec(lk.b_ns, ["ip", "link", "set", lk.b_dev, state])

    def fault(self, name: str):
        a = self.args
        if name == "linkdown":
            return (lambda: self._line(2, "down")), (lambda: self._line(2, "up")), a.linkdown_s, 4.0, "story"
        if name == "sleep":
            f = self.friends[0]
            return (lambda: f.signal(signal.SIGSTOP)), (lambda: f.signal(signal.SIGCONT)), a.sleep_s, 4.0, "story"
        if name == "throttle_long":
            rate = parse_rate(a.throttle_rate)
            return ((lambda: self.net.shape(1, rate, "up")), (lambda: self.net.shape(1, self.ups[1], "up")),
                    a.throttle_s, 0.5, "long")
        if name == "hoststop":
            h = self.host
            return (lambda: h.signal(signal.SIGSTOP)), (lambda: h.signal(signal.SIGCONT)), a.hoststop_s, 4.0, "story"
        raise ValueError(name)


def parse_rate(text: str) -> float:
    t = text.strip().lower().removesuffix("/s").removesuffix("bit").removesuffix("bps")
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}.get(t[-1:], 1.0)
    return float(t[:-1] if t[-1:] in "kmg" else t) * mult


def one_run(co: Checkout, name: str, args, logdir: Path) -> dict:
    logdir.mkdir(parents=True, exist_ok=True)
    row = {"fault": name, "src": co.label}
    with home_internet(HOMES, stun=True) as net:
        homes = Homes(net, co, args, logdir)
        undo, undone = None, True
        try:
            t = time.monotonic()
            homes.start()
            row["ready_s"] = time.monotonic() - t
            inject, undo, hold, delay, kind = homes.fault(name)
            body = request_body(kind, args.max_tokens)
            th, ref = homes.reply_async(body)
            th.join()
            if ref.get("error"):
                raise RuntimeError(f"the fault-free reply failed: {ref['error']}")
            time.sleep(args.pause)
            th, got = homes.reply_async(body)
            time.sleep(delay)
            wall_inject = time.time()
            undone = False
            inject()
            time.sleep(hold)
            undo()
            undone = True
            t_undo = time.monotonic()
            deadline = t_undo + args.recover_timeout
            while time.monotonic() < deadline and (th.is_alive() or homes.watch.whole_for() < args.settle):
                time.sleep(0.5)
            th.join(max(1.0, deadline - time.monotonic()))
            row.update(
                stall_s=got.get("stall"), reply_s=got.get("elapsed"), error=got.get("error"),
                ref_stall_s=ref.get("stall"), ref_reply_s=ref.get("elapsed"),
                same=(got.get("text") == ref.get("text") and not got.get("error")) if not th.is_alive() else False,
                back_s=homes.watch.back_after(t_undo), drops=len(homes.watch.of("left", wall_inject - 1.0)),
                left=[e.get("why") for e in homes.watch.of("left", wall_inject - 1.0)],
                held=len(homes.watch.of("slow", wall_inject - 1.0)),
                tokens=len(got.get("times") or []))
            if th.is_alive():
                row["error"] = f"no end to the reply {args.recover_timeout:.0f} s after the undo"
        except Exception as e:  # noqa: BLE001 -- a run that fails is a row of the table
            row["failed"] = f"{type(e).__name__}: {e}"
        finally:
            if not undone and undo is not None:
                try:
                    undo()
                except Exception:  # noqa: BLE001
                    pass
            homes.stop()
            with open(logdir / "events.jsonl", "w") as f:    # the head's events, for the record
                for e in sorted(homes.watch.events.values(), key=lambda e: e.get("t", 0)):
                    f.write(json.dumps(e) + "\n")
    return row


# ---- the table -----------------------------------------------------------------------------
def _med(rows, key):
    vals = [r.get(key) for r in rows if "failed" not in r and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "failed" not in r]
    return {"n": len(rows), "ok": len(ok),
            "stall_s": _med(rows, "stall_s"), "reply_s": _med(rows, "reply_s"), "ref_reply_s": _med(rows, "ref_reply_s"),
            "back_s": _med(rows, "back_s"), "never": sum(1 for r in ok if r.get("back_s") is None),
            "drops": _med(rows, "drops"), "held": _med(rows, "held"), "same": sum(1 for r in ok if r.get("same")),
            "errors": [r.get("failed") or r.get("error") for r in rows if r.get("failed") or r.get("error")]}


def fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def cells(s: dict) -> dict[str, str]:
    if not s["ok"]:
        return {m: "FAILED" for m in MEASURES}
    back = "never" if s["back_s"] is None else fmt(s["back_s"])
    if s["never"] and s["back_s"] is not None:
        back += f" ({s['never']} never)"
    return {"longest stall s": fmt(s["stall_s"]), "reply s": fmt(s["reply_s"]),
            "fault-free reply s": fmt(s["ref_reply_s"]),
            "same text": "yes" if s["same"] == s["ok"] == s["n"] else f"{s['same']}/{s['n']}",
            "back after undo s": back, "drops": fmt(s["drops"]), "held: line too slow": fmt(s["held"])}


MEASURES = ("longest stall s", "reply s", "fault-free reply s", "same text", "back after undo s", "drops",
            "held: line too slow")


def compare(measure: str, a: dict, b: dict) -> str:
    if not (a["ok"] and b["ok"]):
        return ""
    key = {"longest stall s": "stall_s", "reply s": "reply_s", "fault-free reply s": "ref_reply_s",
           "back after undo s": "back_s", "drops": "drops", "held: line too slow": "held"}.get(measure)
    if key is None:
        return ""
    x, y = a[key], b[key]
    if x is None or y is None:
        return ""
    if key in ("drops", "held"):
        return f"{y - x:+g}"
    return f"{y / x:.2f}x" if x > 0.05 else f"{y - x:+.1f} s"


def print_table(faults, srcs, results):
    if len(srcs) == 1:
        print("\n| fault | " + " | ".join(MEASURES) + " | |")
        print("|---|" + "---:|" * len(MEASURES) + "---|")
        for f in faults:
            s = summary(results[(f, srcs[0].label)])
            c = cells(s)
            print(f"| {f} | " + " | ".join(c[m] for m in MEASURES) + f" | {'; '.join(e[:80] for e in s['errors'])} |")
        return
    a_lab, b_lab = srcs[0].label, srcs[1].label
    print(f"\n| fault | measure | {a_lab} | {b_lab} | second / first |")
    print("|---|---|---:|---:|---:|")
    for f in faults:
        sa, sb = summary(results[(f, a_lab)]), summary(results[(f, b_lab)])
        ca, cb = cells(sa), cells(sb)
        for m in MEASURES:
            print(f"| {f} | {m} | {ca[m]} | {cb[m]} | {compare(m, sa, sb)} |")
        for lab, s in ((a_lab, sa), (b_lab, sb)):
            for e in s["errors"]:
                print(f"| {f} | error | {lab}: {e[:150]} | | |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", default="linkdown,throttle_long",
                    help=f"comma-separated, of {', '.join(FAULTS)} (default linkdown,throttle_long)")
    ap.add_argument("--src", default=str(ROOT),
                    help="one or two Potluck checkouts, comma-separated (default: this one); with two, the table "
                         "gives the second against the first")
    ap.add_argument("--python", default=None,
                    help="the python that runs `-m engine` (default: this repository's .venv/bin/python)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per scenario and checkout (the table: medians)")
    ap.add_argument("--linkdown-s", type=float, default=30.0, help="linkdown: seconds friend 2's line is down")
    ap.add_argument("--sleep-s", type=float, default=40.0, help="sleep: seconds friend 1 is stopped")
    ap.add_argument("--hoststop-s", type=float, default=20.0, help="hoststop: seconds the host is stopped")
    ap.add_argument("--throttle-s", type=float, default=40.0, help="throttle_long: seconds friend 1 is throttled")
    ap.add_argument("--throttle-rate", default="256kbit", help="friend 1's upload while throttled (default 256kbit)")
    ap.add_argument("--up", default="10,10,2", help="Mbit/s uploads of the host, friend 1, friend 2 (default 10,10,2)")
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens per reply (default 200)")
    ap.add_argument("--pause", type=float, default=5.0, help="seconds between the fault-free and the faulted reply")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="a run ends once the reply is done and the ring has been whole this long (default 10 s)")
    ap.add_argument("--recover-timeout", type=float, default=240.0,
                    help="seconds after the undo to wait for the reply and the ring (default 240)")
    ap.add_argument("--ready-timeout", type=float, default=400.0, help="seconds for the ring to be whole at the start (default 400)")
    ap.add_argument("--logs", default=None, help="keep every run's terminals here (default: a temp dir, removed "
                                                 "unless a run fails)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        ap.error(f"unknown fault(s) {', '.join(bad)}: choose from {', '.join(FAULTS)}")
    dirs = [d.strip() for d in args.src.split(",") if d.strip()]
    if not 1 <= len(dirs) <= 2:
        ap.error("--src takes one or two checkouts")
    venv = ROOT / ".venv" / "bin" / "python"
    python = args.python or (str(venv) if venv.exists() else sys.executable)
    srcs = [Checkout(d, python) for d in dirs]
    if len(srcs) == 2 and srcs[0].label == srcs[1].label:
        srcs[1].label += " #2"
    for probe in (homenet_available, upnp_available, stun_available):
        ok, why = probe()
        if not ok:
            print(f"home_faults: cannot build the homes here: {why}", file=sys.stderr)
            return 2

    # a SIGTERM (a CI timeout) unwinds like Ctrl+C: every finally runs and the homes go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="home-faults-"))
    results: dict[tuple[str, str], list[dict]] = {(f, s.label): [] for f in faults for s in srcs}
    all_rows = []
    print(f"python {python}; faults {', '.join(faults)}; checkouts: {'; '.join(s.label for s in srcs)}; "
          f"logs in {logs}", flush=True)
    for rep in range(args.repeat):
        for f in faults:
            for i, co in enumerate(srcs):
                t = time.monotonic()
                row = one_run(co, f, args, logs / f"{f}-{i}-{rep}")
                row["run_s"] = time.monotonic() - t
                results[(f, co.label)].append(row)
                all_rows.append(row)
                if "failed" in row:
                    line = f"FAILED: {row['failed'][:400]}"
                else:
                    back = "never" if row["back_s"] is None else f"{row['back_s']:.1f} s"
                    line = (f"longest stall {fmt(row['stall_s'])} s, reply {fmt(row['reply_s'])} s (fault-free "
                            f"{fmt(row['ref_reply_s'])} s), same text {'yes' if row['same'] else 'NO'}, back {back} "
                            f"after the undo, drops {row['drops']}, held {row.get('held')}" + (f", error: {row['error']}" if row["error"] else ""))
                ready = f"ring whole {row['ready_s']:.0f} s after the start, " if "ready_s" in row else ""
                print(f"  {f}, {co.label}, run {rep + 1}: {line} [{ready}{row['run_s']:.0f} s in all]", flush=True)
    print_table(faults, srcs, results)
    if args.json:
        Path(args.json).write_text(json.dumps(all_rows, indent=1))
    failed = any("failed" in r or r.get("error") for r in all_rows)
    if not args.logs:
        if failed:
            print(f"\nlogs of the runs: {logs}")
        else:
            shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
