"""assets/potluck.svg → a Windows .ico (16–256 px), for the launchers, shortcuts and the
uninstaller entry. Qt renders the SVG (the same renderer the tray uses); the .ico holds
PNG images, which every Windows since Vista reads.

    python installer/windows/make_ico.py <svg> <ico>
"""

from __future__ import annotations

import os
import struct
import sys

SIZES = (16, 24, 32, 48, 64, 128, 256)


def png(svg: str, size: int) -> bytes:
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    img = QImage(size, size, QImage.Format.Format_ARGB32)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    QSvgRenderer(svg).render(p)
    p.end()
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    img.save(buf, "PNG")
    return bytes(data.data())


def ico(images: dict[int, bytes]) -> bytes:
    head = struct.pack("<HHH", 0, 1, len(images))
    offset = len(head) + 16 * len(images)
    entries, blobs = b"", b""
    for size, blob in images.items():
        dim = 0 if size >= 256 else size          # 0 means 256 in an ICONDIRENTRY
        entries += struct.pack("<BBBBHHII", dim, dim, 0, 0, 1, 32, len(blob), offset + len(blobs))
        blobs += blob
    return head + entries + blobs


if __name__ == "__main__":
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication([])
    with open(sys.argv[2], "wb") as f:
        f.write(ico({s: png(sys.argv[1], s) for s in SIZES}))
