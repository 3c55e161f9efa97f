"""Two homes behind real NAT routers (testkit/homenet.py: iptables NAT and firewalls,
miniupnpd, coturn, a relay on the public side): which path a join takes, with no
server of the homes' own where the routers allow it (issue 33).

Each cell runs the node's tunnel code in two processes (testkit/pathpeer.py), the host
in home 0 and the joiner in home 1, and streams numbered lines through the tunnel; the
default model's pipeline over such a tunnel is tests/node/test_across_homes.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from testkit.pathpeer import MARKER
from testkit.homenet import HomeSpec, home_internet, homenet_available, stun_available, upnp_available

ok, why = homenet_available()
pytestmark = pytest.mark.skipif(not ok, reason=f"emulated homes unavailable: {why}")
has_upnp, why_upnp = upnp_available()
has_stun, _ = stun_available()


class Peer:
    """A pathpeer process, its lines read as they come."""

    def __init__(self, net, ns, argv, env):
        self.p = net.popen(ns, [sys.executable, "-m", "testkit.pathpeer", *argv], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
        self.lines: list[str] = []

    def send(self, line: str):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def wait_for(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        for line in self.lines:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise AssertionError(f"no {prefix!r} within {timeout:g} s:\n" + "\n".join(self.lines[-30:]))

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.lines += self.p.stdout.read().splitlines()       # what it said after we stopped reading


def _env(tmp_path, **extra):
    return dict(os.environ, HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path), **extra)


def _run_cell(net, tmp_path, *, relay: bool = False, upnp: bool = True, seconds: float = 2.0,
              during=None, env_extra=None, watch=None):
    """watch=(namespace, interface): an observer captures that wire meanwhile, into
    tmp_path/"wire.bin"."""
    env = _env(tmp_path, **(env_extra or {}))
    relay_proc = observer = None
    if watch is not None:
        observer = net.popen(watch[0], [sys.executable, "-m", "testkit.sniff", watch[1], str(tmp_path / "wire.bin")],
                             env=env, text=True, stdout=subprocess.PIPE)
        observer.stdout.readline()
    argv = ["host", "--folder", str(tmp_path / "host"), "--seconds", str(seconds), "--wait", "90"]
    if relay:
        relay_proc = net.popen(net.public, [sys.executable, "-m", "engine", "relay", "--host", "0.0.0.0",
                                            "--port", "8765"], env=env, text=True, stdout=subprocess.PIPE)
        relay_proc.stdout.readline()
        argv += ["--relay", f"ws://{net.public_addr}:8765"]
    if not upnp:
        argv.append("--no-upnp")
    host = Peer(net, net.host(0), argv, env)
    joiner = None
    try:
        cands = json.loads(host.wait_for("CANDIDATES", 60))
        code = host.wait_for("CODE", 30)
        joiner = Peer(net, net.host(1), ["join", "--folder", str(tmp_path / "joiner"), "--code", code], env)
        joined = _joined_or_failed(joiner)
        if joined.startswith("FAILED"):
            return cands, None, joined, None, host, joiner
        first = joined[len("JOINED"):].strip()
        if during is not None:
            host.wait_for("JOINED", 30)
            during(host, joiner)
        result = json.loads(host.wait_for("RESULT", 120 + seconds))
        host.wait_for("CLOSED", 30)
        return cands, first, None, result, host, joiner
    finally:
        for p in (joiner, host):
            if p is not None:
                p.stop()
        for p in (relay_proc, observer):
            if p is not None:
                p.terminate()
                p.wait(20)


def _joined_or_failed(joiner: Peer, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = joiner.p.stdout.readline()
        if not line:
            break
        joiner.lines.append(line.rstrip("\n"))
        if line.startswith("JOINED") or line.startswith("FAILED"):
            return line.strip()
    raise AssertionError("the joiner neither joined nor failed:\n" + "\n".join(joiner.lines[-30:]))


def _streamed_whole(result: dict) -> bool:
    return result["joined"] and result["sent"] > 10 and result["echoed"] == result["sent"] \
        and not result["out_of_order"]


@pytest.mark.skipif(not has_upnp, reason=f"no UPnP daemon: {why_upnp}")
def test_two_homes_join_with_no_relay_through_the_routers_mapping(tmp_path):
    """Home 0's router grants a UPnP mapping, home 1 sits behind a symmetric NAT, nobody
    runs a relay: the invite carries the mapped address, the friend joins on it, and the
    mapping is gone from the router once the host stops."""
    with home_internet([HomeSpec(nat="eim", upnp=True), HomeSpec(nat="symmetric")], stun=has_stun,
                       subnet=61) as net:
        env = {"POTLUCK_STUN": f"{net.stun_addr[0]}:3478,{net.stun_addr2[0]}:3478"} if has_stun else {}
        cands, first, failed, result, host, _ = _run_cell(net, tmp_path, env_extra=env, watch=(net.router(0), "wan"))
        assert failed is None, failed
        assert f"ws://{net.wan_addr(0)}:7870" in cands["direct"], cands
        assert cands["kinds"][cands["direct"].index(f"ws://{net.wan_addr(0)}:7870")] == "mapped"
        if has_stun:
            assert cands["nat"] == "endpoint-independent", cands
        assert first == "direct (mapped)"
        assert result["paths"] == ["direct (mapped)"] and _streamed_whole(result), result
        # someone on the internet side of the host's router saw the tunnel, not the lines
        seen = (tmp_path / "wire.bin").read_bytes()
        assert len(seen) > 20_000 and MARKER.encode() not in seen, len(seen)
        rules = net.exec(net.router(0), ["nft", "list", "table", "inet", "miniupnpd"]).stdout
        assert "7870" not in rules, rules                     # the host removed its mapping


def test_without_a_mapping_or_a_relay_the_join_says_what_would_help(tmp_path):
    """Both homes behind NAT, no UPnP, no relay: no path can exist, and the friend is
    told so, with what the host can do."""
    with home_internet([HomeSpec(nat="eim"), HomeSpec(nat="eim")], subnet=62) as net:
        cands, first, failed, _, _, _ = _run_cell(net, tmp_path, upnp=False)
        assert first is None and failed.startswith("FAILED"), failed
        assert cands["kinds"] == ["lan"], cands                  # its private address only
        assert "no relay" in failed and "UPnP" in failed and "forward" in failed, failed


def test_a_host_with_no_nat_is_joined_directly_on_its_own_address(tmp_path):
    with home_internet([HomeSpec(nat=None), HomeSpec(nat="symmetric")], subnet=63) as net:
        cands, first, failed, result, _, _ = _run_cell(net, tmp_path, upnp=False)
        assert failed is None, failed
        assert cands["kinds"] == ["public"], cands
        assert first == "direct (public)" and _streamed_whole(result), result


@pytest.mark.skipif(not has_upnp, reason=f"no UPnP daemon: {why_upnp}")
def test_a_relayed_tunnel_moves_to_a_direct_path_mid_stream_without_losing_a_line(tmp_path):
    """The friend's router first blocks the host's mapped port (the join goes through the
    relay); it opens while lines stream, and the tunnel moves to the direct path within
    the retry interval: every line echoed once, in order."""
    with home_internet([HomeSpec(nat="eim", upnp=True), HomeSpec(nat="eim")], subnet=64) as net:
        block = ["iptables", "-I", "FORWARD", "-d", net.wan_addr(0), "-p", "tcp", "--dport", "7870", "-j", "DROP"]
        net.exec(net.router(1), block)
        # and no UDP toward the host's home either, so the move goes to the mapped port
        # rather than a punched hole (test_two_eim_homes_punch_a_direct_path_..., below)
        net.exec(net.router(1), ["iptables", "-I", "FORWARD", "-d", net.wan_addr(0), "-p", "udp", "-j", "DROP"])

        def unblock(host, joiner):
            time.sleep(2.0)                                      # lines flow through the relay first
            net.exec(net.router(1), ["iptables", "-D", *block[2:]])
            host.wait_for("PATH direct (mapped)", 30)

        _, first, failed, result, host, joiner = _run_cell(
            net, tmp_path, relay=True, seconds=8.0, during=unblock, env_extra={"POTLUCK_DIRECT_RETRY_S": "1"})
        assert failed is None, failed
        assert first == "relay", joiner.lines
        assert result["paths"] == ["relay", "direct (mapped)"] and result["moves"] == 1, "\n".join(host.lines + ["--"] + joiner.lines)
        assert _streamed_whole(result), result
        assert any("moved to direct (mapped)" in line for line in joiner.lines), joiner.lines


@pytest.mark.skipif(not has_stun, reason="needs coturn (STUN)")
def test_two_eim_homes_punch_a_direct_path_and_the_relayed_tunnel_moves_there(tmp_path):
    """Both homes behind endpoint-independent NATs that map nothing (no UPnP): the join goes
    through the relay, the two punch a UDP hole with the candidates exchanged inside the
    tunnel, and the tunnel moves onto QUIC there mid-stream, within seconds of the join:
    every line echoed once, in order, and the relay's side of the wire carries none."""
    with home_internet([HomeSpec(nat="eim"), HomeSpec(nat="eim")], stun=True, subnet=68) as net:
        env = {"POTLUCK_STUN": f"{net.stun_addr[0]}:3478,{net.stun_addr2[0]}:3478"}

        def punched(host, joiner):
            host.wait_for("PATH direct (punched)", 20)

        _, first, failed, result, host, joiner = _run_cell(
            net, tmp_path, relay=True, upnp=False, seconds=6.0, during=punched, env_extra=env,
            watch=(net.router(1), "wan"))
        assert failed is None, failed
        assert first == "relay", joiner.lines
        assert result["paths"] == ["relay", "direct (punched)"] and result["moves"] == 1, \
            "\n".join(host.lines + ["--"] + joiner.lines)
        assert _streamed_whole(result), result
        seen = (tmp_path / "wire.bin").read_bytes()
        assert len(seen) > 20_000 and MARKER.encode() not in seen, len(seen)


@pytest.mark.skipif(not has_upnp, reason=f"no UPnP daemon: {why_upnp}")
def test_a_friend_whose_router_maps_is_reached_by_the_host_through_a_reply_code(tmp_path):
    """The host's router maps nothing (symmetric NAT, no UPnP) and there is no relay; the
    friend's router grants a mapping. The friend is shown a reply code; the host pastes
    it and connects to the friend, and the tunnel works as any other."""
    with home_internet([HomeSpec(nat="symmetric"), HomeSpec(nat="eim", upnp=True)], subnet=65) as net:
        env = _env(tmp_path)
        host = Peer(net, net.host(0), ["host", "--folder", str(tmp_path / "host"), "--no-upnp", "--reply-stdin",
                                       "--seconds", "2", "--wait", "90"], env)
        joiner = None
        try:
            code = host.wait_for("CODE", 60)
            joiner = Peer(net, net.host(1), ["join", "--folder", str(tmp_path / "joiner"), "--code", code,
                                             "--reply-listen", "0.0.0.0:7871"], env)
            reply = joiner.wait_for("REPLY", 60)
            assert f"ws://{net.wan_addr(1)}:7871" in _reply_urls(reply)
            _host_takes_the_reply(host, joiner, reply, "direct (reply)")
        finally:
            for p in (joiner, host):
                if p is not None:
                    p.stop()


def _host_takes_the_reply(host: Peer, joiner: Peer, reply: str, path: str):
    """The host pastes the friend's reply code: both ends joined on `path`, lines streamed whole."""
    host.send(reply)
    host.wait_for("REPLY-TAKEN", 30)
    assert joiner.wait_for("JOINED", 60) == path, joiner.lines
    assert host.wait_for("JOINED", 30) == path
    result = json.loads(host.wait_for("RESULT", 120))
    assert _streamed_whole(result), result


@pytest.mark.skipif(not has_stun, reason="needs coturn (STUN)")
@pytest.mark.parametrize("nat_host, nat_joiner", [("eim", "eim"), ("symmetric", "eim"), ("eim", "symmetric")])
def test_homes_with_no_relay_and_no_mapping_punch_through_a_reply_code(tmp_path, nat_host, nat_joiner):
    """Neither router maps, and there is no relay: the invite carries the host's punching
    address (STUN), the friend's reply code carries theirs, and once the host takes the
    code both punch; the join's own handshake then runs over QUIC on the hole. Where one
    router maps each destination anew (symmetric), by port prediction (issue 43)."""
    subnet = {("eim", "eim"): 69, ("symmetric", "eim"): 55, ("eim", "symmetric"): 54}[nat_host, nat_joiner]
    with home_internet([HomeSpec(nat=nat_host), HomeSpec(nat=nat_joiner)], stun=True, subnet=subnet) as net:
        env = _env(tmp_path, POTLUCK_STUN=f"{net.stun_addr[0]}:3478,{net.stun_addr2[0]}:3478")
        host = Peer(net, net.host(0), ["host", "--folder", str(tmp_path / "host"), "--no-upnp", "--reply-stdin",
                                       "--seconds", "2", "--wait", "90"], env)
        joiner = None
        try:
            cands = json.loads(host.wait_for("CANDIDATES", 60))
            assert "udp" in cands["kinds"], cands
            code = host.wait_for("CODE", 30)
            joiner = Peer(net, net.host(1), ["join", "--folder", str(tmp_path / "joiner"), "--code", code,
                                             "--reply-listen", "0.0.0.0:7871"], env)
            reply = joiner.wait_for("REPLY", 60)
            assert any(u.startswith(f"udp://{net.wan_addr(1)}:") for u in _reply_urls(reply)), reply
            time.sleep(1.5)                  # the friend sends the code; meanwhile it punches alone
            _host_takes_the_reply(host, joiner, reply, "direct (punched)")
        finally:
            for p in (joiner, host):
                if p is not None:
                    p.stop()


def _reply_urls(code: str) -> list[str]:
    from engine.wire.invite import parse_reply

    return parse_reply(code).direct


@pytest.mark.skipif(not (has_upnp and has_stun), reason="needs miniupnpd and coturn")
def test_doctor_tells_each_home_what_its_router_and_nat_allow(tmp_path):
    """`potluck doctor` in three homes, against the real router daemon and STUN server."""
    with home_internet([HomeSpec(nat="eim", upnp=True), HomeSpec(nat="symmetric"), HomeSpec(nat=None)],
                       stun=True, subnet=66) as net:
        env = _env(tmp_path, POTLUCK_STUN=f"{net.stun_addr[0]}:3478,{net.stun_addr2[0]}:3478")
        said = {}
        for i in range(3):
            p = net.popen(net.host(i), [sys.executable, "-m", "engine", "doctor"], env=env, text=True,
                          stdout=subprocess.PIPE)
            said[i] = p.communicate(timeout=120)[0]
        import re

        granted = re.search(rf"granted \(a trial of port (\d+) on {re.escape(net.wan_addr(0))},", said[0])
        assert granted and "endpoint-independent" in said[0], said[0]
        assert "no UPnP router answered" in said[1] and "NAT: symmetric" in said[1], said[1]
        assert "NAT: open" in said[2], said[2]
        rules = net.exec(net.router(0), ["nft", "list", "table", "inet", "miniupnpd"]).stdout
        assert f"dport {granted.group(1)}" not in rules, rules       # the doctor's trial mapping is gone


@pytest.mark.skipif(not has_upnp, reason=f"no UPnP daemon: {why_upnp}")
def test_a_router_that_speaks_only_nat_pmp_maps_the_port_too(tmp_path):
    """PortMapper without UPnP-IGD asks the default gateway over NAT-PMP (miniupnpd speaks
    both): the mapping reaches the PC from another home, and is gone after close()."""
    import asyncio
    import socket

    from engine.wire.candidates import PortMapper

    with home_internet([HomeSpec(nat="eim", upnp=True), HomeSpec(nat="eim")], subnet=67) as net:
        server = net.socket(net.host(0))
        server.bind(("0.0.0.0", 7870))
        server.listen()
        mapper = PortMapper(upnp_igd=False, pcp=False)

        async def open_it():
            return await mapper.open(7870)

        result = net.call_in(net.host(0), asyncio.run, open_it())
        assert result.external == (net.wan_addr(0), 7870) and result.how == "NAT-PMP", result
        probe = net.socket(net.host(1))
        probe.settimeout(10)
        probe.connect((net.wan_addr(0), 7870))               # through home 1's NAT and home 0's mapping
        conn, _ = server.accept()
        conn.close()
        probe.close()
        net.call_in(net.host(0), asyncio.run, mapper.close())
        again = net.socket(net.host(1))
        again.settimeout(3)
        with pytest.raises(OSError):
            again.connect((net.wan_addr(0), 7870))
        again.close()
        server.close()


def _three_home_hop(net, tmp_path, env_extra: dict, seconds: float = 4.0) -> tuple[dict, dict, list[str]]:
    """The host in home 0 (no NAT), friend A in home 1 and friend B in home 2; the host
    introduces A to B (engine/wire/friend_hop.py) and A streams lines through the hop
    to B's echo. Returns the host's HOP line, A's HOPRESULT, and everyone's lines."""
    env = _env(tmp_path, **env_extra)
    host = Peer(net, net.host(0), ["host", "--folder", str(tmp_path / "host"), "--hop", "--seconds",
                                   str(seconds + 20), "--wait", "90"], env)
    friends = []
    try:
        host.wait_for("CANDIDATES", 60)
        code = host.wait_for("CODE", 30)
        for i, extra in ((1, ["--hop-stream", str(seconds)]), (2, [])):
            friends.append(Peer(net, net.host(i), ["join", "--folder", str(tmp_path / f"f{i}"), "--code", code,
                                                   *extra], env))
            assert _joined_or_failed(friends[-1]).startswith("JOINED"), friends[-1].lines
            host.wait_for("JOINED", 30)
        hop = json.loads(host.wait_for("HOP", 60))
        result = json.loads(friends[0].wait_for("HOPRESULT", 60 + seconds))
        return hop, result, host.lines + ["--"] + friends[0].lines + ["--"] + friends[1].lines
    finally:
        for p in friends + [host]:
            p.stop()


@pytest.mark.skipif(not has_stun, reason="no STUN server (coturn)")
def test_two_friends_behind_nats_that_map_nothing_punch_their_own_hop(tmp_path):
    """Issue 43: A's stage reaches B's across their two routers, not through the host's
    machine: neither router maps a port, so the two punch a hole, A's candidates passed
    to B through the host; every line through the hop comes back, in order."""
    spec = [HomeSpec(nat=None), HomeSpec(nat="eim"), HomeSpec(nat="eim")]
    with home_internet(spec, stun=True, subnet=62) as net:
        hop, result, lines = _three_home_hop(net, tmp_path, {"POTLUCK_STUN": f"{net.stun_addr[0]}:3478,"
                                                                            f"{net.stun_addr2[0]}:3478"})
        assert hop["path"] == "direct (punched)", "\n".join(lines)
        assert hop["seconds"] < 12, hop
        assert result["hop"] and result["sent"] > 10 and result["echoed"] == result["sent"], result


@pytest.mark.skipif(not has_upnp, reason=f"no UPnP daemon: {why_upnp}")
def test_a_friend_whose_router_maps_a_port_is_reached_there_by_the_other(tmp_path):
    spec = [HomeSpec(nat=None), HomeSpec(nat="eim"), HomeSpec(nat="eim", upnp=True)]
    with home_internet(spec, subnet=61) as net:
        hop, result, lines = _three_home_hop(net, tmp_path, {})
        assert hop["path"] == "direct (mapped)", "\n".join(lines)
        assert result["hop"] and result["echoed"] == result["sent"] > 10, result


@pytest.mark.skipif(not has_upnp, reason=f"no UPnP daemon: {why_upnp}")
def test_a_router_that_speaks_pcp_maps_the_port_and_forgets_it_on_close(tmp_path):
    """Issue 43: PCP (RFC 6887), what newer routers and some carrier-grade NATs speak
    instead of UPnP: a MAP request to the gateway (miniupnpd speaks it) maps the port, a
    friend in another home connects through it, and deleting it (lifetime 0) closes it."""
    import asyncio

    from engine.wire.candidates import PortMapper

    with home_internet([HomeSpec(nat="eim", upnp=True), HomeSpec(nat="eim")], subnet=60) as net:
        server = net.socket(net.host(0))
        server.bind(("0.0.0.0", 7870))
        server.listen()
        mapper = PortMapper(upnp_igd=False, natpmp=False)

        async def open_it():
            return await mapper.open(7870)

        result = net.call_in(net.host(0), asyncio.run, open_it())
        assert result.external == (net.wan_addr(0), 7870) and result.how == "PCP", result
        probe = net.socket(net.host(1))
        probe.settimeout(10)
        probe.connect((net.wan_addr(0), 7870))
        conn, _ = server.accept()
        conn.close()
        probe.close()
        net.call_in(net.host(0), asyncio.run, mapper.close())
        rules = net.exec(net.router(0), ["nft", "list", "table", "inet", "miniupnpd"]).stdout
        assert "dport 7870" not in rules, rules


@pytest.mark.skipif(not has_stun, reason="no STUN server (coturn)")
@pytest.mark.parametrize("nat_a, nat_b", [("symmetric", "eim"), ("eim", "symmetric")])
def test_a_friend_behind_a_symmetric_nat_is_reached_by_predicting_its_ports(tmp_path, nat_a, nat_b):
    """Issue 43: one router maps every destination anew (symmetric: a mobile hotspot, a
    CGNAT), the other endpoint-independently, neither maps a port. The symmetric side
    opens many mappings toward the other, the other sprays its public address at random
    ports; a probe meets one and the hop is direct, within seconds, whichever side is
    the symmetric one."""
    spec = [HomeSpec(nat=None), HomeSpec(nat=nat_a), HomeSpec(nat=nat_b)]
    with home_internet(spec, stun=True, subnet=58 if nat_a == "symmetric" else 57) as net:
        hop, result, lines = _three_home_hop(net, tmp_path, {"POTLUCK_STUN": f"{net.stun_addr[0]}:3478,"
                                                                            f"{net.stun_addr2[0]}:3478"})
        assert hop["path"] == "direct (punched)", "\n".join(lines)
        assert hop["seconds"] < 15, hop
        assert result["hop"] and result["sent"] > 10 and result["echoed"] == result["sent"], result


@pytest.mark.skipif(not has_stun, reason="no STUN server (coturn)")
def test_two_symmetric_nats_give_up_at_once_and_the_hop_goes_through_the_host(tmp_path):
    spec = [HomeSpec(nat=None), HomeSpec(nat="symmetric"), HomeSpec(nat="symmetric")]
    with home_internet(spec, stun=True, subnet=56) as net:
        hop, result, lines = _three_home_hop(net, tmp_path, {"POTLUCK_STUN": f"{net.stun_addr[0]}:3478,"
                                                                            f"{net.stun_addr2[0]}:3478"})
        assert hop["path"] == "via the host", "\n".join(lines)
        assert hop["seconds"] < 12, hop
        assert any("symmetric" in x and "no direct path" in x for x in lines), "\n".join(lines)
        assert result["hop"] and result["echoed"] == result["sent"] > 10, result
