"""A host proves to the relay that it holds the key its friends' invites name.

The relay pairs joiners with hosts by pipeline id. Were that all, whoever learned a
pipeline id (it is in every invite code) could register first, while the host's
computer slept, and every join through that relay would wait on the impostor: a denial
of service (never more: without the host's key nobody can answer a joiner's handshake).
So the relay lists a host under its pipeline id *and* its public key, a joiner asks for
both (the invite carries the key), and a host is listed only once it proves it holds
the private key:

    relay -> host   {"type": "challenge", "key": <the relay's one-time X25519 public key>, "nonce": ...}
    host  -> relay  {"type": "proof", "proof": HMAC-SHA256(X25519(host key, relay key), context)}
    relay -> host   {"type": "registered"}

where the context binds the pipeline, the host's public key and the nonce. Only the
holder of the host's private key can compute the shared secret. An impostor can list
the same pipeline under a key of its own, which no joiner asks for.

Pure functions; the relay (engine/wire/relay.py) and the host (tunnel_host.py) do the I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

CONTEXT = b"potluck relay host v1"


class Challenge:
    """The relay's side of one host registration."""

    def __init__(self, pipeline: str, host_key: bytes):
        self.pipeline, self.host_key = pipeline, host_key
        self._secret = X25519PrivateKey.generate()
        self.nonce = os.urandom(16)

    def message(self) -> dict:
        public = self._secret.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return {"type": "challenge", "key": public.hex(), "nonce": self.nonce.hex()}

    def check(self, msg) -> bool:
        """Whether `msg` (the host's answer, parsed JSON) proves the host key."""
        proof = msg.get("proof") if isinstance(msg, dict) and msg.get("type") == "proof" else None
        # 64 hex digits, or no proof: compare_digest raises on a str that is not ASCII
        if not isinstance(proof, str) or len(proof) != 64 or not all(c in "0123456789abcdef" for c in proof):
            return False
        try:
            shared = self._secret.exchange(X25519PublicKey.from_public_bytes(self.host_key))
        except ValueError:   # a low-order key: no secret to prove
            return False
        want = _proof(shared, self.pipeline, self.host_key, self.nonce)
        return hmac.compare_digest(want, proof)


def prove(host_private: X25519PrivateKey, pipeline: str, msg) -> dict:
    """The host's answer to the relay's challenge `msg` (parsed JSON). Raises ValueError
    on a challenge that is not one."""
    if not isinstance(msg, dict) or msg.get("type") != "challenge":
        raise ValueError("the relay sent no challenge")
    try:
        relay_key = bytes.fromhex(msg["key"])
        nonce = bytes.fromhex(msg["nonce"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("the relay's challenge is malformed") from None
    if len(relay_key) != 32 or not 8 <= len(nonce) <= 64:
        raise ValueError("the relay's challenge is malformed")
    shared = host_private.exchange(X25519PublicKey.from_public_bytes(relay_key))
    mine = host_private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return {"type": "proof", "proof": _proof(shared, pipeline, mine, nonce)}


def _proof(shared: bytes, pipeline: str, host_key: bytes, nonce: bytes) -> str:
    return hmac.new(shared, CONTEXT + pipeline.encode() + host_key + nonce, hashlib.sha256).hexdigest()


def relay_refusal(exc: BaseException) -> str:
    """A relay's refusal in words. A relay of an older Potluck does not know this version's
    routes (the host's key in the path) and answers them with a bare HTTP 404."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status == 404:
        return ("the relay does not know this version's routes (HTTP 404): it runs an older Potluck, "
                "or the address is not a Potluck relay; update the relay (potluck relay)")
    return str(exc) or type(exc).__name__
