"""The Noise IK handshake (optionally IKpsk1) and an explicit-counter transport cipher.

Built only on `cryptography`'s primitives (X25519, ChaCha20-Poly1305, HKDF-SHA256 =
Noise's HKDF), following the Noise Protocol Framework, revision 34:

    Noise_IKpsk1_25519_ChaChaPoly_SHA256     a joiner presenting an invite:
        <- s                                 the host's key comes from the invite
        ...
        -> e, es, s, ss, psk                 psk = the invite's join secret
        <- e, ee, se
    Noise_IK_25519_ChaChaPoly_SHA256         a member (key on the host's allowlist)
        the same without psk

IK suits us: the joiner knows the host's static key from the invite, so nobody but
the host (not the relay) can read message 1 or answer it; the host learns the
joiner's static key from message 1, encrypted. With psk1 a wrong join secret fails on
the first message, so the host can say so at once. tests/test_tunnel.py checks this
implementation byte for byte against the `noiseprotocol` package.

Each failure raises NoiseError with a reason a person can act on.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

DHLEN = 32
HASHLEN = 32
TAGLEN = 16
MAX_NONCE = (1 << 64) - 2     # 2^64-1 is reserved by the spec


class NoiseError(ValueError):
    """A handshake or transport message that must be rejected; str() says why."""


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _dh(priv: X25519PrivateKey, pub: bytes) -> bytes:
    try:
        return priv.exchange(X25519PublicKey.from_public_bytes(pub))
    except ValueError as exc:   # low-order point: an all-zero shared secret
        raise NoiseError(f"invalid public key ({exc})") from None


def _hkdf(ck: bytes, ikm: bytes, n: int) -> list[bytes]:
    # Noise's HKDF(ck, ikm): temp = HMAC(ck, ikm); out_i = HMAC(temp, out_{i-1} || i)
    temp = hmac.new(ck, ikm, hashlib.sha256).digest()
    outs, prev = [], b""
    for i in range(1, n + 1):
        prev = hmac.new(temp, prev + bytes([i]), hashlib.sha256).digest()
        outs.append(prev)
    return outs


def _nonce(n: int) -> bytes:
    return b"\x00\x00\x00\x00" + struct.pack("<Q", n)


class _Symmetric:
    def __init__(self, name: bytes):
        self.h = name.ljust(HASHLEN, b"\x00") if len(name) <= HASHLEN else hashlib.sha256(name).digest()
        self.ck = self.h
        self.k: bytes | None = None
        self.n = 0

    def mix_hash(self, data: bytes):
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes):
        self.ck, self.k = _hkdf(self.ck, ikm, 2)
        self.n = 0

    def mix_key_and_hash(self, ikm: bytes):
        self.ck, temp_h, self.k = _hkdf(self.ck, ikm, 3)
        self.mix_hash(temp_h)
        self.n = 0

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        if self.k is None:
            out = plaintext
        else:
            out = ChaCha20Poly1305(self.k).encrypt(_nonce(self.n), plaintext, self.h)
            self.n += 1
        self.mix_hash(out)
        return out

    def decrypt_and_hash(self, ciphertext: bytes, what: str) -> bytes:
        if self.k is None:
            out = ciphertext
        else:
            try:
                out = ChaCha20Poly1305(self.k).decrypt(_nonce(self.n), ciphertext, self.h)
            except InvalidTag:
                raise NoiseError(what) from None
            self.n += 1
        self.mix_hash(ciphertext)
        return out

    def split(self) -> tuple[bytes, bytes]:
        k1, k2 = _hkdf(self.ck, b"", 2)
        return k1, k2


def protocol_name(psk: bool) -> bytes:
    return b"Noise_IKpsk1_25519_ChaChaPoly_SHA256" if psk else b"Noise_IK_25519_ChaChaPoly_SHA256"


class Initiator:
    """The joiner's side. write_1() -> bytes; read_2(bytes) -> payload; then keys()."""

    def __init__(self, static: X25519PrivateKey, responder_public: bytes, prologue: bytes,
                 psk: bytes | None = None, ephemeral: X25519PrivateKey | None = None):
        if psk is not None and len(psk) != 32:
            raise ValueError("psk must be 32 bytes")
        self.s, self.rs, self.psk = static, responder_public, psk
        self.e = ephemeral or X25519PrivateKey.generate()
        self.sym = _Symmetric(protocol_name(psk is not None))
        self.sym.mix_hash(prologue)
        self.sym.mix_hash(responder_public)

    def write_1(self, payload: bytes = b"") -> bytes:
        sym = self.sym
        e_pub = public_bytes(self.e)
        sym.mix_hash(e_pub)
        if self.psk is not None:
            sym.mix_key(e_pub)
        sym.mix_key(_dh(self.e, self.rs))                       # es
        enc_s = sym.encrypt_and_hash(public_bytes(self.s))      # s
        sym.mix_key(_dh(self.s, self.rs))                       # ss
        if self.psk is not None:
            sym.mix_key_and_hash(self.psk)                      # psk
        return e_pub + enc_s + sym.encrypt_and_hash(payload)

    def read_2(self, msg: bytes) -> bytes:
        sym, msg = self.sym, bytes(msg)
        if len(msg) < DHLEN + TAGLEN:
            raise NoiseError("handshake answer too short")
        re = msg[:DHLEN]
        sym.mix_hash(re)
        if self.psk is not None:
            sym.mix_key(re)
        sym.mix_key(_dh(self.e, re))                            # ee
        sym.mix_key(_dh(self.s, re))                            # se
        return sym.decrypt_and_hash(msg[DHLEN:], "the answer is not from the host named in the code "
                                                 "(or the join secret is wrong)")

    def keys(self) -> tuple[bytes, bytes]:
        """(send key, receive key)."""
        k1, k2 = self.sym.split()
        return k1, k2

    @property
    def handshake_hash(self) -> bytes:
        return self.sym.h


class Responder:
    """The host's side, in two steps so the host can choose the psk and check the
    initiator's key in between:

        r = Responder(static, prologue, psk=...)
        payload = r.read_1(msg)          # r.remote_static is the joiner's key
        answer = r.write_2(b"...")
    """

    def __init__(self, static: X25519PrivateKey, prologue: bytes, psk: bytes | None = None,
                 ephemeral: X25519PrivateKey | None = None):
        if psk is not None and len(psk) != 32:
            raise ValueError("psk must be 32 bytes")
        self.s, self.psk = static, psk
        self.e = ephemeral or X25519PrivateKey.generate()
        self.sym = _Symmetric(protocol_name(psk is not None))
        self.sym.mix_hash(prologue)
        self.sym.mix_hash(public_bytes(static))
        self.remote_static: bytes | None = None
        self.re: bytes | None = None

    def read_1(self, msg: bytes) -> bytes:
        sym, msg = self.sym, bytes(msg)
        if len(msg) < DHLEN + DHLEN + TAGLEN + TAGLEN:
            raise NoiseError("handshake message too short")
        self.re = msg[:DHLEN]
        sym.mix_hash(self.re)
        if self.psk is not None:
            sym.mix_key(self.re)
        sym.mix_key(_dh(self.s, self.re))                       # es
        self.remote_static = sym.decrypt_and_hash(
            msg[DHLEN:DHLEN + DHLEN + TAGLEN],
            "handshake not encrypted to this host's key (a code from another host?)")
        sym.mix_key(_dh(self.s, self.remote_static))            # ss
        if self.psk is not None:
            sym.mix_key_and_hash(self.psk)
        return sym.decrypt_and_hash(msg[DHLEN + DHLEN + TAGLEN:],
                                    "wrong join secret" if self.psk is not None else "handshake payload tampered")

    def write_2(self, payload: bytes = b"") -> bytes:
        sym = self.sym
        e_pub = public_bytes(self.e)
        sym.mix_hash(e_pub)
        if self.psk is not None:
            sym.mix_key(e_pub)
        sym.mix_key(_dh(self.e, self.re))                       # ee
        sym.mix_key(_dh(self.e, self.remote_static))            # se
        return e_pub + sym.encrypt_and_hash(payload)

    def keys(self) -> tuple[bytes, bytes]:
        """(send key, receive key)."""
        k1, k2 = self.sym.split()
        return k2, k1

    @property
    def handshake_hash(self) -> bytes:
        return self.sym.h


class TransportCipher:
    """One direction's AEAD after the handshake. Each message carries its 8-byte
    counter in clear (authenticated as associated data); the receiver accepts only the
    next counter: the channel is ordered, so anything else is a replay, a drop or a
    reorder, and is refused with that reason before decryption is tried."""

    def __init__(self, key: bytes):
        self._aead = ChaCha20Poly1305(key)
        self.n = 0

    def encrypt(self, plaintext: bytes) -> bytes:
        if self.n > MAX_NONCE:
            raise NoiseError("session exhausted its nonces; reconnect")
        head = struct.pack("<Q", self.n)
        out = head + self._aead.encrypt(_nonce(self.n), plaintext, head)
        self.n += 1
        return out

    def decrypt(self, message: bytes) -> bytes:
        if len(message) < 8 + TAGLEN:
            raise NoiseError("encrypted frame too short")
        (n,) = struct.unpack_from("<Q", message)
        if n < self.n:
            raise NoiseError(f"replayed frame (counter {n}, expected {self.n})")
        if n != self.n:
            raise NoiseError(f"frame out of order (counter {n}, expected {self.n})")
        try:
            out = self._aead.decrypt(_nonce(n), bytes(message[8:]), bytes(message[:8]))
        except InvalidTag:
            raise NoiseError("tampered frame (authentication failed)") from None
        self.n += 1
        return out


# ---- NNpsk0: two parties that share only a key -----------------------------------------
#
#     Noise_NNpsk0_25519_ChaChaPoly_SHA256
#         -> psk, e
#         <- e, ee
#
# A stage connection's two ends know no static keys of each other, only a shared secret
# (the share's secret for a head, the pipeline's route token for a data link). Both
# ephemeral keys make every connection's session keys fresh, so a recorded handshake
# cannot be replayed into a connection of its own; with psk0 a wrong key fails on the
# first message, before the responder answers anything.

NNPSK0 = b"Noise_NNpsk0_25519_ChaChaPoly_SHA256"


class _PskParty:
    def __init__(self, psk: bytes, prologue: bytes, ephemeral: X25519PrivateKey | None = None):
        if len(psk) != 32:
            raise ValueError("psk must be 32 bytes")
        self.psk = psk
        self.e = ephemeral or X25519PrivateKey.generate()
        self.sym = _Symmetric(NNPSK0)
        self.sym.mix_hash(prologue)
        self.re: bytes | None = None


class PskInitiator(_PskParty):
    """write_1() -> bytes; read_2(bytes) -> payload; then keys() = (send, receive)."""

    def write_1(self, payload: bytes = b"") -> bytes:
        sym = self.sym
        sym.mix_key_and_hash(self.psk)                          # psk
        e_pub = public_bytes(self.e)
        sym.mix_hash(e_pub)                                     # e
        sym.mix_key(e_pub)
        return e_pub + sym.encrypt_and_hash(payload)

    def read_2(self, msg: bytes) -> bytes:
        sym, msg = self.sym, bytes(msg)
        if len(msg) < DHLEN + TAGLEN:
            raise NoiseError("handshake answer too short")
        re = msg[:DHLEN]
        sym.mix_hash(re)                                        # e
        sym.mix_key(re)
        sym.mix_key(_dh(self.e, re))                            # ee
        return sym.decrypt_and_hash(msg[DHLEN:], "the answer does not prove the same key")

    def keys(self) -> tuple[bytes, bytes]:
        return self.sym.split()


class PskResponder(_PskParty):
    """read_1(bytes) -> payload (NoiseError: not the same key); write_2() -> bytes; keys()."""

    def read_1(self, msg: bytes) -> bytes:
        sym, msg = self.sym, bytes(msg)
        if len(msg) < DHLEN + TAGLEN:
            raise NoiseError("handshake message too short")
        sym.mix_key_and_hash(self.psk)
        self.re = msg[:DHLEN]
        sym.mix_hash(self.re)
        sym.mix_key(self.re)
        return sym.decrypt_and_hash(msg[DHLEN:], "wrong key")

    def write_2(self, payload: bytes = b"") -> bytes:
        sym = self.sym
        e_pub = public_bytes(self.e)
        sym.mix_hash(e_pub)
        sym.mix_key(e_pub)
        sym.mix_key(_dh(self.e, self.re))                       # ee
        return e_pub + sym.encrypt_and_hash(payload)

    def keys(self) -> tuple[bytes, bytes]:
        k1, k2 = self.sym.split()
        return k2, k1
