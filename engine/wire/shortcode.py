"""Short codes to read out over the phone: `4821-917305`.

A short code is never a secret by itself: it is a one-time password for a SPAKE2
exchange (the `spake2` package, symmetric variant) through the relay, which hands the
real invite code from the host to the joiner, encrypted with the key both derive:

    host (offer)   ->  relay /v1/pake/4821  <-  joiner (redeem)
    both: SPAKE2 message ->  key = HKDF(SPAKE2 key)
    host -> joiner: ChaCha20-Poly1305(key_h, invite code)
    joiner -> host: ChaCha20-Poly1305(key_j, "ok")

The first four digits pick the relay mailbox, the other six (20 bits) are the
password. An eavesdropper or the relay learns nothing; an attacker who answers in the
friend's place gets one online guess (1 in a million) and the code is spent either
way: the host offers it once, for 10 minutes.
"""

from __future__ import annotations

import asyncio
import re
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

SHORT = re.compile(r"^\s*(\d{4})[-\s]?(\d{6})\s*$")
PAKE_ID = b"potluck short code v1"
TTL = 600.0
# close_timeout: a relay still waiting for a mailbox's other side reads no close frame
WS = dict(max_size=4096, compression=None, open_timeout=10, close_timeout=2)


class ShortCodeError(RuntimeError):
    pass


def make() -> tuple[str, str]:
    """(channel, password): shown together as 'CCCC-PPPPPP'."""
    return f"{secrets.randbelow(10_000):04d}", f"{secrets.randbelow(1_000_000):06d}"


def is_short(text: str) -> bool:
    return bool(SHORT.match(text))


def split(text: str) -> tuple[str, str]:
    m = SHORT.match(text)
    if not m:
        raise ShortCodeError("a short code is 4 digits, a dash, 6 digits (e.g. 4821-917305)")
    return m.group(1), m.group(2)


def _keys(shared: bytes) -> tuple[bytes, bytes]:
    out = HKDF(hashes.SHA256(), 64, salt=None, info=b"potluck short code keys").derive(shared)
    return out[:32], out[32:]


# how long a joiner waits on the relay for the host's side: a host that printed the code
# is already waiting, so one not there by then is a mistyped, spent or expired code
REDEEM_WAIT = 20.0
ASK_AGAIN = "ask the host for a new one (each works once, for 10 minutes)"


async def _exchange(relay: str, channel: str, password: str, timeout: float, host: bool):
    from spake2 import SPAKE2_Symmetric

    url = f"{relay.rstrip('/')}/v1/pake/{channel}"
    try:
        ws = await connect(url, **WS)
    except (OSError, InvalidHandshake, InvalidURI, asyncio.TimeoutError) as exc:
        raise ShortCodeError(f"cannot reach the relay at {relay}: {exc}") from None
    s = SPAKE2_Symmetric(password.encode(), idSymmetric=PAKE_ID)
    try:
        await ws.send(s.start())
        theirs = await asyncio.wait_for(ws.recv(), timeout)
    except asyncio.TimeoutError:
        await ws.close()
        if host:
            raise ShortCodeError("nobody used the short code in time") from None
        raise ShortCodeError(f"no host is offering short code {channel}-{password} on {relay}: check the digits, "
                             f"or {ASK_AGAIN}") from None
    except ConnectionClosed as exc:
        reason = exc.rcvd.reason if exc.rcvd else ""
        if reason == "channel busy":
            raise ShortCodeError(f"someone else is using this short code right now; {ASK_AGAIN}") from None
        if not host:
            raise ShortCodeError(f"the host's offer of this short code ended (used, or expired); {ASK_AGAIN}") from None
        raise ShortCodeError(f"the relay closed the exchange ({reason or 'no reason given'})") from None
    try:
        shared = s.finish(bytes(theirs))
    except Exception:   # noqa: BLE001  spake2 raises its own errors for malformed messages
        await ws.close()
        raise ShortCodeError("the other side sent a malformed exchange message") from None
    return ws, _keys(shared)


async def offer(relay: str, channel: str, password: str, invite_code: str, timeout: float = TTL) -> str:
    """Host side: wait for a joiner on the channel, hand over the invite code once.
    Returns "delivered" or raises ShortCodeError (wrong code, timeout...)."""
    ws, (k_host, k_joiner) = await _exchange(relay, channel, password, timeout, host=True)
    try:
        await ws.send(ChaCha20Poly1305(k_host).encrypt(b"\0" * 12, invite_code.encode(), PAKE_ID))
        ack = await asyncio.wait_for(ws.recv(), 30)
        ChaCha20Poly1305(k_joiner).decrypt(b"\0" * 12, bytes(ack), PAKE_ID)
        return "delivered"
    except (InvalidTag, TypeError):
        raise ShortCodeError("someone tried the short code with the wrong digits; it is spent") from None
    except (asyncio.TimeoutError, ConnectionClosed):
        raise ShortCodeError("the other side left before confirming (wrong digits?)") from None
    finally:
        await ws.close()


async def redeem(relay: str, short: str, timeout: float = REDEEM_WAIT) -> str:
    """Joiner side: the invite code behind `short`, or ShortCodeError."""
    channel, password = split(short)
    ws, (k_host, k_joiner) = await _exchange(relay, channel, password, timeout, host=False)
    try:
        sealed = await asyncio.wait_for(ws.recv(), 30)
        code = ChaCha20Poly1305(k_host).decrypt(b"\0" * 12, bytes(sealed), PAKE_ID).decode()
        await ws.send(ChaCha20Poly1305(k_joiner).encrypt(b"\0" * 12, b"ok", PAKE_ID))
        return code
    except (InvalidTag, TypeError, UnicodeDecodeError):
        raise ShortCodeError(f"wrong short code (or it was already used); {ASK_AGAIN}") from None
    except (asyncio.TimeoutError, ConnectionClosed):
        raise ShortCodeError(f"the host did not answer (the short code expired or was used?); {ASK_AGAIN}") from None
    finally:
        await ws.close()
