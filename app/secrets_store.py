"""Secrets (a Hugging Face token for gated models) in the OS keyring, or a 0600 file.

Headless Linux has no keyring backend; there the secret goes to
`<config_dir>/secrets.json` with mode 0600. POTLUCK_KEYSTORE=file forces the file,
as engine/wire/identity.py does for the node key (tests never touch a person's keyring).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from . import paths

SERVICE = "potluck"
FILE = "secrets.json"


def _keyring():
    if os.environ.get("POTLUCK_KEYSTORE") == "file":
        return None
    try:
        import keyring
        from keyring.backends import fail

        if isinstance(keyring.get_keyring(), fail.Keyring):
            return None
        return keyring
    except Exception:
        return None


def _file(folder: Path | None) -> Path:
    return (folder or paths.config_dir()) / FILE


def _read_file(folder) -> dict:
    try:
        data = json.loads(_file(folder).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_file(folder, data: dict):
    path = _file(folder)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump(data, f)
    os.replace(tmp, path)


def get_secret(name: str, folder: Path | None = None) -> str | None:
    kr = _keyring()
    if kr is not None:
        try:
            v = kr.get_password(SERVICE, name)
            if v is not None:
                return v
        except Exception:
            pass
    v = _read_file(folder).get(name)
    return v if isinstance(v, str) else None


def set_secret(name: str, value: str | None, folder: Path | None = None) -> str:
    """Store (or with None, delete) a secret; returns where: "keyring" or "file"."""
    kr = _keyring()
    if kr is not None:
        try:
            if value is None:
                try:
                    kr.delete_password(SERVICE, name)
                except Exception:
                    pass
            else:
                kr.set_password(SERVICE, name, value)
            data = _read_file(folder)
            if name in data:  # moved into the keyring
                data.pop(name)
                _write_file(folder, data)
            return "keyring"
        except Exception:
            pass
    data = _read_file(folder)
    if value is None:
        data.pop(name, None)
    else:
        data[name] = value
    _write_file(folder, data)
    return "file"
