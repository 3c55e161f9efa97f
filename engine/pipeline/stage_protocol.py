"""What a stage and the peers that connect to it agree on: the protocol's version and its
history, the timeouts and WebSocket options of each side, and connecting to a stage
(the challenge, a hello that proves a key, the sealed socket that follows).

engine/pipeline/stage_server.py serves these connections; the head and each stage's
link to the next one open them with connect_stage.
"""

from __future__ import annotations

import asyncio

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from engine.pipeline.link import MAX_PIECE
from engine.wire import frames
from engine.wire.keepalive import HeartbeatConnection
from engine.wire.sealed_socket import SealedSocket
from engine.wire.stage_auth import HelloOpener, split_address

# 2: configure carries `compute`, stats carry `cut_ins`. A peer of another version is
# refused at hello with the version named, not later with a schema error.
# 3: stages send "profile" updates; 4: configure carries `acks`;
                       # 5: welcome says which device the stage computes on;
                       # 6: weights precision (welcome: can quantize; configure: which);
                       # 7: configure may carry the profile to start from (a re-plan)
                       # 8: "leaving" (with a deadline) replaces "pausing"
                       # 9: the stage challenges first; hello proves a key (stage_auth.py);
                       #    a new sequence may carry forks (n > 1), sampling asks for
                       #    logprobs, token entries may carry them
                       # 10: forks carry their seed alone; sampling may carry a JSON
                       #    schema (response_format), a replayed sequence says how much
                       # 11: sampling carries presence_penalty and frequency_penalty
                       # 12: a data link waits for the stage's "ready" after its hello (until a
                       #     hello is proven only PROOF_MAX bytes are read per message)
                       # 13: the hello's auth is a Noise NNpsk0 message, the stage answers
                       #     "accept", and everything after is sealed (stage_auth.py)
                       # 14: a step's row for an open sequence may carry its last token and
                       #     a draft (n > 1): every stage keeps the draft's KV tentative, the
                       #     last stage answers one token per position (speculative decoding),
                       #     and the sequence's next row may start inside that tail (rollback)
                       # 16: "configured" says how many layers the stage kept from its last slice
                       # 17: "prepare": a machine being taken in loads its layers ahead,
                       #     while the pipeline serves, and answers "prepared"
                       # 18: "prepare" says whether the layers are spares (held against a
                       #     loss without notice: engine/core/spares.py)
                       # 19: nothing new between stages, but a friend who dials a hop to
                       #     another friend reports it to the host (INTRO hop_link, wire/
                       #     friend_hop.py), which an older host takes for a bad frame and
                       #     closes the friend's tunnel over: mixed versions are refused at
                       #     the stage's hello, with a reason, instead
                       # 20: a verification step's frame carries its drafts, which the last
                       #     stage penalizes each position after (one batched draw)
                       # 21: sampling carries min_p (an older last stage refuses the key)
                       # 22: "line_test" / "line_fill": the head times a machine's line before
                       #     it takes it back (engine/core/line_check.py)
                       # 23: an activation frame may carry "rewind" (a kept reply's sequence
                       #     taken over, cut back) and "drop" (kept replies let go):
                       #     engine/pipeline/kept_replies.py
                       # 24: a friend's stage behind its tunnel takes control connections
                       #     only with the secret it shares with the host alone
                       #     (stage_auth.tunnel_stage_secret): an older host would be
                       #     refused as not authorized, and is told the version instead
PROTOCOL_VERSION = 24
HELLO_TIMEOUT = 10.0
# how long a stage that is going away (sharing off, paused by its owner's limits, the
# computer going to sleep, stopped) gives its head to move its layers elsewhere: the head
# needs a few seconds at most; the owner gets the machine back within this whatever it does
LEAVE_S = 10.0
# how long a stage whose link to the next stage ended waits for its head to let go (the
# next stage died: the head knows) before it leaves the arrangement itself (only the link
# dropped: nothing else would tell the head)
NEXT_LINK_GRACE_S = 1.0
LET_GO_S = 0.25  # how long a stage whose head left waits for that head's data links to close before cutting them
PROFILE_REPORT_S = 1.0  # at most this often a stage re-reports its profile
WS_OPTIONS = dict(compression=None, max_size=frames.DEFAULT_MAX_PAYLOAD + (2 << 20), ping_interval=20,
                  ping_timeout=60, max_queue=64)
# Until a peer has proven a key it may send only its hello (a few hundred bytes): a
# message larger than this is refused from its header, before its bytes are buffered.
# Before this, an unproven connection could send ~1 GiB, and three of 256 MiB grew a
# sharing node by a gigabyte. The limit is lifted for that connection once it is proven.
PROOF_MAX = 4096
PROOF_QUEUE = 4
# What a proven peer may send on each kind of connection, once its proof is taken: a data
# link carries activations (WS_OPTIONS' max_size); a control connection carries control
# messages to a stage, and control messages and token frames (no tensor) back from one.
# Lifting a control connection to a data link's gigabyte let a head that stopped reading
# park the stage's loop and then queue 64 messages of 64 MiB in its memory.
SEAL_OVERHEAD = 1024
# A data link carries volumes cut in pieces of at most MAX_PIECE (engine/pipeline/link.py),
# each a CHUNK frame with a few bytes of meta: nothing larger is taken. At a gigabyte a
# message, the 64 a link queues unread were 64 GiB a peer with the route token could
# park in the stage's memory; at this size they are 17 MiB.
DATA_MAX = MAX_PIECE + frames.HEADER.size + 4 * frames.MAX_NDIM + 4096 + SEAL_OVERHEAD
# data links a stage holds at once: one from the stage (or head) before it, and a few more
# while one that went quiet is not yet known dead. Every friend stage holds the route
# token, so a hostile one could open links without end, each buffering up to gigabytes
# of volumes: beyond this many the oldest is closed
MAX_DATA_LINKS = 4
# messages read ahead: a head sends a "free" per finished reply, dozens at once, and
# while they wait here unread a full queue stops reading the socket, pings included
CONTROL_QUEUE = WS_OPTIONS["max_queue"]
CONTROL_MAX = max(frames.MAX_CONTROL, frames.HEADER.size + 4 * frames.MAX_NDIM + frames.MAX_META) + SEAL_OVERHEAD
# A peer that has read nothing we sent for this long has stopped (a frozen head, a hostile
# one): its connection is cut. websockets' own keepalive cannot tell, since its ping waits
# on the same full send buffer; the accepting side's ping_timeout is the same patience.
SEND_STALL_S = 60.0
# Heartbeats on the connections a head or a stage opens (to the stage after it): a stage
# that stops answering (asleep, unplugged, frozen) is noticed within the two together
# and the head rearranges the pipeline without it. A ping is a few bytes every few
# seconds: nothing the weak-link scheduler's measurements can see. The side that
# accepts stays lenient (above): a stage only frees its memory when its head goes quiet.
# (A closing handshake with a peer that no longer answers is cut short too: it would
# otherwise hold the news of the loss for websockets' default 10 s.) The silence is
# counted in time this process ran (engine/core/heartbeat.py): a head whose own loop
# was held must not give up on every stage at once.
HEARTBEAT_S, HEARTBEAT_TIMEOUT_S = 2.0, 5.0
CLIENT_WS_OPTIONS = dict(WS_OPTIONS, ping_interval=HEARTBEAT_S, ping_timeout=HEARTBEAT_TIMEOUT_S, close_timeout=1.0,
                         create_connection=HeartbeatConnection)


def lift_proof_limit(ws, max_size: int, max_queue: int = WS_OPTIONS["max_queue"]) -> None:
    """A proven peer may send messages up to max_size, max_queue of them buffered before
    reading pauses. websockets reads the limits per frame: raising them takes effect at once."""
    ws.protocol.max_message_size = max_size
    ws.recv_messages.high, ws.recv_messages.low = max_queue, max(1, max_queue // 4)


class NotAuthorized(frames.FrameError):
    """The stage took our hello and refused it: said in the words a user can act on (the
    websocket's own "received 1008 (policy violation) not authorized" says nothing)."""

    def __init__(self):
        super().__init__("the stage refused this head: the secret in its address (the part after #, "
                         "as the stage printed it) is wrong or missing, or the stage serves another "
                         "pipeline (--pipeline)")


async def connect_stage(address: str, role: str, pipeline: str, key: str = "", timeout: float = 30.0):
    """Open a connection to a stage and say hello, proving `key` against its challenge
    (the share's secret for a control connection, the route token for a data link), and
    return it sealed (a SealedSocket). An address 'ws://host:port#secret' brings its own
    secret; a stage on loopback with none takes the empty key."""
    url, secret = split_address(address)
    key = key or secret or ""
    # whoever answers at the address (a stage, or anyone else there now) may send only a
    # challenge and an accept until it has proven the key: not a gigabyte before it
    ws = await asyncio.wait_for(connect(url, **dict(CLIENT_WS_OPTIONS, max_size=PROOF_MAX,
                                                      max_queue=PROOF_QUEUE)), timeout)
    try:
        challenge = frames.parse_control(await asyncio.wait_for(ws.recv(), timeout))
        if challenge["type"] != "challenge":
            raise frames.FrameError(f"expected a challenge, got {challenge['type']}")
        opener = HelloOpener(key, role, pipeline, challenge["nonce"])
        await ws.send(frames.control("hello", role=role, version=PROTOCOL_VERSION, pipeline=pipeline,
                                     auth=opener.auth))
        try:
            accept = frames.parse_control(await asyncio.wait_for(ws.recv(), timeout))
        except ConnectionClosed as exc:
            # a control connection is a person's address and secret: said in their words. A
            # data link refused (a route that changed under a rearrangement) stays a closed
            # connection, which the rearrangement takes as a machine to try again
            if role == "control" and exc.rcvd is not None and exc.rcvd.code == 1008 \
                    and exc.rcvd.reason == "not authorized":
                raise NotAuthorized() from None
            raise
        if accept["type"] != "accept":
            raise frames.FrameError(f"expected accept, got {accept['type']}")
        sealed = SealedSocket(ws, opener.accept(accept["auth"]))
        # proven: a stage sends control messages and token frames back (a data link: acks)
        lift_proof_limit(ws, CONTROL_MAX)
        if role == "data":
            # nothing more until the stage has taken the proof and lifted its size limit
            # (a control connection waits for its welcome the same way)
            ready = frames.parse_control(await asyncio.wait_for(sealed.recv(), timeout))
            if ready["type"] != "ready":
                raise frames.FrameError(f"expected ready, got {ready['type']}")
    except BaseException:
        await ws.close()
        raise
    return sealed
