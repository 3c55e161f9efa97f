"""Which wheels make up the CUDA build of torch for this computer, chosen from PEP 503
"simple" package indexes. Pure: pages, metadata and the shipped environment come in as
arguments, so every choice is tested without a network (app/gpu_enable.py does the I/O).

What gets picked:
  * torch == the shipped version, with a `+cuXXX` local label (the CUDA build), the
    newest such wheel whose tags this interpreter accepts (cpXY, win_amd64 /
    manylinux_*_x86_64, in packaging's order of preference);
  * what its Requires-Dist adds for this platform (on Linux the nvidia-* and cuda-*
    wheels, triton), with their extras and their own dependencies, except what the
    shipped environment already has in a version that fits;
  * companions the caller asks for (bitsandbytes' full wheel: the bundle strips its CUDA
    libraries).
Nothing read from an index is evaluated: pages are parsed as HTML, metadata as RFC 822
headers, requirements and markers by `packaging`.
"""

from __future__ import annotations

import email.parser
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Callable, Iterable, Mapping
from urllib.parse import unquote, urldefrag, urljoin, urlparse

from packaging import tags as _tags
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

PYTORCH_INDEX = "https://download.pytorch.org/whl"
# what the PyTorch index lacks (bitsandbytes); searched only after it, never instead of it
PYPI_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Variant:
    tag: str                        # the PyTorch index's folder: cu130 -> /whl/cu130
    driver: tuple[int, int]         # the oldest CUDA version the NVIDIA driver must support
    min_capability: tuple[int, int]  # the oldest GPU architecture the build has kernels for


# Newest first. torch 2.13.0's own Linux wheel on PyPI is the CUDA 13.0 build (its
# Requires-Dist pins cuda-toolkit 13.0.3), so cu130 is the variant the PyTorch project
# ships as its default and tests most, and the one with a Windows build beside it. CUDA 13
# needs an R580 driver (it reports CUDA 13.0) and dropped GPUs before Turing (sm_75); CUDA
# 12 builds run on any 12.x driver (minor-version compatibility), cu126 keeping Maxwell and
# Pascal, which cu128 builds left out. A variant the index lacks for this torch is skipped.
VARIANTS = (Variant("cu130", (13, 0), (7, 5)), Variant("cu128", (12, 0), (7, 0)), Variant("cu126", (12, 0), (5, 0)))


def variants_for(driver_cuda: tuple[int, int] | None, capability: tuple[int, int] | None) -> list[str]:
    """The CUDA variants worth trying on this GPU and driver, best first (unknown: all)."""
    return [v.tag for v in VARIANTS
            if (driver_cuda is None or driver_cuda >= v.driver)
            and (capability is None or capability >= v.min_capability)]


def variant_indexes(variant: str, base: str = PYTORCH_INDEX) -> list[str]:
    return [f"{base.rstrip('/')}/{variant}", PYPI_INDEX]


# ---- simple index pages ----------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    filename: str
    url: str                          # without the #sha256 fragment
    sha256: str | None
    requires_python: str | None = None
    metadata: str | None = None       # PEP 658/714: None = not served; "" = served, no hash; else its sha256
    yanked: bool = False

    @property
    def metadata_url(self) -> str:
        return self.url + ".metadata"


class _Anchors(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[dict, str]] = []
        self._open: dict | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._open, self._text = {k: (v if v is not None else "") for k, v in attrs}, []

    def handle_data(self, data):
        if self._open is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._open is not None:
            self.found.append((self._open, "".join(self._text).strip()))
            self._open = None


def _hash_of(value: str | None) -> str | None:
    """'sha256=<hex>' -> '<hex>' (other algorithms: None)."""
    if value and value.startswith("sha256="):
        hexdigest = value[len("sha256="):].strip().lower()
        if len(hexdigest) == 64 and all(c in "0123456789abcdef" for c in hexdigest):
            return hexdigest
    return None


def parse_simple_page(text: str, page_url: str) -> list[Link]:
    """The files a PEP 503 project page lists (PEP 592 yanked, PEP 658/714 metadata)."""
    parser = _Anchors()
    parser.feed(text)
    parser.close()
    out = []
    for attrs, label in parser.found:
        href = attrs.get("href")
        if not href:
            continue
        url, fragment = urldefrag(urljoin(page_url, href))
        filename = unquote(urlparse(url).path.rsplit("/", 1)[-1]) or label
        meta_attr = attrs.get("data-core-metadata", attrs.get("data-dist-info-metadata"))
        if meta_attr is None or meta_attr.lower() == "false":
            metadata = None
        else:
            metadata = _hash_of(meta_attr) or ""
        out.append(Link(filename=filename, url=url, sha256=_hash_of(fragment),
                        requires_python=attrs.get("data-requires-python") or None, metadata=metadata,
                        yanked="data-yanked" in attrs))
    return out


# ---- this computer ---------------------------------------------------------------------

_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def _platforms(platform: str) -> list[str]:
    """A glibc computer takes every older manylinux too (and the legacy names), in
    packaging's order: manylinux_2_28_x86_64 -> _2_28, _2_27, ... manylinux1, linux."""
    head, _, rest = platform.partition("manylinux_2_")
    glibc, _, arch = rest.partition("_")
    if head or not glibc.isdigit():
        return [platform]
    out = []
    for m in range(int(glibc), 4, -1):
        out.append(f"manylinux_2_{m}_{arch}")
        if m in _LEGACY_MANYLINUX:
            out.append(f"{_LEGACY_MANYLINUX[m]}_{arch}")
    return out + [f"linux_{arch}"]


@dataclass
class Target:
    """What a wheel must fit: the interpreter's tags in order of preference, the marker
    environment, the Python version (data-requires-python)."""

    tags: list[_tags.Tag]
    env: dict
    python: Version

    @classmethod
    def here(cls) -> "Target":
        # not python_full_version: a source build's "3.13.1+" is no valid version
        return cls(list(_tags.sys_tags()), dict(default_environment()),
                   Version(".".join(map(str, sys.version_info[:3]))))

    @classmethod
    def for_platform(cls, platform: str, python: str = "3.13") -> "Target":
        """Another computer's target (tests; what a Windows install would pick)."""
        major, minor = (int(x) for x in python.split(".")[:2])
        plats = _platforms(platform)
        windows = platform.startswith("win")
        env = dict(default_environment())
        env.update(python_version=f"{major}.{minor}", python_full_version=f"{major}.{minor}.0",
                   implementation_name="cpython", platform_python_implementation="CPython",
                   sys_platform="win32" if windows else "linux", os_name="nt" if windows else "posix",
                   platform_system="Windows" if windows else "Linux",
                   platform_machine="AMD64" if windows else next(
                       (m for m in ("x86_64", "aarch64") if platform.endswith(m)), platform.rsplit("_", 1)[-1]))
        tag_list = list(_tags.cpython_tags((major, minor), platforms=plats))
        tag_list += list(_tags.compatible_tags((major, minor), f"cp{major}{minor}", plats))
        return cls(tag_list, env, Version(f"{major}.{minor}.0"))

    def rank(self) -> dict[_tags.Tag, int]:
        return {t: i for i, t in enumerate(self.tags)}


# ---- choosing --------------------------------------------------------------------------

class ResolveError(Exception):
    """The index has no fitting set of wheels (message meant for people)."""


class NotFound(ResolveError):
    """No wheel of `name` fits: for torch, another CUDA variant's index may have one."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@dataclass
class Pick:
    name: str            # canonical
    version: str
    link: Link
    extras: set[str] = field(default_factory=set)
    size: int | None = None

    @property
    def filename(self) -> str:
        return self.link.filename


def best_wheel(links: Iterable[Link], req: Requirement, target: Target, cuda_local: bool = False,
               rank: Mapping[_tags.Tag, int] | None = None) -> tuple[Version, Link] | None:
    """The newest wheel of req that fits target; among a version's wheels, the tag the
    interpreter prefers. cuda_local: only `+cuXXX` builds (torch's CUDA variants)."""
    rank = target.rank() if rank is None else rank
    name = canonicalize_name(req.name)
    best = None
    for link in links:
        if link.yanked or not link.filename.endswith(".whl"):
            continue
        try:
            wname, version, _build, wtags = parse_wheel_filename(link.filename)
        except (InvalidWheelFilename, InvalidVersion):
            continue
        if wname != name or not req.specifier.contains(version, prereleases=bool(req.specifier.prereleases)):
            continue
        if cuda_local and not (version.local or "").startswith("cu"):
            continue
        if link.requires_python:
            try:
                if not SpecifierSet(link.requires_python).contains(target.python, prereleases=True):
                    continue
            except Exception:  # an unreadable requires-python: not for us
                continue
        tag_rank = min((rank[t] for t in wtags if t in rank), default=None)
        if tag_rank is None:
            continue
        key = (version, -tag_rank)
        if best is None or key > best[0]:
            best = (key, version, link)
    return None if best is None else (best[1], best[2])


def requirements_of(metadata: str, extras: set[str], env: Mapping[str, str]) -> list[Requirement]:
    """The Requires-Dist lines that apply here, for the base package ("" in extras) and
    each requested extra."""
    msg = email.parser.Parser().parsestr(metadata, headersonly=True)
    out = []
    for line in msg.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            raise ResolveError(f"unreadable requirement in the index's metadata: {line!r}") from None
        if req.marker is None:
            if "" in extras:
                out.append(req)
        elif any(req.marker.evaluate({**env, "extra": e}) for e in extras):
            out.append(req)
    return out


def _describe(target: Target) -> str:
    t = target.tags[0] if target.tags else None
    return f"{t.interpreter} {t.platform}" if t else "this computer"


def resolve(roots: list[Requirement], *, present: Mapping[str, Version | None], target: Target,
            links: Callable[[str], list[Link]], metadata: Callable[[Pick], str],
            cuda_local: Iterable[str] = ("torch",)) -> list[Pick]:
    """Every wheel to install, roots first: breadth-first over Requires-Dist.

    present: what the shipped environment has (None: a version that is known to fit,
    e.g. what the shipped torch itself requires). A requirement it satisfies is not
    fetched, except the roots, which are the point. One version per name, no
    backtracking: a later requirement the chosen version does not satisfy is an error.
    """
    cuda_local = {canonicalize_name(n) for n in cuda_local}
    root_names = {canonicalize_name(r.name) for r in roots}
    rank = target.rank()
    chosen: dict[str, Pick] = {}
    order: list[str] = []
    queue: list[tuple[Requirement, str | None]] = [(r, None) for r in roots]
    while queue:
        req, parent = queue.pop(0)
        name = canonicalize_name(req.name)
        why = f" (needed by {parent})" if parent else ""
        if name in chosen:
            pick = chosen[name]
            if not req.specifier.contains(Version(pick.version), prereleases=True):
                raise ResolveError(f"{req}{why} conflicts with {pick.name} {pick.version}, chosen earlier")
            new = set(req.extras) - pick.extras
            if new:
                pick.extras |= new
                queue += [(r, pick.name) for r in requirements_of(metadata(pick), new, target.env)]
            continue
        have = present.get(name, False)
        if (name not in root_names and not req.extras and have is not False
                and (have is None or req.specifier.contains(have, prereleases=True))):
            continue
        found = best_wheel(links(name), req, target, cuda_local=name in cuda_local, rank=rank)
        if found is None:
            build = "CUDA build of " if name in cuda_local else ""
            raise NotFound(name, f"the package index has no {build}{req.name} {req.specifier or ''}".rstrip()
                               + f" for {_describe(target)}{why}")
        version, link = found
        if not link.sha256:
            raise ResolveError(f"the package index lists {link.filename} without a sha256 hash, so its "
                               "download could not be checked")
        pick = chosen[name] = Pick(name, str(version), link, extras=set(req.extras))
        order.append(name)
        queue += [(r, name) for r in requirements_of(metadata(pick), {""} | set(req.extras), target.env)]
    return [chosen[n] for n in order]
