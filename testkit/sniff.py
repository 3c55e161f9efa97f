"""A network observer: every packet seen on one interface, appended raw to a file.

    python -m testkit.sniff IFACE OUT        (as root, inside the namespace to watch)

What someone on the LAN (or the public side) would capture. Prints "sniffing" once the
socket is bound, and stops on SIGTERM with what it captured flushed. Linux only
(AF_PACKET), for tests in network namespaces.
"""

from __future__ import annotations

import signal
import socket
import sys

ETH_P_ALL = 0x0003


def main(iface: str, out: str) -> int:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
    sock.bind((iface, 0))
    sock.settimeout(0.2)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print("sniffing", flush=True)
    with open(out, "wb") as f:
        while not stop:
            try:
                f.write(sock.recv(1 << 16))
            except socket.timeout:
                f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
