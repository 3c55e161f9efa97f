"""Two homes and a relay in three network namespaces, real processes, the default model.

    home A (n0: host = head + stage 0)  --veth--  relay (n1)  --veth--  home B (n2: joiner = stage 1)

With forwarding off in n1 the homes cannot reach each other (as behind two NATs): the
joiner tries the host's direct address from the code, fails, and falls back to the
relay; the chat completes through it and the relay's forwarded bytes (it dumps them)
hold none of the plaintext: not the prompt, not the answer, not a wire frame header,
not a control message. With forwarding on, the joiner connects directly and the relay
forwards nothing.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time

import pytest

from testkit.netns import emulated_network, netns_available

ok, why = netns_available()
pytestmark = pytest.mark.skipif(not ok, reason=f"network namespaces unavailable: {why}")

PROMPT = "What is the capital of France?"
SUBNET = 77


class Lines:
    """Reads a process's stream on a thread so tests can wait for a line with a timeout."""

    def __init__(self, stream):
        self.q: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream):
        for line in iter(stream.readline, ""):
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def wait_for(self, pred, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise AssertionError("process ended; it said:\n" + "\n".join(self.seen))
            self.seen.append(line)
            if pred(line):
                return line
        raise AssertionError("timed out; the process said:\n" + "\n".join(self.seen))

    def text(self) -> str:
        while True:
            try:
                line = self.q.get_nowait()
            except queue.Empty:
                return "\n".join(self.seen)
            if line is not None:
                self.seen.append(line)


def _env(tmp_path, name):
    env = dict(os.environ, POTLUCK_HOME=str(tmp_path / name), POTLUCK_KEYSTORE="file", HF_HUB_OFFLINE="1",
               TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


CHAT = """
import json, sys, urllib.request
body = json.dumps({"model": "default", "max_tokens": 24, "temperature": 0,
                   "messages": [{"role": "user", "content": sys.argv[1]}]}).encode()
req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", body,
                             {"Content-Type": "application/json"})
print(json.dumps(json.load(urllib.request.urlopen(req, timeout=300))))
"""


def _run_pipeline(net, tmp_path, tag: str, relay_addr: str, host_addr: str):
    """Host in n0, joiner in n2; returns (answer, host stderr, joiner output)."""
    py = sys.executable
    host = net.popen(0, [py, "-m", "engine", "host", "--relay", f"ws://{relay_addr}:8765",
                         "--listen", "0.0.0.0:7870", "--advertise", host_addr, "--port", "8000",
                         "--threads", "1"], env=_env(tmp_path, f"host-{tag}"), text=True)
    out, err = Lines(host.stdout), Lines(host.stderr)
    out.wait_for(lambda s: s.startswith("Invite code"), 120)
    code = out.wait_for(lambda s: s.strip() != "", 10).strip()
    # pasted in lower case with spaces: still the same code
    pasted = code.lower().replace("-", " ")
    joiner = net.popen(2, [py, "-m", "engine", "join", pasted, "--threads", "1", "--name", f"friend-{tag}"],
                       env=_env(tmp_path, f"joiner-{tag}"), text=True)
    jout, jerr = Lines(joiner.stdout), Lines(joiner.stderr)
    try:
        out.wait_for(lambda s: s.startswith("OpenAI-compatible API"), 300)
        jout.wait_for(lambda s: s.startswith("Joined pipeline"), 10)
        res = net.exec(0, [py, "-c", CHAT, PROMPT], timeout=300)
        answer = json.loads(res.stdout)["choices"][0]["message"]["content"]
        return answer, err.text(), jout.text() + "\n" + jerr.text()
    finally:
        for p in (joiner, host):
            p.terminate()
        for p in (joiner, host):
            try:
                p.wait(20)
            except Exception:  # noqa: BLE001
                p.kill()


@pytest.fixture(scope="module")
def homes():
    with emulated_network(3, "line", subnet=SUBNET) as net:
        yield net


def _forwarding(net, node: int, on: bool):
    net.exec(node, ["sh", "-c", f"echo {1 if on else 0} > /proc/sys/net/ipv4/ip_forward"])


def test_chat_through_the_relay_sees_only_ciphertext(homes, tmp_path):
    net = homes
    _forwarding(net, 1, False)          # the homes cannot reach each other: relay only
    dump = tmp_path / "relay.bin"
    relay = net.popen(1, [sys.executable, "-m", "engine", "relay", "--port", "8765", "--dump", str(dump)],
                      env=_env(tmp_path, "relay"), text=True)
    try:
        Lines(relay.stdout).wait_for(lambda s: s.startswith("Relay listening"), 60)
        answer, host_err, joiner_out = _run_pipeline(net, tmp_path, "relay", net.addrs[1][0], net.addr(0))
    finally:
        relay.terminate()
        relay.wait(20)
    assert "Paris" in answer, answer
    assert "stage 1 via relay" in host_err, host_err
    assert "via relay" in joiner_out and "no direct route to the host answered" in joiner_out, joiner_out
    seen = dump.read_bytes()
    assert len(seen) > 100_000, len(seen)   # the activations went through it
    for plain in (PROMPT.encode(), b"capital of France", answer.encode(), b"Paris", b"PTLK",
                  b'"type"', b"hello", b"configure", b"SmolLM2"):
        assert plain not in seen, f"the relay saw {plain!r}"


def test_chat_over_a_direct_link(homes, tmp_path):
    net = homes
    _forwarding(net, 1, True)           # now home B can reach home A's address
    dump = tmp_path / "relay.bin"
    relay = net.popen(1, [sys.executable, "-m", "engine", "relay", "--port", "8765", "--dump", str(dump)],
                      env=_env(tmp_path, "relay"), text=True)
    try:
        Lines(relay.stdout).wait_for(lambda s: s.startswith("Relay listening"), 60)
        answer, host_err, joiner_out = _run_pipeline(net, tmp_path, "direct", net.addrs[1][0], net.addr(0))
    finally:
        relay.terminate()
        relay.wait(20)
    assert "Paris" in answer, answer
    assert "stage 1 via direct" in host_err, host_err
    assert "via direct" in joiner_out, joiner_out
    assert not dump.exists() or dump.stat().st_size == 0


def test_three_homes_through_the_relay(tmp_path):
    """Host + two joiners (stages 1 and 2), each in its own home, the relay in a fourth
    namespace; the host reaches each friend through the relay, and stage 1 reaches stage 2
    straight across (the host introduces the two friends: engine/wire/friend_hop.py)."""
    py = sys.executable
    with emulated_network(4, "star", subnet=SUBNET + 1) as net:
        dump = tmp_path / "relay.bin"
        relay = net.popen(1, [py, "-m", "engine", "relay", "--port", "8765", "--dump", str(dump)],
                          env=_env(tmp_path, "relay"), text=True)
        Lines(relay.stdout).wait_for(lambda s: s.startswith("Relay listening"), 60)
        host = net.popen(0, [py, "-m", "engine", "host", "--relay", f"ws://{net.addr(1)}:8765", "--peers", "2",
                             "--threads", "1", "--prompt", PROMPT, "--max-tokens", "16"],
                         env=_env(tmp_path, "host3"), text=True)
        out, err = Lines(host.stdout), Lines(host.stderr)
        out.wait_for(lambda s: s.startswith("Invite code"), 120)
        code = out.wait_for(lambda s: s.strip() != "", 10).strip()
        joiners = []
        for i, node in enumerate((2, 3)):
            # the homes of this star reach each other, so a hole would be punched at once
            # (tests/node/test_home_paths.py has that): this test is the relay's hops
            joiners.append(net.popen(node, [py, "-m", "engine", "join", code, "--threads", "1", "--name", f"f{i}"],
                                     env=dict(_env(tmp_path, f"joiner3-{i}"), POTLUCK_PUNCH="0"), text=True))
            err.wait_for(lambda s, i=i: f"(f{i})" in s and "connected via relay" in s, 60)
        answer = out.wait_for(lambda s: s.startswith("bot>"), 300)
        out.wait_for(lambda s: "via relay" in s, 10)
        assert host.wait(60) == 0
        assert "Paris" in answer, answer
        assert "3 stages (stage 1 via relay, stage 2 via relay)" in err.text(), err.text()
        assert "f0 → f1: direct (" in err.text(), err.text()
        seen = dump.read_bytes()
        for plain in (PROMPT.encode(), b"Paris", b"PTLK", b'"type"', b"configure"):
            assert plain not in seen, f"the relay saw {plain!r}"
