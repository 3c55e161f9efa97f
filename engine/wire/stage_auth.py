"""Who may drive a stage, and the keys its traffic is sealed with (sans-I/O).

A stage server opens every connection with a challenge (a fresh nonce) and says nothing
else until the peer's hello proves it holds a key:

  * control connections (a head: configure, shutdown) prove the share's *secret*, which
    the owner hands to friends as part of the share address, `ws://host:port#secret`
    (the stages `serve --stages N` starts: a fresh one each, from their parent, through
    the environment; a `potluck stage` on loopback given none: the empty key; a friend's
    stage behind its tunnel: `tunnel_stage_secret`, which only that friend and the host
    can compute);
  * data connections (the previous stage, or the head's own first link) prove the
    pipeline's *route token*, which the authenticated head gives every stage in its
    configure message, so a friend's stage can reach the next one without learning
    that friend's secret. The token is good while that head holds the stage.

The hello carries the first message of a Noise NNpsk0 handshake (engine/wire/noise.py)
whose psk is derived from that key, with the role, pipeline and nonce as its prologue;
the stage answers ("accept") only if it proves the same key. From then on every message
both ways is sealed with the handshake's fresh keys (ChaCha20-Poly1305, numbered): an
observer of the LAN learns sizes and timing, not prompts, tokens or the route token; a
message recorded on one connection opens on no other, and on its own only once.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from engine.wire.frames import FrameError
from engine.wire.noise import MAX_NONCE, TAGLEN, NoiseError, PskInitiator, PskResponder, _nonce

NONCE_BYTES = 16
SECRET_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"   # no 0/o, 1/l: read out or retyped
SECRET_CHARS = 20                                       # ~100 bits
# the shortest secret a stage beyond loopback takes from its owner (`--secret abc` was
# taken for a stage open to the LAN): 16 of any printable characters, ~64 bits at the least
MIN_SECRET_CHARS = 16


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def new_secret() -> str:
    return "".join(secrets.choice(SECRET_ALPHABET) for _ in range(SECRET_CHARS))


def new_route() -> str:
    return secrets.token_hex(16)


def tunnel_stage_secret(own_private, their_public: bytes, pipeline: str) -> str:
    """The control secret of a friend's stage reached through the friend's tunnel, from
    the static keys of that friend and the host (X25519 both ways round: each computes it
    from its own private key and the other's public one). The stage listens on loopback,
    and other friends' streams reach it too -- a friend-to-friend hop, a hop through the
    host -- carrying data, which proves the route token every stage is given. A control
    connection drives the stage (its model, shutdown): with no secret, another friend
    could take it whenever its head let go. This one no other friend can compute, and it
    is the same after either machine restarts, so the host's head reaches a friend who
    rejoins at the address it knew."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    shared = own_private.exchange(X25519PublicKey.from_public_bytes(their_public))
    return hmac.new(shared, f"potluck-tunnel-stage-control|{pipeline}".encode(), hashlib.sha256).hexdigest()


def stage_psk(key: str, role: str, pipeline: str) -> bytes:
    return hmac.new(key.encode(), f"potluck-stage-psk|{role}|{pipeline}".encode(), hashlib.sha256).digest()


def _prologue(role: str, pipeline: str, nonce: str) -> bytes:
    return f"potluck-stage|{role}|{pipeline}|{nonce}".encode()


class NotAuthorized(FrameError):
    """A hello that does not prove the key (deliberately says nothing of what was wrong)."""

    def __init__(self):
        super().__init__("not authorized")


class Seal:
    """Both directions of one sealed connection: seal(str | bytes) -> bytes to send,
    open(bytes received) -> the str or bytes that was sealed, or SealError.

    A sealed message: kind u8 (1 text, 2 binary) | counter u64 | ChaCha20-Poly1305 of the
    message, with the first 9 bytes as associated data. The channel under it is ordered,
    so only the next counter is accepted."""

    TEXT, BINARY = 1, 2
    HEAD = struct.Struct("<BQ")
    OVERHEAD = HEAD.size + TAGLEN

    def __init__(self, send_key: bytes, recv_key: bytes):
        self._send, self._recv = ChaCha20Poly1305(send_key), ChaCha20Poly1305(recv_key)
        self._tx = self._rx = 0

    def seal(self, msg: str | bytes) -> bytes:
        if self._tx > MAX_NONCE:
            raise SealError("session exhausted its nonces; reconnect")
        kind, data = (self.TEXT, msg.encode()) if isinstance(msg, str) else (self.BINARY, msg)
        head = self.HEAD.pack(kind, self._tx)
        self._tx += 1
        return head + self._send.encrypt(_nonce(self._tx - 1), data, head)

    def open(self, message: str | bytes) -> str | bytes:
        if isinstance(message, str):
            raise SealError("a plain text message on a sealed connection")
        if len(message) < self.OVERHEAD:
            raise SealError("sealed message too short")
        kind, n = self.HEAD.unpack_from(message)
        if n != self._rx:
            raise SealError(f"{'replayed' if n < self._rx else 'out-of-order'} message "
                            f"(counter {n}, expected {self._rx})")
        if kind not in (self.TEXT, self.BINARY):
            raise SealError(f"unknown sealed message kind {kind}")
        view = memoryview(message)
        try:
            data = self._recv.decrypt(_nonce(n), view[self.HEAD.size:], view[:self.HEAD.size])
        except InvalidTag:
            raise SealError("tampered message (authentication failed)") from None
        self._rx += 1
        if kind == self.BINARY:
            return data
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise SealError("sealed text is not UTF-8") from None


class SealError(FrameError):
    """A sealed message that must be refused; str() says why."""


class HelloOpener:
    """The connecting side: `auth` goes in the hello, accept(the stage's answer) -> Seal."""

    def __init__(self, key: str, role: str, pipeline: str, nonce: str):
        self._hs = PskInitiator(stage_psk(key, role, pipeline), _prologue(role, pipeline, nonce))
        self.auth = self._hs.write_1().hex()

    def accept(self, answer: str) -> Seal:
        try:
            self._hs.read_2(bytes.fromhex(answer))
        except (ValueError, NoiseError):   # NoiseError is a ValueError too
            raise FrameError("the stage's answer does not prove the same key") from None
        return Seal(*self._hs.keys())


MAX_AUTH = 256   # hex characters: the handshake's first message is 48 bytes


def answer_hello(key: str, role: str, pipeline: str, nonce: str, auth: str) -> tuple[str, Seal]:
    """The stage's side: (the answer to send back, the Seal), or NotAuthorized."""
    if len(auth) > MAX_AUTH:
        raise NotAuthorized()
    try:
        hs = PskResponder(stage_psk(key, role, pipeline), _prologue(role, pipeline, nonce))
        hs.read_1(bytes.fromhex(auth))
        answer = hs.write_2().hex()     # a low-order ephemeral fails here (NoiseError)
    except ValueError:   # not hex, too short, another key, a bad point (NoiseError)
        raise NotAuthorized() from None
    return answer, Seal(*hs.keys())


def split_address(address: str) -> tuple[str, str | None]:
    """'ws://host:port#secret' -> ('ws://host:port', 'secret'); no '#': no secret."""
    url, sep, secret = address.strip().partition("#")
    return url, (secret.strip() or None) if sep else None


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
