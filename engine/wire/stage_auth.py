"""Who may drive a stage: the proofs in a stage connection's handshake (sans-I/O).

A stage server opens every connection with a challenge (a fresh nonce) and says nothing
else until the peer's hello proves it holds a key:

  * control connections (a head: configure, shutdown) prove the share's *secret*, which
    the owner hands to friends as part of the share address, `ws://host:port#secret`;
  * data connections (the previous stage, or the head's own first link) prove the
    pipeline's *route token*, which the authenticated head gives every stage in its
    configure message, so a friend's stage can reach the next one without learning
    that friend's secret.

The proof is HMAC-SHA256 over the role, the pipeline name and the server's nonce, so a
recorded hello cannot be replayed to another connection. This keeps strangers on the
LAN from loading models, injecting work or shutting a share down; it does not hide the
traffic from someone who can watch the LAN (sharing across homes goes through the
encrypted tunnel, engine/wire/tunnel.py).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

NONCE_BYTES = 16
SECRET_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"   # no 0/o, 1/l: read out or retyped
SECRET_CHARS = 20                                       # ~100 bits


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def new_secret() -> str:
    return "".join(secrets.choice(SECRET_ALPHABET) for _ in range(SECRET_CHARS))


def new_route() -> str:
    return secrets.token_hex(16)


def proof(key: str, role: str, pipeline: str, nonce: str) -> str:
    msg = f"potluck-stage|{role}|{pipeline}|{nonce}".encode()
    return hmac.new(key.encode(), msg, hashlib.sha256).hexdigest()


def verify(key: str | None, role: str, pipeline: str, nonce: str, auth: str) -> bool:
    if not key:
        return False
    return hmac.compare_digest(proof(key, role, pipeline, nonce), auth)


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
