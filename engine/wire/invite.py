"""Invite codes, and the host's record of invites and members.

An invite code is one token to copy and paste: Crockford base32 (case-insensitive;
O reads as 0, I and L as 1; dashes and spaces ignored) of

    version u8 | pipeline id 8 B | invite id 8 B | join secret 16 B (128 bits)
    | host public key 32 B | expires u32 (unix s) | max uses u16
    | relay URL (u8 length + ASCII) | direct addresses (u8 count, each: kind u8
    | u8 length + ASCII) | checksum: the first 4 bytes of SHA-256 of all the above

The kind says what an address is (engine/wire/candidates.py: lan, given, mapped, ipv6,
public), so the joiner tries them in a sensible order and says which path it took.
Version 1 codes, whose addresses carry no kind, still parse (each is "given").

A character outside the alphabet or a checksum that does not match raises InviteError
("this code has a typo ..."): a mistyped code never reaches the network. The host
checks expiry and uses again against its own record (HostState), which a code
cannot change.

HostState is `<config_dir>/host.json` (mode 0600): the pipeline id, the invites (with
their secrets) and the members' node keys, each revocable. Every check re-reads the
file, so `potluck invites --revoke` from another terminal takes effect at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.sizes import counted

ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DECODE = {c: i for i, c in enumerate(ALPHABET)}
_DECODE.update({"O": 0, "I": 1, "L": 1})
VERSION = 2
READS = (1, 2)
# "udp": a socket's public address for hole punching (engine/wire/punch.py), udp://a:port;
# never a WebSocket route, only where to punch at when a reply code comes back
KIND_CODES = ("given", "lan", "mapped", "ipv6", "public", "udp")
CHECKSUM = 4
MAX_CODE_CHARS = 2000
_FIXED = struct.Struct("<B8s8s16s32sIH")
# the fewest characters a code can have: a fixed part, an empty relay and no address, its
# checksum (an invite); a reply's fixed part and checksum
_SHORTEST_INVITE = -(-(_FIXED.size + 2 + CHECKSUM) * 8 // 5)
_SHORTEST_REPLY = -(-(18 + CHECKSUM) * 8 // 5)


class InviteError(ValueError):
    """A code that cannot be used; str() is the message for the person holding it."""


@dataclass
class Invite:
    pipeline: bytes            # 8 bytes
    invite_id: bytes           # 8 bytes
    secret: bytes              # 16 bytes
    host_key: bytes            # 32 bytes, X25519
    expires: int               # unix seconds
    max_uses: int
    relay: str = ""            # ws(s)://host:port of a relay, or ""
    direct: list[str] = field(default_factory=list)   # ws://addr:port the host listens on
    kinds: list[str] = field(default_factory=list)    # each direct address's kind ("given" if none)

    def __post_init__(self):
        if not self.kinds:
            self.kinds = ["given"] * len(self.direct)
        if len(self.kinds) != len(self.direct) or any(k not in KIND_CODES for k in self.kinds):
            raise ValueError("every direct address needs one of the known kinds")

    @property
    def pipeline_id(self) -> str:
        return self.pipeline.hex()

    def psk(self) -> bytes:
        """The 32-byte Noise pre-shared key this invite's secret stands for."""
        return join_psk(self.secret, self.pipeline, self.invite_id)

    def check_fresh(self, now: float | None = None):
        if (now or time.time()) > self.expires:
            raise InviteError(f"this code expired at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(self.expires))}; "
                              "ask the host for a new one")


def join_psk(secret: bytes, pipeline: bytes, invite_id: bytes) -> bytes:
    return hmac.new(secret, b"potluck join v1" + pipeline + invite_id, hashlib.sha256).digest()


def rendezvous_key(psk: bytes) -> bytes:
    """The punch key of a join without a relay (engine/wire/punch.py): from the invite's psk."""
    return hmac.new(psk, b"potluck rendezvous", hashlib.sha256).digest()


def _b32encode(data: bytes) -> str:
    bits = int.from_bytes(data, "big")
    nbits = len(data) * 8
    pad = (-nbits) % 5
    bits <<= pad
    n = (nbits + pad) // 5
    return "".join(ALPHABET[(bits >> (5 * (n - 1 - i))) & 31] for i in range(n))


def _b32decode(text: str) -> bytes:
    value, n = 0, 0
    for pos, ch in enumerate(text):
        v = _DECODE.get(ch)
        if v is None:
            raise InviteError(f"this code has a typo: {ch!r} (character {pos + 1}) is never used in codes")
        value = (value << 5) | v
        n += 1
    nbytes = n * 5 // 8
    extra = n * 5 - nbytes * 8
    if value & ((1 << extra) - 1):
        raise InviteError("this code has a typo: it does not end where a code ends (a character missing or extra?)")
    return (value >> extra).to_bytes(nbytes, "big")


def _str(s: str, what: str) -> bytes:
    b = s.encode("ascii")
    if len(b) > 255:
        raise ValueError(f"{what} longer than 255 characters")
    return bytes([len(b)]) + b


def encode(inv: Invite) -> str:
    body = _FIXED.pack(VERSION, inv.pipeline, inv.invite_id, inv.secret, inv.host_key, inv.expires,
                       inv.max_uses)
    body += _str(inv.relay, "relay URL")
    if len(inv.direct) > 16:
        raise ValueError("at most 16 direct addresses")
    body += bytes([len(inv.direct)]) + b"".join(bytes([KIND_CODES.index(k)]) + _str(a, "address")
                                                for a, k in zip(inv.direct, inv.kinds))
    body += hashlib.sha256(body).digest()[:CHECKSUM]
    text = _b32encode(body)
    return "-".join(text[i:i + 5] for i in range(0, len(text), 5))


def parse(code: str) -> Invite:
    """The invite in `code`, or InviteError with a message for a person."""
    if not isinstance(code, str):
        raise InviteError("an invite code is text")
    if len(code) > MAX_CODE_CHARS:
        raise InviteError("this is not an invite code (far too long)")
    text = "".join(ch for ch in code.strip().upper() if ch not in "- \t\r\n")
    if not text:
        raise InviteError("the invite code is empty")
    if len(text) < _SHORTEST_INVITE // 2:
        # a word, a name, a short code without its relay: no code with a part missing
        raise InviteError(f"this is not an invite code (one is about {_SHORTEST_INVITE} characters in groups of "
                          "five, like 0AX1D-9RACJ-…)")
    data = _b32decode(text)
    if len(data) < _FIXED.size + 2 + CHECKSUM:
        raise InviteError("this code has a typo: it is too short (part of it missing?)")
    body, check = data[:-CHECKSUM], data[-CHECKSUM:]
    if not hmac.compare_digest(hashlib.sha256(body).digest()[:CHECKSUM], check):
        raise InviteError("this code has a typo (its checksum does not match): copy it again")
    version = body[0]
    if version == REPLY_VERSION:
        raise InviteError("this is a reply code, not an invite: the host pastes it (`potluck invites --reply`, "
                          "or the host dialog)")
    if version not in READS:
        raise InviteError(f"this code is for another version of Potluck (code version {version}, "
                          f"this one reads {', '.join(map(str, READS))})")
    try:
        _, pipeline, invite_id, secret, host_key, expires, max_uses = _FIXED.unpack_from(body)
        pos = _FIXED.size
        relay, pos = _read_str(body, pos)
        count = body[pos]
        pos += 1
        direct, kinds = [], []
        for _ in range(count):
            if version >= 2:
                if body[pos] >= len(KIND_CODES):
                    raise InviteError("this code is damaged (an address of an unknown kind)")
                kinds.append(KIND_CODES[body[pos]])
                pos += 1
            else:
                kinds.append("given")
            a, pos = _read_str(body, pos)
            direct.append(a)
        if pos != len(body):
            raise InviteError("this code has trailing bytes")
    except (IndexError, struct.error, UnicodeDecodeError):
        raise InviteError("this code is damaged (its fields do not fit)") from None
    if relay and (not relay.startswith(("ws://", "wss://")) or any(c.isspace() for c in relay)):
        raise InviteError(f"this code names an address that is not a ws:// URL: {relay!r}")
    _check_addresses(direct, kinds, ("ws://", "wss://"))
    if not relay and not direct:
        raise InviteError("this code names neither a relay nor an address to reach the host")
    return Invite(pipeline, invite_id, secret, host_key, expires, max_uses, relay, direct, kinds)


# ---- reply codes: a joiner's addresses, for the host to connect to -----------------------
#
# When no address in the invite reaches the host (its router maps nothing and there is no
# relay), the joiner listens itself, gathers its own candidates (its router may map) and
# shows a reply code for the host to paste: the same alphabet and checksum as an invite,
#
#     version u8 (REPLY_VERSION) | pipeline id 8 B | invite id 8 B
#     | addresses (u8 count, each: kind u8 | u8 length + ASCII) | checksum 4 B
#
# It carries no secret: the host only opens a connection to an address in it and says
# nothing until the joiner's Noise handshake (with the invite's secret) arrives on it.
REPLY_VERSION = 0x81


@dataclass
class Reply:
    pipeline: bytes
    invite_id: bytes
    direct: list[str]
    kinds: list[str]

    @property
    def key(self) -> str:
        """Names this reply in the host's record (the same code added twice is one)."""
        return hashlib.sha256(self.invite_id + "|".join(self.direct).encode()).hexdigest()[:16]


def encode_reply(r: Reply) -> str:
    if not 1 <= len(r.direct) <= 16:
        raise ValueError("a reply carries 1 to 16 addresses")
    body = bytes([REPLY_VERSION]) + r.pipeline + r.invite_id + bytes([len(r.direct)])
    body += b"".join(bytes([KIND_CODES.index(k)]) + _str(a, "address") for a, k in zip(r.direct, r.kinds))
    body += hashlib.sha256(body).digest()[:CHECKSUM]
    text = _b32encode(body)
    return "-".join(text[i:i + 5] for i in range(0, len(text), 5))


def parse_reply(code: str) -> Reply:
    """The reply in `code`, or InviteError with a message for a person."""
    if not isinstance(code, str) or len(code) > MAX_CODE_CHARS:
        raise InviteError("this is not a reply code")
    text = "".join(ch for ch in code.strip().upper() if ch not in "- \t\r\n")
    if not text:
        raise InviteError("the reply code is empty")
    if len(text) < _SHORTEST_REPLY // 2:
        raise InviteError(f"this is not a reply code (one is about {_SHORTEST_REPLY} characters in groups of five)")
    data = _b32decode(text)
    if len(data) < 18 + CHECKSUM:
        raise InviteError("this code has a typo: it is too short (part of it missing?)")
    body, check = data[:-CHECKSUM], data[-CHECKSUM:]
    if not hmac.compare_digest(hashlib.sha256(body).digest()[:CHECKSUM], check):
        raise InviteError("this code has a typo (its checksum does not match): copy it again")
    if body[0] != REPLY_VERSION:
        raise InviteError("this is an invite code, not a reply: the friend who was invited pastes it (Join "
                          "with invite code… in the app, or `potluck join`)" if body[0] in READS
                          else "this is not a reply code")
    try:
        pipeline, invite_id, count, pos = body[1:9], body[9:17], body[17], 18
        direct, kinds = [], []
        for _ in range(count):
            if body[pos] >= len(KIND_CODES):
                raise InviteError("this code is damaged (an address of an unknown kind)")
            kinds.append(KIND_CODES[body[pos]])
            a, pos = _read_str(body, pos + 1)
            direct.append(a)
        if pos != len(body) or not direct:
            raise InviteError("this code is damaged (its fields do not fit)")
    except (IndexError, UnicodeDecodeError):
        raise InviteError("this code is damaged (its fields do not fit)") from None
    _check_addresses(direct, kinds, ("ws://",))
    return Reply(pipeline, invite_id, direct, kinds)


def _check_addresses(direct: list[str], kinds: list[str], schemes: tuple[str, ...]):
    for url, kind in zip(direct, kinds):
        want = ("udp://",) if kind == "udp" else schemes
        if not url.startswith(want) or any(c.isspace() for c in url):
            raise InviteError(f"this code names an address that is not a {want[0]} URL: {url!r}")


def udp_addresses(direct: list[str], kinds: list[str]) -> list[tuple[str, int]]:
    """The hole-punching candidates among a code's addresses (kind "udp"), as (ip, port);
    anything that is not a literal IPv4 address and port is left out, never resolved."""
    from engine.wire.punch import parse_candidates

    out = []
    for url, kind in zip(direct, kinds):
        if kind != "udp":
            continue
        host, _, port = url[len("udp://"):].rpartition(":")
        try:
            out += parse_candidates([[host, int(port)]])
        except ValueError:
            continue
    return out


def _read_str(b: bytes, pos: int) -> tuple[str, int]:
    n = b[pos]
    s = b[pos + 1: pos + 1 + n]
    if len(s) != n:
        raise IndexError
    return s.decode("ascii"), pos + 1 + n


# ---- the host's record ------------------------------------------------------------
class HostState:
    """`host.json`: {"pipeline", "invites": {id: {...}}, "members": {pubkey hex: {...}}}."""

    FILE = "host.json"

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / self.FILE
        self.lock_path = Path(folder) / (self.FILE + ".lock")
        with self._locked() as data:
            if "pipeline" not in data:
                data.update(pipeline=secrets.token_hex(8), invites={}, members={})

    @contextlib.contextmanager
    def _locked(self):
        """Read-modify-write under an exclusive lock; yields the dict to change."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _lock(fd)
            data = self._read()
            before = json.dumps(data, sort_keys=True)
            yield data
            if json.dumps(data, sort_keys=True) != before:
                tmp = self.path.with_suffix(".tmp")
                wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(wfd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
        finally:
            _unlock(fd)
            os.close(fd)

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def data(self) -> dict:
        return self._read()

    @property
    def pipeline(self) -> bytes:
        return bytes.fromhex(self._read()["pipeline"])

    def set_routes(self, relay: str, direct: list[str], kinds: list[str] | None = None):
        """Remember how friends reach this host (for `potluck invites --new`)."""
        with self._locked() as data:
            data["routes"] = {"relay": relay, "direct": list(direct), "kinds": list(kinds or [])}

    def create_invite(self, host_key: bytes, relay: str = "", direct: list[str] | None = None,
                      ttl_s: float = 24 * 3600, max_uses: int = 1,
                      kinds: list[str] | None = None) -> tuple[Invite, str]:
        if not 1 <= max_uses <= 65535:
            raise ValueError("uses must be 1..65535")
        inv = Invite(self.pipeline, secrets.token_bytes(8), secrets.token_bytes(16), host_key,
                     int(time.time() + ttl_s), max_uses, relay, list(direct or []), list(kinds or []))
        code = encode(inv)
        with self._locked() as data:
            data["invites"][inv.invite_id.hex()] = {
                "secret": inv.secret.hex(), "expires": inv.expires, "max_uses": max_uses, "uses": 0,
                "created": int(time.time()), "revoked": False, "code": code}
        return inv, code

    def add_reply(self, code: str) -> Reply:
        """Take a joiner's reply code (InviteError: not one, or not for an invite of ours);
        a running host dials its addresses (TunnelHost watches this record)."""
        r = parse_reply(code)
        if r.pipeline != self.pipeline:
            raise InviteError("this reply answers an invite from another host, or from an earlier time you "
                              "hosted: send your friend a new invite")
        self.invite_psk(r.invite_id)          # an invite of ours, still usable: else why not
        with self._locked() as data:
            data.setdefault("replies", {})[r.key] = {"code": code.strip(), "added": int(time.time())}
        return r

    def replies(self) -> list[Reply]:
        """The replies to dial: those to invites that are still ours, not revoked, not expired."""
        data = self._read()
        invites, now = data.get("invites") or {}, time.time()
        out = []
        for rec in (data.get("replies") or {}).values():
            try:
                r = parse_reply(rec["code"])
            except (InviteError, KeyError, TypeError):
                continue
            inv = invites.get(r.invite_id.hex())
            if inv is not None and not inv.get("revoked") and now <= inv.get("expires", 0):
                out.append(r)
        return out

    def rendezvous_key(self, invite_id: bytes) -> bytes:
        """What a joiner's and this host's punch packets prove for an invite of ours (its
        secret: only the two of them know it), even once the invite is used up: a member
        that comes back through a reply code punches with it too."""
        rec = self._read().get("invites", {}).get(invite_id.hex())
        if rec is None or rec["revoked"] or time.time() > rec["expires"]:
            raise InviteError("no such invite (revoked, expired or unknown)")
        return rendezvous_key(join_psk(bytes.fromhex(rec["secret"]), self.pipeline, invite_id))

    def invite_psk(self, invite_id: bytes, used_up_ok: bool = False) -> bytes:
        """The psk for a join with this invite, or InviteError saying why it is refused.
        used_up_ok: a used-up invite still gives its psk (a member joining with the code
        again, its node started afresh: the host admits it once it knows the key)."""
        rec = self._read().get("invites", {}).get(invite_id.hex())
        if rec is None:
            raise InviteError("unknown invite (not issued by this host, or deleted)")
        if rec["revoked"]:
            raise InviteError("this invite was revoked by the host")
        if time.time() > rec["expires"]:
            raise InviteError("this invite has expired")
        if rec["uses"] >= rec["max_uses"] and not used_up_ok:
            raise InviteError(f"this invite is used up ({counted(rec['max_uses'], 'use')})")
        return join_psk(bytes.fromhex(rec["secret"]), self.pipeline, invite_id)

    def record_join(self, invite_id: bytes, node_key: bytes, name: str) -> None:
        """Counts one use (re-checked under the lock) and allowlists the key."""
        from engine.wire.identity import node_id

        with self._locked() as data:
            rec = data["invites"].get(invite_id.hex())
            known = data["members"].get(node_key.hex())
            if rec is not None and known is not None and known.get("invite") == invite_id.hex() \
                    and not known["revoked"] and not rec["revoked"]:
                # a member joining with its code again (its node lost what it knew): the
                # same machine, not one more use
                known["name"] = name[:64] or known["name"]
                return
            if rec is None or rec["revoked"] or rec["uses"] >= rec["max_uses"] or time.time() > rec["expires"]:
                if known is not None and known["revoked"]:
                    # a revoked member with its old code: told so, not that the code is used up
                    raise InviteError("this node's key was revoked by the host")
                if rec is not None and rec["uses"] >= rec["max_uses"]:
                    raise InviteError(f"this invite is used up ({counted(rec['max_uses'], 'use')})")
                raise InviteError("this invite is no longer valid")
            rec["uses"] += 1
            data["members"][node_key.hex()] = {"node_id": node_id(node_key), "name": name[:64],
                                               "invite": invite_id.hex(), "joined": int(time.time()),
                                               "revoked": False}

    def check_member(self, node_key: bytes) -> dict:
        rec = self._read().get("members", {}).get(node_key.hex())
        if rec is None:
            raise InviteError("unknown node key: join with an invite code first")
        if rec["revoked"]:
            raise InviteError("this node's key was revoked by the host")
        return rec

    def revoke(self, what: str) -> str:
        """Revoke an invite (by id) or a member (by node id or key). Returns what was revoked."""
        what = what.strip().lower()
        with self._locked() as data:
            if what in data["invites"]:
                data["invites"][what]["revoked"] = True
                return f"invite {what}"
            for key, rec in data["members"].items():
                if what in (key, rec["node_id"]):
                    rec["revoked"] = True
                    return f"member {rec['node_id']} ({rec['name']})"
        raise KeyError(f"no invite or member {what!r}")


# One writer at a time across processes (the node and a `potluck invite` in a terminal).
if os.name == "nt":
    import msvcrt

    def _lock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)  # msvcrt locks bytes from the file position on
        while True:
            try:  # LK_LOCK itself gives up after ten one-second tries: keep waiting
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                return
            except OSError:
                continue

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
