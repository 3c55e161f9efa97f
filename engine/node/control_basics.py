"""Small pieces the node's modules share: NodeError (a control API answer with its HTTP
status), this computer's LAN address, and the file that holds the control API's token.
"""

from __future__ import annotations

import os
from pathlib import Path


class NodeError(Exception):
    """message: what a person reads; details: the engine's own account, for a bug report."""

    def __init__(self, message: str, status: int = 400, details: str | None = None):
        super().__init__(message)
        self.message, self.status, self.details = message, status, details


def lan_address() -> str:
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outbound interface
            return s.getsockname()[0]
    except OSError:
        pass
    # no default route (a LAN without internet): the first interface that is not loopback
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return "127.0.0.1"


def default_token_file() -> Path:
    try:
        from platformdirs import user_runtime_dir

        base = Path(user_runtime_dir("potluck"))
    except Exception:
        base = Path.home() / ".cache" / "potluck"
    return base / "node-token"


def write_token_file(path: Path, token: str):
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)
