"""Paths between homes (issue 33): what sealing costs, what going direct gains, and
which path each kind of home gets.

Three parts:

  * seal      one message sealed and opened (engine/wire/stage_auth.py Seal) at the
              sizes the links carry: a decode step's activations (576 floats), a
              prompt piece of 64 KiB and of 256 KiB (link.py's largest); µs per
              message and MB/s.
  * link      the default model's 2-stage pipeline (the head holds stage 0, an
              in-process StageServer the rest) over one emulated link, a
              testkit.linkemu.ShapedLink (50 Mbit/s, 20 ms one way by default), four ways:
                plain   the stage link with Seal's cipher swapped for a copy that keeps
                        its framing (the LAN link as it was before protocol 13)
                sealed  the stage link as shipped (a friend's share on the LAN)
                direct  through the tunnel between homes (engine/wire/tunnel.py, Noise),
                        the joiner reaching the host's address over the shaped link
                relay   through the tunnel via a relay (engine/wire/relay.py): both the
                        host's and the joiner's leg cross a shaped link like it
              TTFT and TPOT of greedy replies; each round starts each way afresh, in a
              rotating order, so the machine's drift falls on all; median round kept.
  * matrix    (--matrix, as root with the Debian parts of testkit/homenet.py) the
              join in emulated homes, NAT A x NAT B x router UPnP x relay, with a STUN
              server on the public side: the path taken, the time from the code to a
              joined tunnel, for a relayed join the path it moved to (hole punching)
              and when, and with no relay the join by the friend's reply code (its
              address, or a hole punched from both sides), by testkit/pathpeer.py's
              processes.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/paths.py                  # seal + link, ~5 min
    HF_HUB_OFFLINE=1 .venv/bin/python bench/paths.py --matrix         # + the matrix, ~5 min more

Targets (issue 33): sealing costs at most 5% of decode tok/s (sealed / plain >= 0.95);
every cell where a direct path is possible gets one, within 3 s of the join.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

PROMPTS = ["What is the capital of France?", "Name three colours of the rainbow.",
           "Write one sentence about the sea.", "How many legs does a spider have?"]


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def seal_micro(repeat: int) -> list[tuple[str, float, float]]:
    from engine.wire.stage_auth import Seal

    a, b = Seal(b"k" * 32, b"l" * 32), Seal(b"l" * 32, b"k" * 32)
    rows = []
    for name, size in (("decode step (576 floats)", 576 * 4 + 120), ("prompt piece 64 KiB", 64 << 10),
                       ("prompt piece 256 KiB", 256 << 10)):
        msg = os.urandom(size)
        n = max(50, repeat * (1 << 20) // size)
        t0 = time.perf_counter()
        for _ in range(n):
            b.open(a.seal(msg))
        dt = (time.perf_counter() - t0) / n
        rows.append((name, dt * 1e6, size / dt / 1e6))
    return rows


class PlainSeal:
    """Seal's framing without the cipher: what the links cost before they were sealed."""

    def seal(self, msg):
        return b"\x01" + msg.encode() if isinstance(msg, str) else b"\x02" + bytes(msg)

    def open(self, message):
        return message[1:].decode() if message[0] == 1 else message[1:]


async def _measure(head, a) -> dict:
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Done

    ttft, tpot = [], []
    for text in PROMPTS:
        prompt = head.chat_prompt([{"role": "user", "content": text}])
        handle = head.submit(prompt, SamplingParams(greedy=True, max_tokens=a.tokens))
        times = []
        t0 = time.perf_counter()
        async for ev in handle:
            if isinstance(ev, Done):
                break
            times += [time.perf_counter()] * len(ev.token_ids)
        ttft.append(times[0] - t0)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
    return {"ttft": statistics.mean(ttft), "tpot": statistics.mean(tpot)}


async def one_mode(mode: str, a, folder: Path) -> dict:
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.pipeline.stage_server import StageServer
    from engine.wire import stage_auth
    from engine.wire.identity import load_or_create_identity
    from engine.wire.invite import HostState, parse
    from engine.wire.relay import Relay
    from engine.wire.tunnel import TunnelHost, open_session
    from testkit.linkemu import ShapedLink

    def shaped(port: int) -> ShapedLink:
        return ShapedLink("127.0.0.1", 0, "127.0.0.1", port, rate_bps=a.rate * 1e6, delay_s=a.delay / 1e3)

    saved = stage_auth.Seal.seal, stage_auth.Seal.open
    if mode == "plain":
        stage_auth.Seal.seal, stage_auth.Seal.open = PlainSeal.seal, PlainSeal.open
    closing: list = []
    server = await StageServer("127.0.0.1", 0, pipeline="local", threads=1).start()
    closing.append(server.close)
    try:
        if mode in ("plain", "sealed"):
            link = shaped(server.port)
            address = f"ws://127.0.0.1:{await link.start()}"
            closing.append(link.close)
            pipeline = "local"
        else:
            home = folder / f"{mode}-{time.monotonic_ns()}"
            th = TunnelHost(load_or_create_identity(home / "host"), HostState(home / "host"))
            closing.append(th.close)
            if mode == "direct":
                port = await th.listen("127.0.0.1", 0)
                link = shaped(port)
                th_addr = f"ws://127.0.0.1:{await link.start()}"
                closing.append(link.close)
                th.direct_addresses, th.direct_kinds = [th_addr], ["given"]
            else:
                relay = await Relay().start("127.0.0.1", 0)
                closing.append(relay.close)
                link = shaped(relay.port)
                url = f"ws://127.0.0.1:{await link.start()}"
                closing.append(link.close)
                await th.use_relay(url)
                while not relay.pipelines:
                    await asyncio.sleep(0.05)
            invite = parse(th.invite())
            session = await open_session(invite, load_or_create_identity(home / "joiner"),
                                         ("127.0.0.1", server.port), prefer=mode)
            closing.append(lambda: session.close("done"))
            peer = await th.wait_peer()
            address, pipeline = peer.address, "local"
        pipe = await launch(PipelineConfig(stage_addr=[address], threads=1, pipeline=pipeline))
        closing.append(pipe.close)
        return await _measure(pipe.head, a)
    finally:
        for close in reversed(closing):
            try:
                await close()
            except Exception:  # noqa: BLE001 -- tearing down; the next mode starts afresh
                pass
        stage_auth.Seal.seal, stage_auth.Seal.open = saved


MODES = ("plain", "sealed", "direct", "relay")


async def link_rounds(a) -> dict:
    import tempfile

    results = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(a.rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                m = await one_mode(mode, a, Path(folder))
                results[mode].append(m)
                log(f"round {r + 1} {mode}: TTFT {m['ttft'] * 1e3:.0f} ms, TPOT {m['tpot'] * 1e3:.1f} ms")
    return results


# ---- the three-home ring (issue 43) ----------------------------------------------------
RING_MODES = ("star", "direct")
LONG_PROMPT_TOKENS = 1000


def light_model(folder: Path) -> str:
    """The default model's width (hidden 576, 9 heads, 3 KV heads, its vocabulary and
    tokenizer) with one decoder layer per stage, random weights: the same activations on
    the wire, with the little compute GPUs would give a stage, so that the ring measures the
    paths between homes and not this machine's two cores (--ring-model default: the real one)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.model.sources import resolve

    out = folder / "light-576"
    if (out / "config.json").exists():
        return str(out)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                      rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
    src = resolve("default").root
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return str(out)


async def ring_mode(mode: str, a, folder: Path) -> dict:
    """The default model in three homes: the host (the head, stage 0), friend A (stage 1)
    and friend B (stage 2), each pair of homes `ring_delay` ms apart one way, each home's
    uplink `ring_rate` Mbit/s: both friends' tunnels cross ONE shaped link into the host
    (its uplink is what both share), and A reaches B's door through its own. "star":
    stage 1 -> stage 2 through the host (POTLUCK_FRIEND_HOPS=0), "direct": straight
    across (engine/wire/friend_hop.py). Returns one reply's TPOT, a 1000-token prompt's
    TTFT and the bytes the host's link carried each way."""
    from engine.core.sampling import SamplingParams
    from engine.pipeline.head import Done
    from engine.pipeline.launch import PipelineConfig, launch
    from engine.pipeline.stage_server import StageServer
    from engine.wire import candidates as cand
    from engine.wire.identity import load_or_create_identity
    from engine.wire.invite import HostState, parse
    from engine.wire.tunnel import TunnelHost, open_session
    from testkit.linkemu import ShapedLink

    def shaped(port: int) -> ShapedLink:
        return ShapedLink("127.0.0.1", 0, "127.0.0.1", port, rate_bps=a.ring_rate * 1e6, delay_s=a.ring_delay / 1e3)

    os.environ["POTLUCK_FRIEND_HOPS"] = "1" if mode == "direct" else "0"
    closing: list = []
    doors: list[ShapedLink] = []
    real_gather = cand.gather

    async def door_behind_a_link(port, **kw):      # B's door, as A reaches it: across the homes' link
        link = shaped(port)
        doors.append(link)
        closing.append(link.close)
        return cand.Gathered([cand.Candidate("lan", f"ws://127.0.0.1:{await link.start()}")])

    cand.gather = door_behind_a_link
    try:
        home = folder / f"ring-{mode}-{time.monotonic_ns()}"
        th = TunnelHost(load_or_create_identity(home / "host"), HostState(home / "host"))
        closing.append(th.close)
        port = await th.listen("127.0.0.1", 0)
        uplink = shaped(port)
        th.direct_addresses, th.direct_kinds = [f"ws://127.0.0.1:{await uplink.start()}"], ["given"]
        closing.append(uplink.close)
        invite = parse(th.invite(uses=2))
        peers = []
        for name in ("a", "b"):
            server = await StageServer("127.0.0.1", 0, pipeline="local", threads=1).start()
            closing.append(server.close)
            session = await open_session(invite, load_or_create_identity(home / name), ("127.0.0.1", server.port),
                                         name=name)
            closing.append(lambda s=session: s.close("done"))
            peers.append(await th.wait_peer())
        by_addr = {p.address: p for p in peers}

        async def hop(src: str, dst: str) -> str:
            return await th.open_hop(by_addr[src], by_addr[dst])

        model = "default" if a.ring_model == "default" else light_model(folder)
        # speculation off: one token a trip around the ring, the path's own measure (a
        # random model's repetitive reply would let prompt lookup guess most of it)
        pipe = await launch(PipelineConfig(model=model, stage_addr=[p.address for p in peers], hop=hop, threads=1,
                                           pipeline="local", speculate="off"))
        closing.append(pipe.close)
        head = pipe.head
        head.eos_ids = set()
        links = th.hop_links()

        async def reply(prompt: list[int], n: int) -> list[float]:
            times, t0 = [], time.perf_counter()
            async for ev in head.submit(prompt, SamplingParams(greedy=True, max_tokens=n)):
                if isinstance(ev, Done):
                    break
                times += [time.perf_counter()] * len(ev.token_ids)
            return [t0] + times

        def ids(text: str) -> list[int]:        # plain text: the light model has no chat template
            return head.tokenizer.encode(text)

        short = ids(PROMPTS[0])
        await reply(short, 4)                                # warm-up: every link open, every stage loaded
        up0, down0 = uplink.bytes_down, uplink.bytes_up
        t = await reply(short, a.tokens)
        tpot = (t[-1] - t[1]) / (len(t) - 2)
        text = " ".join(PROMPTS) + " "
        while len(ids(text)) < LONG_PROMPT_TOKENS:
            text += " ".join(PROMPTS) + " "
        long = ids(text)[:LONG_PROMPT_TOKENS]
        bw = head.link.sched.link.bandwidth if head.link is not None else None
        chunk = head.prompt_chunk_tokens()
        t = await reply(long, 2)
        ttft = t[1] - t[0]
        log(f"{mode}: the head's link measured {bw and bw * 8 / 1e6 or 0:.1f} Mbit/s, prompt chunks of {chunk} tokens")
        return {"tpot": tpot, "ttft": ttft, "host_up": uplink.bytes_down - up0,
                "host_down": uplink.bytes_up - down0, "paths": [x["path"] for x in links]}
    finally:
        cand.gather = real_gather
        os.environ.pop("POTLUCK_FRIEND_HOPS", None)
        for close in reversed(closing):
            try:
                await close()
            except Exception:  # noqa: BLE001 -- tearing down; the next mode starts afresh
                pass


async def ring_rounds(a) -> dict:
    import tempfile

    results = {m: [] for m in RING_MODES}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(a.rounds):
            for mode in (RING_MODES if r % 2 == 0 else RING_MODES[::-1]):
                m = await ring_mode(mode, a, Path(folder))
                results[mode].append(m)
                log(f"ring round {r + 1} {mode} ({', '.join(m['paths'])}): TPOT {m['tpot'] * 1e3:.0f} ms, "
                    f"TTFT of {LONG_PROMPT_TOKENS} tokens {m['ttft']:.2f} s, host link {m['host_up'] / 1e3:.0f} KB "
                    f"out / {m['host_down'] / 1e3:.0f} KB in")
    return results


def print_ring(a, res: dict) -> None:
    med = {m: {k: statistics.median(x[k] for x in res[m]) for k in ("tpot", "ttft", "host_up", "host_down")}
           for m in res}
    what = ("The default model" if a.ring_model == "default" else
            "A model of the default model's width, one layer a stage (--ring-model light)")
    print(f"\n{what} in three homes (the host, friends A and B; stages 0, 1, 2), every two homes "
          f"{a.ring_delay:g} ms apart one way, {a.ring_rate:g} Mbit/s links; star: stage 1 -> stage 2 through "
          f"the host, direct: straight across (issue 43). Median of {a.rounds} rounds, alternating order; one "
          f"reply of {a.tokens} tokens (speculation off: one token a trip), then a {LONG_PROMPT_TOKENS}-token prompt\n")
    print(f"| {'hop A -> B':<10} | {'TPOT ms':>8} | {'TTFT s (1000 tok)':>17} | {'host link out KB':>16} | "
          f"{'host link in KB':>15} |")
    print(f"|{'-' * 12}|{'-' * 10}|{'-' * 19}|{'-' * 18}|{'-' * 17}|")
    for mode in RING_MODES:
        m = med[mode]
        print(f"| {mode:<10} | {m['tpot'] * 1e3:>8.0f} | {m['ttft']:>17.2f} | {m['host_up'] / 1e3:>16.0f} | "
              f"{m['host_down'] / 1e3:>15.0f} |")
    tp = med["direct"]["tpot"] / med["star"]["tpot"]
    tt = med["direct"]["ttft"] / med["star"]["ttft"]
    print(f"\ndirect / star per-token time: {tp:.2f}  (target <= 0.8: {'PASS' if tp <= 0.8 else 'MISS'})")
    print(f"direct / star TTFT, {LONG_PROMPT_TOKENS}-token prompt: {tt:.2f}  (target <= 0.7: "
          f"{'PASS' if tt <= 0.7 else 'MISS'})")


def matrix(a) -> list[dict]:
    """The emulated-homes matrix: one host (home 0), one joiner (home 1) per cell."""
    import tempfile

    from testkit.homenet import HomeSpec, home_internet, homenet_available, upnp_available

    ok, why = homenet_available()
    if not ok or not upnp_available()[0]:
        print(f"\n(matrix skipped: {why if not ok else upnp_available()[1]})")
        return []
    rows = []
    nats = {"eim": "eim", "symmetric": "symmetric", "none": None}
    # the host's router: UPnP-IGD with PCP and NAT-PMP (miniupnpd's all), PCP and NAT-PMP only, nothing
    mappings = ("UPnP", "PCP", "off")
    for na in nats:
        for nb in nats:
            for mapping in mappings:
                for relay in (True, False):
                    if na == "none" and mapping != "off":
                        continue               # no router in front of the host: nothing to map
                    if mapping == "PCP" and relay:
                        continue               # a mapping is a mapping: PCP's cells without a relay show it
                    spec = [HomeSpec(nat=nats[na], upnp=mapping != "off" and na != "none", igd=mapping == "UPnP"),
                            HomeSpec(nat=nats[nb])]
                    upnp = mapping != "off"
                    with tempfile.TemporaryDirectory() as tmp, home_internet(spec, stun=True, subnet=90) as net:
                        path, took, moved, moved_s, code_s = _cell(net, tmp, upnp, relay)
                    possible = na == "none" or upnp
                    # both NATs filter on the exact remote (conntrack); a hole opens unless both
                    # sides map per destination (symmetric): plainly where the side whose packets
                    # must arrive first maps endpoint-independently, by port prediction where one
                    # side is symmetric (engine/wire/punch.py)
                    punchable = not possible and (na, nb) != ("symmetric", "symmetric")
                    # without a relay: the friend's reply code (its own open address, or a hole)
                    by_reply = not possible and not relay and (nb == "none" or punchable)
                    rows.append({"host NAT": na, "joiner NAT": nb, "host router maps": mapping,
                                 "relay": "yes" if relay else "no", "path": path, "join s": took,
                                 "then": moved or "-", "after s": moved_s if moved_s is not None else "-",
                                 "code s": code_s if code_s is not None else "-",
                                 "direct possible": "at join" if possible else ("reply code" if by_reply else
                                                                                "punched" if relay and punchable
                                                                                else "no"),
                                 "ok": (path.startswith("direct") and took <= 3.0) if possible
                                 else (path.startswith("direct") and moved_s is not None and moved_s <= 15.0
                                       and code_s is not None and code_s <= 3.0) if by_reply
                                 else (path == "relay" and moved == "direct (punched)" and moved_s <= 5.0)
                                 if relay and punchable else (path == "relay" and not moved if relay else path == "no path")})
                    log(f"{rows[-1]}")
    return rows


def goodput(a) -> list[dict]:
    """TCP against punched QUIC over the same shaped link (tbf shapes every packet, UDP
    as well as TCP): the joiner's home link at --goodput-rate Mbit/s each way; the host's
    router maps the port (a direct TCP tunnel) or maps nothing (the relayed tunnel
    punches a hole and moves to QUIC), then --goodput-mb MB go through the tunnel to the
    joiner's echo and back."""
    import subprocess
    import tempfile

    from testkit.homenet import HomeSpec, home_internet, homenet_available, upnp_available

    ok, why = homenet_available()
    if not ok or not upnp_available()[0]:
        print(f"\n(goodput skipped: {why if not ok else upnp_available()[1]})")
        return []
    rows = []
    for r in range(a.rounds):
        for kind in (("tcp", "quic") if r % 2 == 0 else ("quic", "tcp")):
            spec = [HomeSpec(nat="eim", upnp=kind == "tcp"), HomeSpec(nat="eim")]
            with tempfile.TemporaryDirectory() as tmp, home_internet(spec, stun=True, subnet=91) as net:
                net.shape(1, a.goodput_rate * 1e6)
                env = dict(os.environ, HOME=tmp, PYTHONPATH=os.pathsep.join(sys.path),
                           POTLUCK_STUN=f"{net.stun_addr[0]}:3478,{net.stun_addr2[0]}:3478")
                procs = []
                try:
                    argv = [sys.executable, "-m", "testkit.pathpeer", "host", "--folder", f"{tmp}/h", "--wait", "60",
                            "--bulk", str(a.goodput_mb)]
                    if kind == "quic":
                        rl = net.popen(net.public, [sys.executable, "-m", "engine", "relay", "--host", "0.0.0.0",
                                                    "--port", "8765"], env=env, text=True, stdout=subprocess.PIPE)
                        procs.append(rl)
                        rl.stdout.readline()
                        argv += ["--relay", f"ws://{net.public_addr}:8765", "--no-upnp"]
                    h = net.popen(net.host(0), argv, env=env, text=True, stdout=subprocess.PIPE)
                    procs.append(h)
                    code = next(x for x in h.stdout if x.startswith("CODE")).split(" ", 1)[1].strip()
                    procs.append(net.popen(net.host(1), [sys.executable, "-m", "testkit.pathpeer", "join", "--folder",
                                                         f"{tmp}/j", "--code", code], env=env, text=True,
                                           stdout=subprocess.DEVNULL))
                    line = next((x for x in h.stdout if x.startswith("BULK")), "BULK {}")
                    res = json.loads(line.split(" ", 1)[1])
                finally:
                    for p in procs:
                        p.terminate()
                        p.wait(20)
            mbit = res["bytes"] * 8 / res["seconds"] / 1e6 if res.get("seconds") else float("nan")
            rows.append({"transport": kind, "path": res.get("path", "?"), "Mbit/s": mbit})
            log(f"goodput round {r + 1} {kind}: {res.get('path')}, {mbit:.1f} Mbit/s each way")
    return rows


def print_goodput(a, rows: list[dict]) -> None:
    if not rows:
        return
    med = {k: statistics.median(r["Mbit/s"] for r in rows if r["transport"] == k) for k in ("tcp", "quic")}
    paths = {k: next(r["path"] for r in rows if r["transport"] == k) for k in ("tcp", "quic")}
    print(f"\nGoodput through the tunnel, the joiner's home link shaped to {a.goodput_rate:g} Mbit/s each way "
          f"(tbf: UDP and TCP alike), {a.goodput_mb:g} MB to the joiner's echo and back, median of {a.rounds}\n")
    print("| transport | path | Mbit/s each way | of the link |")
    print("|---|---|---:|---:|")
    for k in ("tcp", "quic"):
        print(f"| {k} | {paths[k]} | {med[k]:.1f} | {med[k] / a.goodput_rate:.2f} |")
    print(f"\npunched QUIC / TCP goodput: {med['quic'] / med['tcp']:.2f}")


def _cell(net, tmp: str, upnp: bool, relay: bool):
    """One join, host in home 0 and joiner in home 1: (path, seconds from the joiner's start
    to its tunnel, where a relayed tunnel moved or "reply code", and how long that took:
    the move after the join, or from the host taking the code to the join)."""
    import queue
    import subprocess
    import threading

    def lines(p) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [q.put(x) for x in p.stdout] + [q.put(None)], daemon=True).start()
        return q

    def next_line(q, prefixes, deadline):
        while True:
            try:
                line = q.get(timeout=max(0.01, deadline - time.perf_counter()))
            except queue.Empty:
                return None
            if line is None:
                return None
            if any(w in line for w in prefixes):
                return line

    env = dict(os.environ, HOME=tmp, PYTHONPATH=os.pathsep.join(sys.path),
               POTLUCK_STUN=f"{net.stun_addr[0]}:3478,{net.stun_addr2[0]}:3478")
    procs = []
    try:
        if relay:
            r = net.popen(net.public, [sys.executable, "-m", "engine", "relay", "--host", "0.0.0.0", "--port", "8765"],
                          env=env, text=True, stdout=subprocess.PIPE)
            procs.append(r)
            r.stdout.readline()
        argv = [sys.executable, "-m", "testkit.pathpeer", "host", "--folder", f"{tmp}/h", "--seconds",
                "6" if relay else "0.5", "--wait", "30"] + \
            (["--relay", f"ws://{net.public_addr}:8765"] if relay else ["--reply-stdin"]) + \
            ([] if upnp else ["--no-upnp"])
        h = net.popen(net.host(0), argv, env=env, text=True, stdout=subprocess.PIPE, stdin=subprocess.PIPE)
        procs.append(h)
        hq = lines(h)
        code = next_line(hq, ("CODE",), time.perf_counter() + 60).split(" ", 1)[1].strip()
        j = net.popen(net.host(1), [sys.executable, "-m", "testkit.pathpeer", "join", "--folder", f"{tmp}/j",
                                    "--code", code] + ([] if relay else ["--reply-listen", "0.0.0.0:7871"]),
                      env=env, text=True, stdout=subprocess.PIPE)
        procs.append(j)
        jq = lines(j)
        next_line(jq, ("START",), time.perf_counter() + 60)        # the joiner's own start-up does not count
        t0 = time.perf_counter()
        line = next_line(jq, ("JOINED", "FAILED", "REPLY "), t0 + 30) or "FAILED (nothing within 30 s)"
        moved, moved_s = "", None
        code_s = time.perf_counter() - t0 if line.startswith("REPLY ") else None
        if line.startswith("REPLY "):           # the friend sends the host its reply code
            h.stdin.write(line.split(" ", 1)[1].strip() + "\n")
            h.stdin.flush()
            t_code = time.perf_counter()
            line = next_line(jq, ("JOINED", "FAILED"), t_code + 20) or "FAILED (the reply code led nowhere in 20 s)"
            moved = "reply code"
            moved_s = time.perf_counter() - t_code if line.startswith("JOINED") else None
        took = time.perf_counter() - t0
        if line.startswith("JOINED relay"):     # hole punching, if the NATs allow
            said = next_line(jq, ("moved to", "no punched path", "no hole punching", "could not move there"),
                             time.perf_counter() + 30) or ""
            if "moved to" in said:
                moved = said.split("moved to", 1)[1].split(":")[0].strip()
                moved_s = time.perf_counter() - t0 - took
    finally:
        for p in procs:
            p.terminate()
            p.wait(20)
    path = line.split(" ", 1)[1].strip() if line.startswith("JOINED") else "no path"
    return path, took, moved, moved_s, code_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=50.0, help="link rate, Mbit/s each way")
    p.add_argument("--delay", type=float, default=20.0, help="one-way delay, ms")
    p.add_argument("--tokens", type=int, default=24, help="new tokens per reply")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every link mode, rotating order")
    p.add_argument("--matrix", action="store_true", help="also the emulated-homes matrix (root, Debian parts)")
    p.add_argument("--ring", action="store_true", help="only the three-home ring, star vs direct hops (issue 43)")
    p.add_argument("--goodput", action="store_true", help="only TCP vs punched QUIC goodput (root, Debian parts)")
    p.add_argument("--goodput-rate", type=float, default=20.0, help="goodput: the joiner's link, Mbit/s")
    p.add_argument("--goodput-mb", type=float, default=10.0, help="goodput: MB each way")
    p.add_argument("--ring-delay", type=float, default=30.0, help="ring: one-way delay between two homes, ms")
    p.add_argument("--ring-rate", type=float, default=20.0, help="ring: each home's link, Mbit/s")
    p.add_argument("--ring-model", choices=("light", "default"), default="light",
                   help="ring: the default model's width with a layer a stage (light: the wire, not this CPU, "
                        "decides) or the default model itself")
    p.add_argument("--matrix-only", action="store_true", help="only the matrix")
    p.add_argument("--repeat", type=int, default=8, help="MiB sealed per size in the seal part")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    if a.matrix_only:
        print_matrix(matrix(a))
        return 0
    if a.goodput:
        print_goodput(a, goodput(a))
        return 0
    if a.ring:
        log(f"three-home ring, {a.rounds} rounds of {', '.join(RING_MODES)}")
        print_ring(a, asyncio.run(ring_rounds(a)))
        return 0
    print("\nSealing one message (seal + open, this process)\n")
    print(f"| {'message':<26} | {'µs':>8} | {'MB/s':>7} |")
    print(f"|{'-' * 28}|{'-' * 10}|{'-' * 9}|")
    for name, us, mbs in seal_micro(a.repeat):
        print(f"| {name:<26} | {us:>8.1f} | {mbs:>7.0f} |")

    shaped = f"{a.rate:g} Mbit/s, {a.delay:g} ms one way"
    log(f"2-stage pipeline over {shaped}, {a.rounds} rounds of {', '.join(MODES)}")
    res = asyncio.run(link_rounds(a))
    med = {m: {k: statistics.median(x[k] for x in res[m]) for k in ("ttft", "tpot")} for m in res}
    print(f"\nThe default model's 2-stage pipeline over one link ({shaped}; the relay's two legs each "
          f"like it); {len(PROMPTS)} replies of {a.tokens} tokens a round, median of {a.rounds} rounds\n")
    print(f"| {'links':<8} | {'TTFT ms':>8} | {'TPOT ms':>8} | {'decode tok/s':>12} | {'vs plain':>8} |")
    print(f"|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 14}|{'-' * 10}|")
    for mode in MODES:
        m = med[mode]
        print(f"| {mode:<8} | {m['ttft'] * 1e3:>8.0f} | {m['tpot'] * 1e3:>8.1f} | {1 / m['tpot']:>12.2f} | "
              f"{med['plain']['tpot'] / m['tpot']:>8.3f} |")
    ratio = med["plain"]["tpot"] / med["sealed"]["tpot"]
    print(f"\nsealed / plain decode tok/s: {ratio:.3f}  (target >= 0.95: {'PASS' if ratio >= 0.95 else 'MISS'})")
    print(f"direct / relay decode tok/s: {med['relay']['tpot'] / med['direct']['tpot']:.2f}")
    if a.matrix:
        print_matrix(matrix(a))


def print_matrix(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    print("\nJoining across emulated homes (testkit/homenet.py, a STUN server on the public side). "
          "'join s': from the joiner starting to try to a working tunnel; 'then': where a relayed "
          "tunnel moved (hole punching) and 'after s' how long after the join, or 'reply code' when "
          "there is no relay: the friend's code went to the host, and 'after s' is from the host "
          "taking it to the joined tunnel ('code s': from the joiner starting to its reply code; "
          "target 3 s). A direct path is possible at the join when the host has no "
          "NAT or its router maps the port; else wherever the friend is reachable or a hole can be "
          "punched: through the relay's tunnel, or with no relay by the reply code\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    print(f"\ncells as they should be: {sum(r['ok'] for r in rows)} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
