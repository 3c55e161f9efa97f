"""Enable the GPU: install the CUDA build of torch beside the CPU build the installers
ship, switch to it only once a child process has seen it work, and go back on request.

    potluck gpu --enable [--index URL]     (headless machines; the app's tray offers it too)
    potluck gpu --disable                  (back to the shipped CPU build)

The steps, each undone if a later one fails (engine/boot/overlay.py describes the folders):

  1. resolve   torch == the shipped version, its CUDA variant, from the PyTorch index
               (app/gpu_index.py chooses; POTLUCK_GPU_INDEX or --index overrides)
  2. download  into <data>/gpu/downloads/<file>.part, resumed with HTTP Range, checked
               against the index's sha256 (app/gpu_fetch.py)
  3. unpack    into <data>/gpu/site.new, emptied first
  4. verify    `potluck gpu --check` in a child with POTLUCK_GPU_OVERLAY=site.new: it
               must import that torch and see the GPU
  5. switch    site -> site.old, site.new -> site, ACTIVE written last, site.old deleted

A failure before the switch deletes site.new and leaves the CPU build (or the overlay in
use before) exactly as it was; the downloads stay until an install succeeds, so a retry
resumes. Cancelling keeps them too. The app process never imports torch: it asks a child.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from engine.boot import overlay
from engine.boot.selfcmd import engine_command

from .gpu_fetch import (Cancelled, GpuEnableError, IndexClient, Meter, download, rmtree, unpack, unpacked_size,
                        wheel_metadata)
from .gpu_index import (NotFound, Pick, ResolveError, Target, requirements_of, resolve, variant_indexes,
                        variants_for)

ENV_INDEX = "POTLUCK_GPU_INDEX"      # space-separated simple-index URLs, searched in order
DOWNLOADS = "downloads"
NEW, OLD, LOCK = "site.new", "site.old", "install.lock"
TYPICAL_SIZE = "~2.5 GB"             # the Windows CUDA wheel; shown until the index tells
SPARE_BYTES = 200 * 2**20            # left free on the disk after unpacking
CHECK_TIMEOUT_S = 600                # the first import of a CUDA torch can take minutes on Windows

Progress = Callable[[str, int, int], None]   # (stage, bytes done, bytes total)


# ---- what this computer has ----------------------------------------------------------------

@dataclass
class GpuInfo:
    names: list[str] = field(default_factory=list)
    driver_cuda: tuple[int, int] | None = None     # the newest CUDA the driver supports
    capability: tuple[int, int] | None = None      # the oldest GPU's compute capability
    why: str | None = None                         # why none was found


def read_nvidia(nvml=None) -> GpuInfo:
    """NVIDIA GPUs through NVML (nvidia-ml-py), never raising: no library, no driver, no GPU
    all come back as an empty list and a reason."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return GpuInfo(why="nvidia-ml-py is not installed")
    try:
        nvml.nvmlInit()
    except Exception as exc:
        from engine.boot.gpu_words import nvml_reason

        return GpuInfo(why=nvml_reason(exc))
    info = GpuInfo()
    try:
        caps = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            info.names.append(name.decode() if isinstance(name, bytes) else str(name))
            try:
                caps.append(tuple(int(x) for x in nvml.nvmlDeviceGetCudaComputeCapability(h)))
            except Exception:
                pass
        info.capability = min(caps) if caps else None
        try:
            v = int(nvml.nvmlSystemGetCudaDriverVersion())
            info.driver_cuda = (v // 1000, (v % 1000) // 10)
        except Exception:
            pass
        if not info.names:
            info.why = "the NVIDIA driver sees no GPU"
    except Exception as exc:
        from engine.boot.gpu_words import nvml_reason

        info.why = nvml_reason(exc)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return info


def _engine_env(overlay_dir: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != overlay.ENV}
    if overlay_dir is not None:
        env[overlay.ENV] = overlay_dir
    if not getattr(sys, "frozen", False):    # a checkout: the child finds `engine` the way the node does
        from .nodeproc import REPO_ROOT

        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_check(overlay_dir: str | None = None, cancel: threading.Event | None = None,
              timeout: float = CHECK_TIMEOUT_S) -> tuple[dict | None, str]:
    """`potluck gpu --check` in a child: (its JSON line or None, stderr's tail). With
    overlay_dir the child tries that folder (POTLUCK_GPU_OVERLAY; "off": the shipped build)."""
    p = subprocess.Popen(engine_command() + ["gpu", "--check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, env=_engine_env(overlay_dir), text=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            out, err = p.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            if (cancel is not None and cancel.is_set()) or time.monotonic() > deadline:
                p.kill()
                p.communicate()
                if cancel is not None and cancel.is_set():
                    raise Cancelled() from None
                return None, f"`potluck gpu --check` took longer than {timeout:.0f} s"
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("{")]
    try:
        facts = json.loads(lines[-1]) if lines else None
    except ValueError:
        facts = None
    return (facts if isinstance(facts, dict) else None), "\n".join(err.strip().splitlines()[-5:])


def should_offer(gpu: GpuInfo, check: dict | None) -> bool:
    """Offer the download when an NVIDIA GPU is here and the torch the engine gets is a
    CPU build. A CUDA build that cannot see the GPU is a driver problem (`potluck doctor`
    says so); a torch that does not import at all is not this offer's to fix."""
    return bool(gpu.names) and check is not None and "error" not in check \
        and not check.get("cuda") and not check.get("cuda_available")


def offer_label(size: int | None = None) -> str:
    return f"Enable GPU (downloads {format_size(size) if size else TYPICAL_SIZE})"


def format_size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def installed(gpu_dir: Path | None = None) -> str | None:
    """The switched-on CUDA build's torch version, if one is."""
    d = Path(gpu_dir) if gpu_dir else overlay.gpu_dir()
    try:
        if (d / overlay.SITE).is_dir():
            return (d / overlay.ACTIVE).read_text().strip() or "?"
    except OSError:
        pass
    return None


# ---- the shipped environment -----------------------------------------------------------------

def shipped_torch_version() -> str:
    """The shipped torch's release (2.13.0 of 2.13.0+cpu), from its metadata, else from a child."""
    try:
        return Version(importlib.metadata.version("torch")).public
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        facts, err = run_check("off")
        if facts and facts.get("torch"):
            return Version(facts["torch"]).public
        raise GpuEnableError(f"cannot tell which torch Potluck ships: {err or 'no answer'}") from None


def present_here(target: Target) -> dict[str, Version | None]:
    """What the shipped environment has: installed distributions (the first on sys.path,
    as import picks), and what the shipped torch requires (a bundle may keep a package
    without its metadata, but the CPU build works, so its own requirements are met)."""
    out: dict[str, Version | None] = {}
    for dist in importlib.metadata.distributions():
        try:
            out.setdefault(canonicalize_name(dist.metadata["Name"]), Version(dist.version))
        except (InvalidVersion, TypeError, KeyError):
            continue
    try:
        meta = importlib.metadata.distribution("torch").read_text("METADATA") or ""
        for req in requirements_of(meta, {""}, target.env):
            out.setdefault(canonicalize_name(req.name), None)
    except (importlib.metadata.PackageNotFoundError, ResolveError):
        pass
    return out


def needs_full_bitsandbytes(files: list[str]) -> bool:
    """The bundle keeps bitsandbytes' CPU library only (build.spec): without a CUDA one
    its 8/4-bit weights would stay on the CPU next to a CUDA torch."""
    return not any(f.startswith("libbitsandbytes_cuda") for f in files)


def companions() -> list[str]:
    """Requirements to install with torch: bitsandbytes' full wheel, same version, where
    the shipped one lost its CUDA libraries."""
    try:
        version = importlib.metadata.version("bitsandbytes")
        spec = importlib.util.find_spec("bitsandbytes")
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return []
    files: list[str] = []
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            files += os.listdir(folder)
        except OSError:
            pass
    return [f"bitsandbytes=={version}"] if needs_full_bitsandbytes(files) else []


# ---- the install -------------------------------------------------------------------------------

@dataclass
class Enabled:
    torch: str
    cuda: str | None
    device: str | None
    site: str
    index: str
    downloaded: int            # bytes fetched over the network in this run
    total: int
    skipped: list[str] = field(default_factory=list)   # companions the indexes lack


def index_choices(index: str | list[str] | None, gpu: GpuInfo | None) -> list[list[str]]:
    """The index lists to try, in order: the caller's or POTLUCK_GPU_INDEX's (exactly
    those), else the PyTorch index's CUDA variants this driver and GPU can run."""
    given = index if index is not None else os.environ.get(ENV_INDEX) or None
    if given:
        return [given.split() if isinstance(given, str) else list(given)]
    gpu = gpu or GpuInfo()
    variants = variants_for(gpu.driver_cuda, gpu.capability)
    if not variants:
        raise GpuEnableError(
            f"the NVIDIA driver supports CUDA {'.'.join(map(str, gpu.driver_cuda or ()))} only, older than any "
            "CUDA build of torch Potluck can use: update the driver (nvidia.com/drivers), then try again")
    return [variant_indexes(v) for v in variants]


def plan(indexes: list[list[str]], roots: list[Requirement], target: Target, present: dict,
         metadata_of: Callable[[IndexClient, Pick], str]) -> tuple[list[Pick], IndexClient, list[str]]:
    """Resolve against the first index list that has a CUDA build of torch (roots[0]).
    A companion (the other roots) the indexes lack is left out and named, not a reason
    to fail: torch is the point."""
    optional = {canonicalize_name(r.name): r for r in roots[1:]}
    skipped: list[str] = []
    last: Exception | None = None
    i = 0
    while i < len(indexes):
        client = IndexClient(indexes[i])
        try:
            picks = resolve(roots, present=present, target=target, links=client.links,
                            metadata=lambda pick, c=client: metadata_of(c, pick))
            return picks, client, skipped
        except NotFound as e:
            last = e
            if e.name in optional:
                skipped.append(str(optional.pop(e.name)))
                roots = [r for r in roots if canonicalize_name(r.name) != e.name]
                continue
            if e.name == "torch" and i + 1 < len(indexes):
                i += 1              # this CUDA variant was not built for this torch: an older one may be
                continue
            raise GpuEnableError(str(e)) from None
        except ResolveError as e:
            raise GpuEnableError(str(e)) from None
    raise GpuEnableError(str(last))


class _Lock:
    """One install at a time per data folder (the app and `potluck gpu --enable`); the OS
    drops the lock when its process dies, so a killed install never blocks the next."""

    def __init__(self, folder: Path):
        self.path = folder / LOCK
        self.fd: int | None = None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.name == "nt":
                import msvcrt

                msvcrt.locking(self.fd, msvcrt.LK_NBLCK, 1)
            else:
                import fcntl

                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            self.fd = None
            raise GpuEnableError("another Potluck is installing the GPU build right now") from None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)   # closing releases flock and msvcrt locks alike
            self.fd = None


def _free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _need_space(folder: Path, needed: int, what: str):
    free = _free_bytes(folder)
    if free < needed + SPARE_BYTES:
        raise GpuEnableError(f"{what} needs {format_size(needed + SPARE_BYTES)} free in {folder}, "
                             f"and only {format_size(free)} is")


def verify(site: Path, cancel: threading.Event) -> dict:
    """A child imports torch from site and must see the GPU through it."""
    facts, err = run_check(str(site), cancel)
    if facts is None:
        raise GpuEnableError(f"the check of the new torch gave no answer{': ' + err if err else ''}")
    if facts.get("error"):
        raise GpuEnableError(f"the downloaded torch does not start here: {facts['error']}")
    if facts.get("overlay") != str(site):
        raise GpuEnableError(f"the check imported a different torch ({facts.get('overlay') or 'the shipped one'})")
    if not facts.get("cuda_available"):
        raise GpuEnableError(f"torch's CUDA {facts.get('cuda') or ''} build loaded but does not see the GPU: the "
                             "NVIDIA driver is probably older than that CUDA version needs; update it and try again")
    return facts


def _switch(gdir: Path, new: Path, version: str):
    site, old = gdir / overlay.SITE, gdir / OLD
    rmtree(old)
    if site.exists():
        try:
            os.replace(site, old)
        except OSError as e:  # Windows: a running engine still has the old build's DLLs open
            raise GpuEnableError(f"the GPU build in use could not be replaced ({e}); quit Potluck and run "
                                 "`potluck gpu --enable` again") from None
    try:
        os.replace(new, site)
    except OSError:
        if old.exists() and not site.exists():
            os.replace(old, site)
        raise
    tmp = gdir / (overlay.ACTIVE + ".tmp")
    tmp.write_text(version + "\n")
    os.replace(tmp, gdir / overlay.ACTIVE)   # last: only now does a new engine process pick it
    rmtree(old)


def enable(index: str | list[str] | None = None, *, gpu_dir: Path | None = None, progress: Progress | None = None,
           cancel: threading.Event | None = None, torch_version: str | None = None,
           extras: list[str] | None = None, target: Target | None = None, gpu: GpuInfo | None = None,
           attempts: int = 3) -> Enabled:
    """Install and switch on the CUDA build; raises GpuEnableError (Cancelled when
    cancel is set) with everything that was in use before left as it was."""
    gdir = Path(gpu_dir) if gpu_dir else overlay.gpu_dir()
    gdir.mkdir(parents=True, exist_ok=True)
    report = progress or (lambda stage, done, total: None)
    cancel = cancel or threading.Event()
    with _Lock(gdir):
        target = target or Target.here()
        choices = index_choices(index, gpu if gpu is not None else (None if index else read_nvidia()))
        version = torch_version or shipped_torch_version()
        roots = [Requirement(f"torch=={version}")] + [Requirement(r) for r in (companions() if extras is None
                                                                                 else extras)]
        downloads = gdir / DOWNLOADS
        meter = Meter(0, report)

        def metadata_of(client: IndexClient, pick: Pick) -> str:
            if cancel.is_set():
                raise Cancelled()
            if pick.link.metadata is not None:
                return client.metadata(pick.link)
            return wheel_metadata(download(pick.link, downloads, meter, cancel, attempts))

        report("resolve", 0, 0)
        picks, client, skipped = plan(choices, roots, target, present_here(target), metadata_of)
        for p in picks:
            p.size = client.size(p.link)
        meter.total = sum(p.size or 0 for p in picks)
        meter.done = 0
        have = sum(_on_disk(downloads, p) for p in picks)
        _need_space(gdir, max(0, meter.total - have), "The download")
        meter.flush()
        wheels = [download(p.link, downloads, meter, cancel, attempts) for p in picks]
        meter.flush()
        new = gdir / NEW
        rmtree(new)
        try:
            size = unpacked_size(wheels)
            _need_space(gdir, size, "Unpacking")
            done = [0]

            def unpacked(n: int):
                done[0] += n
                if done[0] % (8 * 2**20) < n or done[0] == size:
                    report("unpack", done[0], size)

            for w in wheels:
                unpack(w, new, cancel, unpacked)
            report("verify", 0, 0)
            facts = verify(new, cancel)
            report("switch", 0, 0)
            _switch(gdir, new, str(facts.get("torch")))
        except BaseException:
            rmtree(new)
            raise
        rmtree(downloads)
        report("done", meter.total, meter.total)
        return Enabled(torch=str(facts.get("torch")), cuda=facts.get("cuda"), device=facts.get("device_name"),
                       site=str(gdir / overlay.SITE), index=client.indexes[0], downloaded=meter.fetched,
                       total=meter.total, skipped=skipped)


def _on_disk(folder: Path, pick: Pick) -> int:
    for name in (pick.filename, pick.filename + ".part"):
        try:
            return (folder / name).stat().st_size
        except OSError:
            continue
    return 0


def estimate_size(index: str | list[str] | None = None, *, gpu: GpuInfo | None = None,
                  torch_version: str | None = None, extras: list[str] | None = None,
                  target: Target | None = None) -> int | None:
    """The download's size from the index, without downloading any wheel: None when the
    index does not serve metadata on its own (PEP 658), or cannot be reached."""

    class _NoMetadata(Exception):
        pass

    def metadata_of(client: IndexClient, pick: Pick) -> str:
        if pick.link.metadata is None:
            raise _NoMetadata()
        return client.metadata(pick.link)

    try:
        target = target or Target.here()
        roots = [Requirement(f"torch=={torch_version or shipped_torch_version()}")]
        roots += [Requirement(r) for r in (companions() if extras is None else extras)]
        picks, client, _ = plan(index_choices(index, gpu), roots, target, present_here(target), metadata_of)
        sizes = [client.size(p.link) for p in picks]
    except (_NoMetadata, GpuEnableError, OSError, ValueError):
        return None
    return None if any(s is None for s in sizes) else sum(sizes)


def disable(gpu_dir: Path | None = None) -> bool:
    """Back to the shipped CPU build: ACTIVE goes first (the switch), then the files.
    Returns whether a GPU build had been switched on."""
    gdir = Path(gpu_dir) if gpu_dir else overlay.gpu_dir()
    if not gdir.is_dir():
        return False
    with _Lock(gdir):
        active = gdir / overlay.ACTIVE
        was = active.exists()
        if was:
            active.unlink()
        for name in (overlay.SITE, NEW, OLD, DOWNLOADS):
            rmtree(gdir / name)
        return was


# ---- `potluck gpu --enable | --disable` ----------------------------------------------------------

class LinePrinter:
    """Progress as plain lines (a headless log, not a redrawn bar): each stage once, the
    download every 5%."""

    WORDS = {"resolve": "Finding the CUDA build of torch…", "unpack": "Unpacking…",
             "verify": "Checking that torch sees the GPU…", "switch": "Switching over…"}

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.stage = None
        self.step = -1

    def __call__(self, stage: str, done: int, total: int):
        if stage == "download":
            step = int(done * 20 / total) if total else 0
            if stage != self.stage or step != self.step:
                self.step = step
                print(f"Downloading: {format_size(done)} of {format_size(total)} ({step * 5}%)" if total
                      else f"Downloading: {format_size(done)}", file=self.out, flush=True)
        elif stage != self.stage and stage in self.WORDS:
            print(self.WORDS[stage], file=self.out, flush=True)
        self.stage = stage


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="potluck gpu", description="Install the CUDA build of torch for this "
                                "computer's NVIDIA GPU, or go back to the CPU build (`potluck gpu --check`: "
                                "which one the engine gets)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--enable", action="store_true", help="download the CUDA build (~2.5 GB) and switch to it")
    what.add_argument("--disable", action="store_true", help="switch back to the CPU build and delete the CUDA one")
    p.add_argument("--index", action="append", default=None, metavar="URL",
                   help=f"simple package index to use, repeatable (default: ${ENV_INDEX}, else the PyTorch "
                        "index's CUDA build for this driver, then PyPI for what it lacks)")
    args = p.parse_args(argv)
    if args.disable:
        if disable():
            print("Switched back to the CPU build of torch. Restart Potluck (or its node) for the change to "
                  "take effect.")
        else:
            print("The CPU build was already in use: nothing changed.")
        return 0
    gpu = read_nvidia()
    if not gpu.names:
        print(f"potluck gpu: no NVIDIA GPU found ({gpu.why}); nothing to enable.", file=sys.stderr)
        return 1
    cancel = threading.Event()
    try:
        done = enable(args.index, progress=LinePrinter(), cancel=cancel, gpu=gpu)
    except KeyboardInterrupt:
        print("\nStopped; run it again to resume the download.", file=sys.stderr)
        return 130
    except GpuEnableError as e:
        print(f"potluck gpu: {e}\nPotluck keeps using what it used before (the CPU build of torch unless a "
              "GPU build was already on).", file=sys.stderr)
        return 1
    print(f"GPU enabled: torch {done.torch} (CUDA {done.cuda}) sees {done.device}. Restart Potluck (or its node) "
          "to compute on it; `potluck gpu --disable` goes back.")
    if done.skipped:
        print(f"Not on the package index, so left out: {', '.join(done.skipped)}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
