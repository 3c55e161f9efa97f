"""potluck:// links in the app: what an invite link holds is engine/boot/join_link.py's
(the CLI's `join` reads the same links); here, the QR code a friend's phone reads."""

from __future__ import annotations

from engine.boot.join_link import MAX_LINK_CHARS, SCHEME, JoinLink, LinkError, is_link, join_link, parse_link

__all__ = ["MAX_LINK_CHARS", "SCHEME", "JoinLink", "LinkError", "is_link", "join_link", "parse_link", "qr_png"]


def qr_png(text: str, scale: int = 4) -> bytes:
    """A QR code of text as PNG bytes (for a friend's phone camera)."""
    import io

    import segno

    buf = io.BytesIO()
    segno.make(text, error="m").save(buf, kind="png", scale=scale, border=2)
    return buf.getvalue()
