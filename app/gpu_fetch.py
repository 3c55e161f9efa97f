"""The network and disk half of installing the CUDA build (app/gpu_enable.py drives it):
simple-index pages, PEP 658 metadata, resumable downloads checked against the index's
sha256, and unpacking a wheel without letting it write outside its folder.

urllib in the caller's thread: the app runs the whole install in a worker thread and
the CLI in its own, so blocking calls with timeouts are the simplest thing that works,
and they honour the system's proxy settings. Cancelling is checked between reads.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import stat
import threading
import urllib.error
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable
from urllib.parse import urlparse

from .gpu_index import Link, parse_simple_page

TIMEOUT_S = 60              # per socket operation, not per download
CHUNK = 256 * 1024
MAX_PAGE = 64 * 2**20       # torch's page on the PyTorch index lists every build ever made
MAX_METADATA = 4 * 2**20
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class GpuEnableError(Exception):
    """Enabling the GPU failed; the message is meant for people."""


class Cancelled(GpuEnableError):
    def __init__(self):
        super().__init__("cancelled; what was downloaded is kept, so the next try resumes")


class Interrupted(GpuEnableError):
    """The connection dropped mid-file: a later request can resume (HTTP Range)."""


def check_url(url: str) -> str:
    """The hashes that vouch for every download come from the index page, so that page
    (and everything else) must come over TLS; plain http only on loopback (tests, a
    local mirror on this computer)."""
    u = urlparse(url)
    if u.scheme == "https" or (u.scheme == "http" and (u.hostname or "") in LOOPBACK):
        return url
    raise GpuEnableError(f"refusing {url}: package indexes must be https:// (http:// only on this computer)")


def open_url(url: str, headers: dict | None = None, method: str = "GET"):
    req = urllib.request.Request(check_url(url), method=method,
                                 headers={"User-Agent": "potluck-gpu-enable", **(headers or {})})
    return urllib.request.urlopen(req, timeout=TIMEOUT_S)


class IndexClient:
    """Project pages from a list of simple indexes: the first index that lists a project
    supplies all of it (a later index cannot slip in a same-named package)."""

    def __init__(self, indexes: list[str]):
        self.indexes = [check_url(i.rstrip("/")) for i in indexes]
        self._pages: dict[str, list[Link]] = {}

    def links(self, name: str) -> list[Link]:
        if name in self._pages:
            return self._pages[name]
        found: list[Link] = []
        for base in self.indexes:
            url = f"{base}/{name}/"
            try:
                with open_url(url, {"Accept": "text/html"}) as resp:
                    body = resp.read(MAX_PAGE + 1)
                    where = resp.geturl()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    continue
                raise GpuEnableError(f"the package index {base} answered {e.code} {e.reason} for {name}") from None
            except (urllib.error.URLError, OSError) as e:
                raise GpuEnableError(f"could not reach the package index {base}: {getattr(e, 'reason', e)}") from None
            if len(body) > MAX_PAGE:
                raise GpuEnableError(f"the package index's page for {name} is too large")
            found = parse_simple_page(body.decode("utf-8", "replace"), where)
            if found:
                break
        self._pages[name] = found
        return found

    def metadata(self, link: Link) -> str:
        """The wheel's METADATA from the index (PEP 658), checked against its hash."""
        try:
            with open_url(link.metadata_url) as resp:
                data = resp.read(MAX_METADATA + 1)
        except (urllib.error.URLError, OSError) as e:
            raise GpuEnableError(f"could not read the metadata of {link.filename}: {getattr(e, 'reason', e)}") from None
        if len(data) > MAX_METADATA:
            raise GpuEnableError(f"the metadata of {link.filename} is too large")
        if link.metadata and hashlib.sha256(data).hexdigest() != link.metadata:
            raise GpuEnableError(f"the metadata of {link.filename} does not match the index's hash")
        return data.decode("utf-8", "replace")

    @staticmethod
    def size(link: Link) -> int | None:
        try:
            with open_url(link.url, method="HEAD") as resp:
                n = resp.headers.get("Content-Length")
                return int(n) if n is not None else None
        except (urllib.error.URLError, OSError, ValueError):
            return None


def wheel_metadata(path: Path) -> str:
    """METADATA from a downloaded wheel (indexes that do not serve it separately)."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist()
                 if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise GpuEnableError(f"{path.name} is not a wheel (no single .dist-info/METADATA)")
        info = z.getinfo(names[0])
        if info.file_size > MAX_METADATA:
            raise GpuEnableError(f"the metadata in {path.name} is too large")
        return z.read(info).decode("utf-8", "replace")


# ---- downloads ---------------------------------------------------------------------------

class Meter:
    """Bytes on disk across every file of the install, reported at most once per MiB (a
    2.5 GB download in 256 KiB reads would otherwise be ten thousand GUI updates)."""

    def __init__(self, total: int, report: Callable[[str, int, int], None], step: int = 2**20):
        self.total, self.done, self.report, self.step = total, 0, report, step
        self.fetched = 0          # bytes that came over the network in this run
        self._last = -step

    def add(self, n: int, fetched: bool = False):
        self.done += n
        if fetched:
            self.fetched += n
        if abs(self.done - self._last) >= self.step or (self.total and self.done >= self.total):
            self.flush()

    def flush(self):
        self._last = self.done
        self.report("download", self.done, max(self.total, self.done))


def _plain_name(filename: str) -> str:
    if not filename or filename != os.path.basename(filename) or filename in (".", "..") or "\\" in filename:
        raise GpuEnableError(f"refusing a download named {filename!r}")
    return filename


def _sha256_of(path: Path, cancel: threading.Event) -> "hashlib._Hash":
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 * CHUNK):
            if cancel.is_set():
                raise Cancelled()
            h.update(block)
    return h


def download(link: Link, folder: Path, meter: Meter, cancel: threading.Event, attempts: int = 3) -> Path:
    """The wheel in folder, checked against the index's sha256. `<file>.part` holds a
    partial download; a later call (this run's retry, or the next run) resumes it with
    HTTP Range. Only a file whose hash matched gets its final name."""
    final = folder / _plain_name(link.filename)
    if final.is_file():
        meter.add(final.stat().st_size)
        return final
    folder.mkdir(parents=True, exist_ok=True)
    part = final.with_name(final.name + ".part")
    counted = 0                    # of part's bytes, how many the meter has
    last: Exception | None = None
    for _ in range(max(1, attempts)):
        try:
            return _download_once(link, part, final, meter, cancel, counted)
        except Interrupted as e:
            last = e
            counted = part.stat().st_size if part.exists() else 0
    have = part.stat().st_size if part.exists() else 0
    raise GpuEnableError(f"the download of {link.filename} broke off after {have:,} bytes ({last}); "
                         "what arrived is kept, so trying again resumes from there")


def _content_range_start(value: str | None) -> tuple[int, int | None] | None:
    """'bytes 100-199/200' -> (100, 200)."""
    try:
        unit, rest = (value or "").split(" ", 1)
        span, total = rest.split("/", 1)
        return (int(span.split("-", 1)[0]), None if total.strip() == "*" else int(total)) if unit == "bytes" else None
    except ValueError:
        return None


def _download_once(link: Link, part: Path, final: Path, meter: Meter, cancel: threading.Event,
                   counted: int) -> Path:
    have = part.stat().st_size if part.exists() else 0
    h = _sha256_of(part, cancel) if have else hashlib.sha256()
    meter.add(have - counted)
    counted = have
    try:
        resp = open_url(link.url, {"Range": f"bytes={have}-"} if have else None)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:      # nothing left to send: the part may be whole already
            if h.hexdigest() == link.sha256:
                os.replace(part, final)
                return final
            part.unlink()
            meter.add(-counted)
            raise Interrupted("the server could not resume it") from None
        raise GpuEnableError(f"downloading {link.filename}: the server answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        raise Interrupted(str(getattr(e, "reason", e))) from None
    with resp:
        total = None
        if have and resp.status == 206:
            start = _content_range_start(resp.headers.get("Content-Range"))
            if start is None or start[0] != have:
                part.unlink()
                meter.add(-counted)
                raise Interrupted("the server resumed from the wrong place")
            total = start[1]
            mode = "ab"
        else:                           # 200: the server ignored Range, so start over
            meter.add(-counted)
            have, h, mode = 0, hashlib.sha256(), "wb"
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        with open(part, mode) as f:
            while True:
                if cancel.is_set():
                    raise Cancelled()
                try:
                    chunk = resp.read(CHUNK)
                except http.client.IncompleteRead as e:
                    f.write(e.partial)
                    h.update(e.partial)
                    meter.add(len(e.partial), fetched=True)
                    raise Interrupted(f"the connection closed after {have + len(e.partial):,} bytes") from None
                except (OSError, http.client.HTTPException) as e:
                    raise Interrupted(str(e) or type(e).__name__) from None
                if not chunk:
                    break
                f.write(chunk)
                h.update(chunk)
                have += len(chunk)
                meter.add(len(chunk), fetched=True)
    if total is not None and have < total:
        raise Interrupted(f"the connection closed after {have:,} of {total:,} bytes")
    if h.hexdigest() != link.sha256:
        part.unlink()
        meter.add(-have)
        raise GpuEnableError(f"{link.filename} did not match the sha256 the package index lists (a broken or "
                             "tampered download); it was deleted")
    os.replace(part, final)
    return final


# ---- unpacking ---------------------------------------------------------------------------

def _member_path(dest: Path, name: str) -> Path | None:
    """Where a wheel member goes; None for the parts an import never needs (scripts,
    headers, data). Refuses any name that would land outside dest."""
    if "\\" in name or ":" in name or name.startswith("/"):
        raise GpuEnableError(f"refusing a wheel member named {name!r}")
    parts = PurePosixPath(name).parts
    if not parts or any(p in ("..", ".") for p in parts):
        raise GpuEnableError(f"refusing a wheel member named {name!r}")
    if parts[0].endswith(".data") and len(parts) > 2:
        if parts[1] not in ("purelib", "platlib"):
            return None
        parts = parts[2:]
    target = dest.joinpath(*parts)
    root = dest.resolve()
    if root not in target.resolve().parents:
        raise GpuEnableError(f"refusing a wheel member named {name!r}")
    return target


def unpacked_size(wheels: list[Path]) -> int:
    total = 0
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            total += sum(i.file_size for i in z.infolist())
    return total


def unpack(wheel: Path, dest: Path, cancel: threading.Event, on_bytes: Callable[[int], None] = lambda n: None):
    """A wheel's files into dest, as an installer lays them out (purelib and platlib
    merged into the root). Executable bits survive (triton runs ptxas); links do not."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                continue
            target = _member_path(dest, info.filename)
            if target is None:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                while block := src.read(4 * CHUNK):
                    if cancel.is_set():
                        raise Cancelled()
                    out.write(block)
                    on_bytes(len(block))
            if mode & 0o111 and os.name != "nt":
                os.chmod(target, 0o755)


def rmtree(path: Path):
    """Best effort: on Windows a DLL still loaded by a running engine cannot go yet."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        try:
            path.unlink()
        except OSError:
            pass
