"""This machine's long-term node key, and where Potluck keeps its files.

    from engine.wire.identity import load_or_create_identity
    me = load_or_create_identity()          # or (config_dir) for another folder
    me.public, me.node_id, me.store         # 32-byte X25519 key, short id, "keyring" | "file"

The private key (X25519, the static key of the Noise handshake in engine/wire/noise.py)
lives in the OS keyring (service "potluck", one entry per config folder) when a
keyring backend exists, else in `<config_dir>/node_key` with mode 0600 (headless
Linux has no keyring). POTLUCK_KEYSTORE=file forces the file (tests use it so they
never touch a person's keyring). POTLUCK_HOME overrides the config folder.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

KEYRING_SERVICE = "potluck"
KEY_FILE = "node_key"


def config_dir(path: str | os.PathLike | None = None) -> Path:
    """The config folder (created 0700): `path`, $POTLUCK_HOME, or the OS's (default_dir)."""
    if path is None:
        path = os.environ.get("POTLUCK_HOME") or default_dir()
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    return p


def default_dir(windows: bool = os.name == "nt", env=os.environ, home: Path | None = None) -> Path:
    """~/.config/potluck; on Windows %LOCALAPPDATA%\\potluck, beside the app's settings and
    what its uninstaller removes (the hosting keys and invites sat in %USERPROFILE%\\.config,
    left behind). A Windows computer whose Potluck kept them there keeps that folder: its
    invites and members are in it."""
    home = home or Path.home()
    if windows and env.get("LOCALAPPDATA"):
        old = home / ".config" / "potluck"
        if old.is_dir() and any(old.iterdir()):
            return old
        return Path(env["LOCALAPPDATA"]) / "potluck"
    return Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "potluck"


def node_id(public: bytes) -> str:
    """A short, readable name for a node key (first 50 bits of its SHA-256, base32)."""
    return base64.b32encode(hashlib.sha256(public).digest()[:10]).decode().lower()[:10]


@dataclass(frozen=True)
class Identity:
    private: X25519PrivateKey
    public: bytes
    store: str                  # "keyring" or "file"

    @property
    def node_id(self) -> str:
        return node_id(self.public)


def _raw(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def _identity(raw: bytes, store: str) -> Identity:
    key = X25519PrivateKey.from_private_bytes(raw)
    from engine.wire.noise import public_bytes

    return Identity(key, public_bytes(key), store)


def _keyring():
    """The keyring module when a real backend exists, else None."""
    if os.environ.get("POTLUCK_KEYSTORE", "").lower() == "file":
        return None
    try:
        import keyring
        from keyring.backends import fail

        backend = keyring.get_keyring()
        if isinstance(backend, fail.Keyring) or (getattr(backend, "priority", 1) or 0) <= 0:
            return None
        return keyring
    except Exception:   # noqa: BLE001  (no backend, no D-Bus, a locked store...)
        return None


def _read_file(path: Path) -> bytes | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    raw = bytes.fromhex(text)
    if len(raw) != 32:
        raise ValueError(f"{path} does not hold a 32-byte key")
    return raw


def _write_file(path: Path, raw: bytes):
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(raw.hex() + "\n")
    os.replace(tmp, path)


def load_or_create_identity(config: str | os.PathLike | None = None) -> Identity:
    folder = config_dir(config)
    path = folder / KEY_FILE
    kr = _keyring()
    if kr is not None:
        account = f"node-key:{folder.resolve()}"
        try:
            stored = kr.get_password(KEYRING_SERVICE, account)
            if stored:
                return _identity(bytes.fromhex(stored), "keyring")
            raw = _read_file(path) or _raw(X25519PrivateKey.generate())
            kr.set_password(KEYRING_SERVICE, account, raw.hex())
            if path.exists():
                path.unlink()       # moved into the keyring
            return _identity(raw, "keyring")
        except Exception:   # noqa: BLE001  a keyring that fails at use: fall back to the file
            pass
    raw = _read_file(path)
    if raw is None:
        raw = _raw(X25519PrivateKey.generate())
        _write_file(path, raw)
    else:
        os.chmod(path, 0o600)
    return _identity(raw, "file")


SHARE_SECRET_FILE = "share_secret"


def share_secret(path: str | os.PathLike | None = None) -> str:
    """The secret a head proves to drive this machine's plain (LAN) share: made once and
    kept in the config folder (0600), so the address a friend was given keeps working
    across restarts. Delete the file to make a new one (and re-send the address)."""
    from engine.wire.stage_auth import SECRET_ALPHABET, SECRET_CHARS, new_secret

    f = config_dir(path) / SHARE_SECRET_FILE
    try:
        s = f.read_text().strip()
        if len(s) == SECRET_CHARS and set(s) <= set(SECRET_ALPHABET):
            return s
    except OSError:
        pass
    s = new_secret()
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(s + "\n")
    return s
