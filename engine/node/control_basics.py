"""Small pieces the node's modules share: NodeError (a control API answer with its HTTP
status), this computer's LAN address, the file that holds the control API's token, and
whether a port can be listened on (the command line asks before anything loads).
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
    """Where a node started by hand writes its token: POTLUCK_HOME/run when set (the app's
    runtime folder, app/paths.py), else the user's runtime folder."""
    if os.environ.get("POTLUCK_HOME"):
        return Path(os.environ["POTLUCK_HOME"]) / "run" / "node-token"
    try:
        import warnings

        from platformdirs import user_runtime_dir

        with warnings.catch_warnings():   # no XDG_RUNTIME_DIR (a bare shell): its /tmp fallback is fine
            warnings.simplefilter("ignore")
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


def port_taken(host: str, port: int, flag: str) -> str | None:
    """Why `host:port` cannot be listened on, said before the model loads (a bind that
    fails after a load of minutes loses them), or None. Someone may still take the port
    before we bind, and then the bind's own error is said: hold_port keeps it instead."""
    held, why = hold_port(host, port, flag)
    for s in held:
        s.close()
    return why


def hold_port(host: str, port: int, flag: str) -> tuple[list, str | None]:
    """The listening sockets for `host:port`, bound now, before the model loads, for the
    API to serve on once it has (serve_api's `socks`), or why it cannot be listened on.
    Checked and let go, the port was free for a second potluck started a moment later:
    both loaded the model, and the second failed at its bind in the socket library's words.
    Every address the host names is bound as asyncio's create_server binds them
    (SO_REUSEADDR off Windows, so a port in TIME_WAIT is free; IPv6 sockets IPv6-only).
    Listening: a bound socket alone does not keep another from binding the port (both
    SO_REUSEADDR); a client that connects meanwhile waits for the API. Port 0 (a free
    one, the system's pick per address) holds nothing."""
    import errno
    import socket

    if not port:
        return [], None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return [], f"cannot listen on {host!r}: {exc}"
    held = []
    for family, kind, proto, _, addr in dict.fromkeys(infos):
        try:
            s = socket.socket(family, kind, proto)
        except OSError:
            continue    # an address family this machine has off (IPv6): the server skips it too
        try:
            if os.name != "nt":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(128)
            s.setblocking(False)
        except OSError as exc:
            s.close()
            for other in held:
                other.close()
            if exc.errno in (errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", -1)):
                return [], (f"port {port} is already in use on {host or 'every address'} (another potluck, or "
                            f"another program): stop it, or give {flag} with another number")
            return [], f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        held.append(s)
    return held, None
