"""How long the owner has left keyboard and mouse alone, for "share only while I am away".

Read in the GUI process (it runs in the owner's desktop session; the node may not)
and reported to the node (`POST /activity`), whose sharing policy decides. None means
"cannot tell" -- a Wayland session, no display, a platform we do not read -- and the
policy then treats the owner as present: being polite beats guessing.

  * Windows: GetLastInputInfo (user32), milliseconds since the last input event.
  * Linux/X11: the MIT-SCREEN-SAVER extension (libXss), the X server's idle time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys


def owner_idle_seconds() -> float | None:
    try:
        if sys.platform == "win32":
            return _windows()
        if sys.platform.startswith("linux") and os.environ.get("DISPLAY"):
            return _x11()
    except Exception:  # a missing library or symbol: we cannot tell
        return None
    return None


def _windows() -> float | None:
    class LASTINPUTINFO(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LASTINPUTINFO()
    info.cbSize = ctypes.sizeof(info)
    if not ctypes.windll.user32.GetLastInputInfo(ctypes.byref(info)):  # type: ignore[attr-defined]
        return None
    now = ctypes.windll.kernel32.GetTickCount() & 0xFFFFFFFF  # type: ignore[attr-defined]
    return ((now - info.dwTime) & 0xFFFFFFFF) / 1000.0


class _XScreenSaverInfo(ctypes.Structure):
    _fields_ = [("window", ctypes.c_ulong), ("state", ctypes.c_int), ("kind", ctypes.c_int),
                ("til_or_since", ctypes.c_ulong), ("idle", ctypes.c_ulong), ("eventMask", ctypes.c_ulong)]


def _x11() -> float | None:
    xlib_name, xss_name = ctypes.util.find_library("X11"), ctypes.util.find_library("Xss")
    if not xlib_name or not xss_name:
        return None
    xlib, xss = ctypes.cdll.LoadLibrary(xlib_name), ctypes.cdll.LoadLibrary(xss_name)
    xlib.XOpenDisplay.restype = ctypes.c_void_p
    xlib.XOpenDisplay.argtypes = [ctypes.c_char_p]
    xlib.XDefaultRootWindow.restype = ctypes.c_ulong
    xlib.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
    xlib.XCloseDisplay.argtypes = [ctypes.c_void_p]
    xlib.XFree.argtypes = [ctypes.c_void_p]
    xss.XScreenSaverQueryExtension.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                               ctypes.POINTER(ctypes.c_int)]
    xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XScreenSaverInfo)
    xss.XScreenSaverQueryInfo.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(_XScreenSaverInfo)]
    display = xlib.XOpenDisplay(None)
    if not display:
        return None
    try:
        event_base, error_base = ctypes.c_int(), ctypes.c_int()
        if not xss.XScreenSaverQueryExtension(display, ctypes.byref(event_base), ctypes.byref(error_base)):
            return None
        info = xss.XScreenSaverAllocInfo()
        try:
            if not xss.XScreenSaverQueryInfo(display, xlib.XDefaultRootWindow(display), info):
                return None
            return info.contents.idle / 1000.0
        finally:
            xlib.XFree(info)
    finally:
        xlib.XCloseDisplay(display)
