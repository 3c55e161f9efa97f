"""A PEP 503 simple package index on 127.0.0.1, for the GPU-enable tests: it serves
wheels built here (stand-ins for torch's CUDA build and its nvidia-* wheels), their
PEP 658 metadata, HEAD and HTTP Range, and breaks on request.

    index = SimpleIndex().start()
    index.add(build_wheel(tmp, "torch", "2.13.0+cu999", {...}, tag="cp311-cp311-manylinux_2_28_x86_64"))
    index.fault("torch-2.13.0+cu999-…whl", drop_after=300_000)   # the connection closes mid-file
    enable(index.url, …)
    index.requests("torch-…whl")   # what was asked (Range headers) and how many bytes went out

Faults: drop_after (send that many body bytes, then close the socket: a truncated body),
corrupt (serve other bytes than the listed sha256 vouches for), ignore_range (answer a
Range request with the whole file, 200); each for `times` requests, then it heals.
`gate`: clear it and every request waits until it is set again (a test acts while the
client is known to be waiting on the index).
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import threading
import zipfile
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, unquote

from packaging.utils import canonicalize_name, parse_wheel_filename


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(folder: Path, name: str, version: str, files: dict[str, str | bytes], *,
                requires: list[str] = (), tag: str = "py3-none-any", stored: bool = False) -> Path:
    """A wheel as a build backend writes one: the files, then NAME-VERSION.dist-info with
    METADATA (Requires-Dist), WHEEL (tags) and RECORD."""
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    meta = "Metadata-Version: 2.1\n" + f"Name: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    wheel_txt = f"Wheel-Version: 1.0\nGenerator: potluck-testkit\nRoot-Is-Purelib: false\nTag: {tag}\n"
    members = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
    members[f"{info}/METADATA"] = meta.encode()
    members[f"{info}/WHEEL"] = wheel_txt.encode()
    record = "".join(f"{k},{_record_hash(v)},{len(v)}\n" for k, v in members.items()) + f"{info}/RECORD,,\n"
    members[f"{info}/RECORD"] = record.encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{tag}.whl"
    method = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", method) as z:
        for k, v in members.items():
            z.writestr(k, v)
    return path


STAND_IN_TORCH = '''__version__ = "{version}"
from . import cuda, version
'''


def stand_in_torch(folder: Path, version: str, tag: str, *, broken: str | None = None, sees_gpu: bool = True,
                   requires: list[str] = (), pad: int = 0) -> Path:
    """torch's CUDA build in miniature: `potluck gpu --check` imports it and reads its
    version, CUDA version and GPU. broken: the text of an OSError its import raises (a
    CUDA library that will not load). pad: incompressible bytes, so a download takes
    many reads and can break in the middle."""
    files = {"torch/__init__.py": (f"raise OSError({broken!r})\n" if broken else
                                   STAND_IN_TORCH.format(version=version)),
             "torch/version.py": 'cuda = "99.9"\n',
             "torch/cuda.py": f"def is_available():\n    return {sees_gpu!r}\n\n"
                              "def get_device_name(i):\n    return 'Stand-in GPU'\n"}
    if pad:
        files["torch/_pad.bin"] = hashlib.shake_256(version.encode()).digest(pad)
    return build_wheel(folder, "torch", version, files, requires=list(requires), tag=tag, stored=True)


@dataclass
class Fault:
    drop_after: int | None = None
    corrupt: bool = False
    ignore_range: bool = False
    times: int = 1


@dataclass
class Served:
    method: str
    path: str
    range: str | None
    status: int
    sent: int = 0       # body bytes written


@dataclass
class _File:
    data: bytes
    metadata: bytes | None
    listed_hash: bool
    requires_python: str | None


class SimpleIndex:
    def __init__(self):
        self.files: dict[str, _File] = {}
        self.projects: dict[str, list[str]] = {}
        self.faults: dict[str, Fault] = {}
        self.log: list[Served] = []
        self._lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.server: ThreadingHTTPServer | None = None

    # ---- contents --------------------------------------------------------------------
    def add(self, wheel: Path, *, metadata: bool = True, listed_hash: bool = True,
            requires_python: str | None = None) -> str:
        data = wheel.read_bytes()
        meta = None
        if metadata:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
        name = parse_wheel_filename(wheel.name)[0]
        self.files[wheel.name] = _File(data, meta, listed_hash, requires_python)
        self.projects.setdefault(canonicalize_name(name), []).append(wheel.name)
        return wheel.name

    def fault(self, filename: str, **kw) -> None:
        self.faults[filename] = Fault(**kw)

    def heal(self) -> None:
        self.faults.clear()

    def requests(self, filename: str, method: str = "GET") -> list[Served]:
        return [s for s in self.log if s.path.endswith("/files/" + quote(filename)) and s.method == method]

    def page(self, project: str) -> str:
        rows = []
        for fn in self.projects.get(project, []):
            f = self.files[fn]
            href = f"../../files/{quote(fn)}"       # relative, "+" as %2B: as the PyTorch index writes them
            if f.listed_hash:
                href += "#sha256=" + hashlib.sha256(f.data).hexdigest()
            attrs = f' href="{href}"'
            if f.metadata is not None:
                h = hashlib.sha256(f.metadata).hexdigest()
                attrs += f' data-dist-info-metadata="sha256={h}" data-core-metadata="sha256={h}"'
            if f.requires_python:
                attrs += f' data-requires-python="{html.escape(f.requires_python)}"'
            rows.append(f"<a{attrs}>{html.escape(fn)}</a><br/>")
        return ("<!DOCTYPE html>\n<html><body><h1>Links for " + html.escape(project) + "</h1>\n"
                + "\n".join(rows) + "\n</body></html>\n")

    # ---- the server ------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def start(self) -> "SimpleIndex":
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                index._serve(self, head=True)

            def do_GET(self):
                index._serve(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True, name="pyindex").start()
        return self

    def close(self) -> None:
        self.gate.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _take_fault(self, filename: str) -> Fault | None:
        with self._lock:
            f = self.faults.get(filename)
            if f is None or f.times <= 0:
                return None
            f.times -= 1
            return f

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?", 1)[0]
        entry = Served(h.command, path, h.headers.get("Range"), 200)
        with self._lock:
            self.log.append(entry)
        self.gate.wait(60)
        if path.startswith("/simple/") and path.endswith("/"):
            project = canonicalize_name(unquote(path[len("/simple/"):-1]))
            if project not in self.projects:
                return self._status(h, entry, 404)
            return self._send(h, entry, self.page(project).encode(), "text/html", head)
        if not path.startswith("/files/"):
            return self._status(h, entry, 404)
        name = unquote(path[len("/files/"):])
        if name.endswith(".metadata") and name[:-len(".metadata")] in self.files:
            meta = self.files[name[:-len(".metadata")]].metadata
            if meta is None:
                return self._status(h, entry, 404)
            return self._send(h, entry, meta, "text/plain", head)
        if name not in self.files:
            return self._status(h, entry, 404)
        data = self.files[name].data
        fault = None if head else self._take_fault(name)
        if fault and fault.corrupt:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        start = 0
        rng = h.headers.get("Range")
        if rng and not (fault and fault.ignore_range):
            try:
                unit, spec = rng.split("=", 1)
                start = int(spec.split("-", 1)[0])
                assert unit.strip() == "bytes"
            except (ValueError, AssertionError):
                return self._status(h, entry, 400)
            if start >= len(data):
                entry.status = 416
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{len(data)}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
        body = data[start:]
        entry.status = 206 if start else 200
        h.send_response(entry.status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        if fault and fault.drop_after is not None:
            body = body[:fault.drop_after]
        for i in range(0, len(body), 64 * 1024):
            chunk = body[i:i + 64 * 1024]
            # counted before the write: a client that has read the whole body may look at
            # the count at once, before this thread would get past the write (a flaky test)
            entry.sent += len(chunk)
            try:
                h.wfile.write(chunk)
                if i + len(chunk) >= len(body):
                    h.wfile.flush()
            except OSError:  # the client went away (a cancelled download): not sent
                entry.sent -= len(chunk)
                break
        if fault and fault.drop_after is not None:
            h.close_connection = True

    @staticmethod
    def _send(h, entry: Served, body: bytes, ctype: str, head: bool) -> None:
        h.send_response(200)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            entry.sent = len(body)   # before the write, as in a file's (see there)
            h.wfile.write(body)

    @staticmethod
    def _status(h, entry: Served, code: int) -> None:
        entry.status = code
        h.send_response(code)
        h.send_header("Content-Length", "0")
        h.end_headers()
