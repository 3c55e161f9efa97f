"""Volumes in pieces, sans-I/O: cutting an encoded frame into chunk frames and putting
it back together on the other side.

A *volume* is one encoded activation frame (frames.py). The link scheduler decides how
much of which volume goes next; each piece travels as a CHUNK frame carrying the
volume id, its offset and the volume's total length. The receiver accepts pieces only
in order (one TCP stream per link keeps them so), so a duplicate, a gap, a piece out of
order, a total that changes or pieces that overrun it are protocol errors, and so is a
peer that opens more volumes, or buffers more bytes, than the limits allow.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from engine.wire.frames import HEADER, MAGIC, VERSION, FrameError, FrameType

MAX_OPEN_VOLUMES = 64
DEFAULT_MAX_VOLUME = 1 << 30
DEFAULT_MAX_BUFFERED = 2 << 30


def encode_chunk(volume_id: int, kind: str, offset: int, total: int, piece: bytes | memoryview) -> bytes:
    """A CHUNK frame: the piece rides as a flat int8 tensor after a tiny JSON meta."""
    meta = json.dumps({"off": offset, "total": total, "kind": kind}, separators=(",", ":")).encode()
    head = HEADER.pack(MAGIC, VERSION, int(FrameType.CHUNK), 0, volume_id, 0, len(meta), 5, 1, 0)
    return b"".join([head, struct.pack("<I", len(piece)), meta, piece])


@dataclass
class _Open:
    kind: str
    total: int
    parts: list
    received: int = 0


class Reassembler:
    def __init__(self, max_volume: int = DEFAULT_MAX_VOLUME, max_open: int = MAX_OPEN_VOLUMES,
                 max_buffered: int = DEFAULT_MAX_BUFFERED):
        self.max_volume = max_volume
        self.max_open = max_open
        self.max_buffered = max_buffered
        self._open: dict[int, _Open] = {}
        self.buffered = 0

    def feed(self, volume_id: int, meta: dict, piece: bytes | memoryview) -> tuple[str, bytes | memoryview] | None:
        """Add one piece; returns (kind, volume bytes) when the volume is complete. A
        volume in one piece (a decode step's, usually) comes back as the piece itself,
        uncopied."""
        off, total, kind = meta["off"], meta["total"], meta["kind"]
        if not (0 < total <= self.max_volume):
            raise FrameError(f"volume {volume_id}: total {total} outside 1..{self.max_volume}")
        v = self._open.get(volume_id)
        if v is None:
            if off != 0:
                raise FrameError(f"volume {volume_id}: first piece at offset {off} (missing pieces)")
            if len(self._open) >= self.max_open:
                raise FrameError(f"more than {self.max_open} volumes in progress")
            if len(piece) == total:   # the whole volume at once: nothing to put together
                return kind, piece
            v = self._open[volume_id] = _Open(kind, total, [])
        else:
            if total != v.total or kind != v.kind:
                raise FrameError(f"volume {volume_id}: total or kind changed mid-volume")
            if off != v.received:
                what = "duplicated" if off < v.received else "missing"
                raise FrameError(f"volume {volume_id}: piece at {off}, expected {v.received} ({what} piece)")
        if off + len(piece) > total:
            raise FrameError(f"volume {volume_id}: pieces overrun the total of {total} bytes")
        if self.buffered + len(piece) > self.max_buffered:
            raise FrameError("too many bytes buffered in unfinished volumes")
        v.parts.append(bytes(piece))
        v.received += len(piece)
        self.buffered += len(piece)
        if v.received < total:
            return None
        del self._open[volume_id]
        self.buffered -= total
        return v.kind, b"".join(v.parts)

    @property
    def open_volumes(self) -> int:
        return len(self._open)

