"""Every WebSocket server of ours refuses a browser's handshake.

A web page the user visits may open a WebSocket to any address, this machine's loopback
included, and a browser always sends an Origin header with it; our own clients never do.
A stage on loopback with no secret (`potluck stage` as a person starts it there) is driven
by whoever says hello, so without this a page could have had it load a model or shut
down, and reached the tunnels' and doors' handshakes too. websockets answers 403 to an Origin not in `origins`; None alone admits only
clients that send none.
"""

from __future__ import annotations

from websockets.asyncio.server import serve as _serve

NO_BROWSERS = [None]


def serve(handler, host, port, **options):
    """websockets' serve, refusing any handshake that carries an Origin header."""
    return _serve(handler, host, port, origins=NO_BROWSERS, **options)
