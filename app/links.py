"""potluck:// links in the app: read by engine/core/join_link.py (the command line takes
them too), and drawn as a QR code for a friend's phone."""

from __future__ import annotations

from engine.core.join_link import MAX_LINK_CHARS, SCHEME, JoinLink, LinkError, is_link, join_link, parse_link  # noqa: F401


def qr_png(text: str, scale: int = 4) -> bytes:
    """A QR code of text as PNG bytes (for a friend's phone camera)."""
    import io

    import segno

    buf = io.BytesIO()
    segno.make(text, error="m").save(buf, kind="png", scale=scale, border=2)
    return buf.getvalue()
