"""Encrypted tunnels between homes: the head keeps talking to `ws://127.0.0.1:PORT`.

A joiner (a friend's machine contributing a stage) runs an ordinary StageServer on
its own loopback and reaches the host with an outbound WebSocket: straight to an
address in the invite when one answers ("direct"), else through a relay ("relay").
Over that channel the two run a Noise IK handshake (engine/wire/noise.py: psk1 with the
invite's join secret the first time, the allowlisted node key after that) and then
carry *streams*: for each TCP connection the head opens to the peer's loopback port
on the host, one stream to the joiner's stage server. head.py and stage_server.py
are unchanged; they see loopback addresses.

Channel messages (WebSocket binary frames):

    joiner -> host   "PLT1" | mode u8 (1 join, 2 member) | pipeline 8 B | invite id 8 B
                     | Noise message 1   (the 21 bytes before it are the prologue)
    host -> joiner   0x01 | Noise message 2      or      0x00 | reason (UTF-8, plaintext)
    then both ways   TransportCipher frames: counter u64 | ChaCha20-Poly1305(inner)
    inner            type u8 | stream u32 | payload

A relayed session looks for a direct path (Joiner._seek_direct): the invite's addresses
again, then hole punching (engine/wire/punch.py): the joiner sends PUNCH {"udp": its
STUN-mapped and LAN UDP addresses}, the host answers PUNCH with its own, both punch at
once, and the joiner opens QUIC on the punched socket; over it the session resumes and
moves like any direct channel (MODE_RESUME, Session.move_to), path "direct (punched)".

The joiner's first inner frame is CONFIRM (proof it holds the session keys; only then
does the host count an invite use and allowlist the key), the host answers READY or
BYE(reason). A stream's far end connects only to a target that end registered: a
joiner's own stage server, or on the host a hop it set up; a peer never names an
address to connect to.

Three or more homes: stage i must reach stage i+1, which lives in another home. The host
introduces the two friends (INTRO frames, engine/wire/friend_hop.py): the next stage's
home opens a door, the other dials it (its LAN, its router's mapping, its public address,
or a hole the two punch) and the two run their own Noise handshake with a key the host
made for this hop; the first friend's stage then connects to a loopback port whose
connections go straight across. Only where they find no direct path does the host ask
the first joiner (LISTEN) for a loopback port whose connections it opens as streams to a
*hop* the host registered, and connect each such stream to the second joiner's loopback
port on the host, i.e. into the second tunnel (through the host's machine, both tunnels
encrypted end to end with the host). The head asks for each stage's next hop at every
arrangement (Head.hop: Friends.hop).

Where it lives (this module only re-exports those modules' names, so that
`engine.wire.tunnel.X` keeps working; a test that patches a constant patches it where
the code reads it, e.g. engine.wire.tunnel_routes.STAGGER_S, not here):

    tunnel_session.py   constants, inner frames and the hello; Session (streams over one channel)
    tunnel_host.py      TunnelHost and Peer: accepting joiners, dialing reply codes, hops, revocations
    tunnel_join.py      open_session and Joiner: reaching the host, reconnecting, reply codes
    tunnel_routes.py    the order and the race of an invite's addresses; a relayed session's move
    friend_hop.py       friend-to-friend hops: the introduction, the door, the dial, the punch
"""

from __future__ import annotations

# re-exported: the names this module has always offered
from engine.wire.tunnel_host import Peer, TunnelHost  # noqa: F401
from engine.wire.tunnel_join import DIRECT_RETRY_S, REPLY_QUEUE, Joiner, default_name, open_session  # noqa: F401
from engine.wire.tunnel_routes import (  # noqa: F401
    RELAY_AFTER_S, STAGGER_S, _first_to_connect, direct_routes, punch_direct, resume_direct)
from engine.wire.tunnel_session import (  # noqa: F401
    BYE, CHUNK, CLOSE, CONFIRM, CONNECT_TIMEOUT, DATA, DEAD_AFTER, HANDSHAKE_TIMEOUT, INTRO, LISTEN, LISTENING, MAGIC,
    MAX_MESSAGE, MAX_STREAMS, MODE_FRIEND, MODE_JOIN, MODE_MEMBER, MODE_RESUME, MOVE, OPEN, PING, PING_INTERVAL, PONG,
    PROLOGUE_LEN, PUNCH, PUNCH_TIMEOUT, READY, STAGE, WS_OPTIONS, HostRefused, Session, TunnelError, log,
    pack_inner, parse_hello, parse_inner)
