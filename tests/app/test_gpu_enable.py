"""Enabling the GPU (app/gpu_enable.py): the CUDA build of torch comes from a package
index, is checked in a child process, and only then switched on; anything that goes
wrong leaves the CPU build (or the GPU build in use before) as it was.

The index is testkit/pyindex.py on 127.0.0.1, serving a stand-in torch wheel (the
mechanism is the same for a 2.5 GB one, and this machine has no GPU for the real thing),
with faults injected: a body cut short, bytes that do not match the listed hash, a
server that ignores Range. The checks are real `potluck gpu --check` children. Only
pynvml is faked: no NVIDIA GPU exists here.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.version import Version

from app import gpu_enable as ge
from app.gpu_fetch import Cancelled, GpuEnableError, _member_path
from app.gpu_index import (Link, NotFound, ResolveError, Target, best_wheel, parse_simple_page,
                           requirements_of, resolve, variant_indexes, variants_for)
from testkit.fake_nvml import PYNVML_SOURCE, fake_nvml
from testkit.pyindex import SimpleIndex, build_wheel, stand_in_torch

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = Version(importlib.metadata.version("torch")).public        # 2.13.0
CUDA_BUILD = f"{SHIPPED}+cu999"
PAD = 1_500_000          # the stand-in's bulk: a download of several reads, to break in the middle
RUNTIME_REQ = "nvidia-standin-runtime==1.0.*; platform_system == 'Linux'"


def _here_tag() -> str:
    cp = [t for t in sys_tags() if t.interpreter.startswith("cp") and t.abi.startswith("cp")]
    real = [t for t in cp if t.platform.startswith("manylinux_2_28")]   # what the PyTorch index builds
    return str((real or cp)[0])


TAG = _here_tag()


def torch_wheel(folder: Path, version: str = CUDA_BUILD, **kw) -> Path:
    kw.setdefault("requires", ["filelock", RUNTIME_REQ, "standin-windows-only; sys_platform == 'win32'"])
    return stand_in_torch(folder, version, TAG, pad=PAD, **kw)


def runtime_wheel(folder: Path) -> Path:
    return build_wheel(folder, "nvidia-standin-runtime", "1.0.0", {"nvidia/standin_runtime/__init__.py": "",
                                                                   "nvidia/standin_runtime/lib/libcudart.so.99": "x"})


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("POTLUCK_HOME", str(h))
    monkeypatch.delenv("POTLUCK_GPU_OVERLAY", raising=False)
    monkeypatch.delenv(ge.ENV_INDEX, raising=False)
    return h


@pytest.fixture
def index(tmp_path):
    """The CUDA build beside decoys the choice must pass over: the CPU build of the same
    release, a newer release, another Python's and another platform's wheels."""
    w = tmp_path / "wheels"
    ix = SimpleIndex()
    ix.torch = ix.add(torch_wheel(w))
    ix.add(stand_in_torch(w / "decoys", f"{SHIPPED}+cpu", TAG, broken="the CPU build was picked"))
    newer = Version(SHIPPED).release
    ix.add(stand_in_torch(w / "decoys", f"{newer[0]}.{newer[1] + 1}.0+cu999", TAG, broken="a newer torch was picked"))
    ix.add(stand_in_torch(w / "decoys", CUDA_BUILD, "cp39-cp39-manylinux_2_28_x86_64", broken="cp39 was picked"))
    ix.add(stand_in_torch(w / "decoys", CUDA_BUILD, "cp311-cp311-win_amd64", broken="windows was picked"))
    ix.runtime = ix.add(runtime_wheel(w))
    ix.add(build_wheel(w, "bitsandbytes", "0.50.2", {"bitsandbytes/__init__.py": "",
                                                     "bitsandbytes/libbitsandbytes_cuda130.so": "x"},
                       requires=["torch<3,>=2.4", "numpy>=1.17", "pandas; extra == 'benchmark'"]))
    with ix:
        yield ix


def check() -> dict:
    """`potluck gpu --check` in a fresh child, as the engine starts: no override."""
    facts, err = ge.run_check()
    assert facts is not None, err
    return facts


def assert_cpu_build(home: Path):
    gpu = home / "gpu"
    assert not (gpu / "site").exists() and not (gpu / "ACTIVE").exists() and not (gpu / "site.new").exists()
    facts = check()
    assert facts["torch"] == importlib.metadata.version("torch") and facts["overlay"] is None
    assert facts["cuda_available"] is False


def test_enable_installs_the_cuda_build_and_the_next_engine_uses_it(home, index):
    seen = []
    done = ge.enable(index.url, extras=["bitsandbytes==0.50.2"], progress=lambda *a: seen.append(a))
    site = home / "gpu" / "site"
    assert (done.torch, done.cuda, done.device, done.site) == (CUDA_BUILD, "99.9", "Stand-in GPU", str(site))
    assert check() == {"torch": CUDA_BUILD, "cuda": "99.9", "cuda_available": True,
                       "device_name": "Stand-in GPU", "overlay": str(site)}
    assert (home / "gpu" / "ACTIVE").read_text().strip() == CUDA_BUILD
    # what torch needs on Linux came along; what the shipped environment has did not
    assert (site / "nvidia" / "standin_runtime" / "lib" / "libcudart.so.99").is_file()
    assert (site / "bitsandbytes" / "libbitsandbytes_cuda130.so").is_file()
    assert not (site / "filelock").exists() and not list(site.glob("numpy*"))
    # the decoys were never downloaded, and the downloads went once they were not needed
    got = {s.path.rsplit("/", 1)[-1] for s in index.log if s.method == "GET" and s.path.endswith(".whl")}
    assert len(got) == 3 and any(n.startswith("torch-") for n in got)
    assert [s.status for s in index.requests(index.torch)] == [200]
    assert not (home / "gpu" / "downloads").exists() and not (home / "gpu" / "site.new").exists()
    # progress: every stage in order, the download counted up to its total
    stages = [s for s, *_ in seen]
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == \
        ["resolve", "download", "unpack", "verify", "switch", "done"]
    downloads = [(d, t) for s, d, t in seen if s == "download"]
    assert downloads[-1][0] == downloads[-1][1] == done.total > PAD
    assert all(a[0] <= b[0] for a, b in zip(downloads, downloads[1:]))
    assert ge.installed() == CUDA_BUILD

    # the way back: the shipped CPU build, the GPU build's files gone
    assert ge.disable() is True
    assert ge.installed() is None
    assert_cpu_build(home)


def test_a_download_that_does_not_match_its_hash_is_deleted_and_nothing_changes(home, index):
    index.fault(index.torch, corrupt=True, times=5)
    with pytest.raises(GpuEnableError, match="did not match the sha256"):
        ge.enable(index.url, extras=[])
    assert not list((home / "gpu" / "downloads").glob("torch-*"))   # neither the file nor a .part
    assert_cpu_build(home)


def test_a_restart_in_the_middle_resumes_the_download_where_it_stopped(home, index):
    cut = 600_000
    index.fault(index.torch, drop_after=cut, times=1)
    with pytest.raises(GpuEnableError, match="broke off after 600,000 bytes"):
        ge.enable(index.url, extras=[], attempts=1)     # a run that gives up: the app was closed, say
    part = home / "gpu" / "downloads" / (index.torch + ".part")
    assert part.stat().st_size == cut
    assert_cpu_build(home)                               # a truncated body changes nothing either

    first = len(index.requests(index.torch))
    done = ge.enable(index.url, extras=[])               # the next start
    again = index.requests(index.torch)[first:]
    size = len(index.files[index.torch].data)
    assert [(r.range, r.status) for r in again] == [(f"bytes={cut}-", 206)]
    assert again[0].sent == size - cut < size
    assert done.downloaded < size and check()["torch"] == CUDA_BUILD


def test_a_dropped_connection_is_resumed_within_the_run(home, index):
    index.fault(index.torch, drop_after=400_000, times=1)
    ge.enable(index.url, extras=[])
    assert [(r.range, r.status) for r in index.requests(index.torch)] == [(None, 200), ("bytes=400000-", 206)]
    assert check()["torch"] == CUDA_BUILD


def test_a_server_that_ignores_range_sends_the_whole_file_and_it_starts_over(home, index):
    index.fault(index.torch, drop_after=300_000, times=1)
    with pytest.raises(GpuEnableError, match="broke off"):
        ge.enable(index.url, extras=[], attempts=1)
    index.fault(index.torch, ignore_range=True, times=1)
    ge.enable(index.url, extras=[])
    assert [(r.range, r.status) for r in index.requests(index.torch)] == [(None, 200), ("bytes=300000-", 200)]
    assert check()["torch"] == CUDA_BUILD


def test_cancelling_keeps_the_partial_download_for_the_next_try(home, index):
    cancel = threading.Event()

    def progress(stage, done, total):
        if stage == "download" and done >= 2**20:
            cancel.set()

    with pytest.raises(Cancelled):
        ge.enable(index.url, extras=[], progress=progress, cancel=cancel)
    part = home / "gpu" / "downloads" / (index.torch + ".part")
    kept = part.stat().st_size
    assert 2**20 <= kept < len(index.files[index.torch].data)
    assert_cpu_build(home)
    ge.enable(index.url, extras=[])
    assert index.requests(index.torch)[-1].range == f"bytes={kept}-"


def test_a_build_that_does_not_start_is_rolled_back(home, tmp_path):
    with SimpleIndex() as ix:
        ix.add(torch_wheel(tmp_path / "w", broken="libcudart.so.13: cannot open shared object file"))
        ix.add(runtime_wheel(tmp_path / "w"))
        with pytest.raises(GpuEnableError, match="does not start here: OSError: libcudart.so.13"):
            ge.enable(ix.url, extras=[])
    assert_cpu_build(home)
    # the downloads stay: a retry (after a driver update, say) need not fetch them again
    assert (home / "gpu" / "downloads").is_dir()


def test_a_cuda_build_that_does_not_see_the_gpu_is_rolled_back_with_the_driver_named(home, tmp_path):
    with SimpleIndex() as ix:
        ix.add(torch_wheel(tmp_path / "w", sees_gpu=False))
        ix.add(runtime_wheel(tmp_path / "w"))
        with pytest.raises(GpuEnableError, match="does not see the GPU: the NVIDIA driver"):
            ge.enable(ix.url, extras=[])
    assert_cpu_build(home)


def test_a_failed_upgrade_leaves_the_working_gpu_build_switched_on(home, index, tmp_path):
    ge.enable(index.url, extras=[])
    site = home / "gpu" / "site"
    with SimpleIndex() as ix:
        ix.add(torch_wheel(tmp_path / "w2", broken="libcudnn.so.9: cannot open shared object file"))
        ix.add(runtime_wheel(tmp_path / "w2"))
        with pytest.raises(GpuEnableError, match="libcudnn"):
            ge.enable(ix.url, extras=[])
    assert not (home / "gpu" / "site.new").exists() and not (home / "gpu" / "site.old").exists()
    assert check() == {"torch": CUDA_BUILD, "cuda": "99.9", "cuda_available": True,
                       "device_name": "Stand-in GPU", "overlay": str(site)}


def test_an_index_without_separate_metadata_and_a_missing_companion(home, tmp_path):
    """Metadata comes out of the downloaded wheels when the index does not serve it
    (PEP 658), and a companion the index lacks is left out and named, not fatal."""
    with SimpleIndex() as ix:
        torch = ix.add(torch_wheel(tmp_path / "w"), metadata=False)
        ix.add(runtime_wheel(tmp_path / "w"), metadata=False)
        assert ge.estimate_size(ix.url, extras=[]) is None       # it would have to download to know
        done = ge.enable(ix.url, extras=["bitsandbytes==0.50.2"])
        assert done.skipped == ["bitsandbytes==0.50.2"] and done.torch == CUDA_BUILD
        assert [r.status for r in ix.requests(torch)] == [200]      # fetched once, for metadata and install
    assert not (home / "gpu" / "site" / "bitsandbytes").exists()


def test_the_index_comes_from_the_environment_and_a_missing_build_is_named(home, index, monkeypatch):
    monkeypatch.setenv(ge.ENV_INDEX, index.url)
    with pytest.raises(GpuEnableError, match=r"no CUDA build of torch ==1\.0\.0"):
        ge.enable(extras=[], torch_version="1.0.0")
    assert ge.estimate_size(extras=[]) == sum(len(index.files[f].data) for f in (index.torch, index.runtime))
    assert_cpu_build(home)


def test_the_cli_enables_headless_and_resumes_after_its_process_is_stopped(home, index, tmp_path):
    """`potluck gpu --enable` through the real launcher, in child processes: the first
    gives up mid-file (the server cuts every attempt), the second resumes."""
    fake = tmp_path / "fake-nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(PYNVML_SOURCE)
    env = {k: v for k, v in os.environ.items() if k not in ("POTLUCK_GPU_OVERLAY", ge.ENV_INDEX)}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(ROOT)])

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "app.launcher", "gpu", *args], capture_output=True,
                              text=True, env=env, cwd=str(tmp_path), timeout=300)

    index.fault(index.torch, drop_after=300_000, times=3)     # each of the run's three attempts
    p = cli("--enable", "--index", index.url)
    assert p.returncode == 1 and "broke off" in p.stderr and "keeps using" in p.stderr
    assert p.stdout.startswith("Finding the CUDA build of torch…\nDownloading: 0 kB of ")
    p = cli("--enable", "--index", index.url)
    assert p.returncode == 0, p.stderr
    assert "Downloading: " in p.stdout and "(100%)" in p.stdout and "Checking that torch sees the GPU" in p.stdout
    assert f"GPU enabled: torch {CUDA_BUILD} (CUDA 99.9) sees Stand-in GPU" in p.stdout
    assert index.requests(index.torch)[-1].range == "bytes=900000-"
    assert check()["overlay"] == str(home / "gpu" / "site")
    p = cli("--disable")
    assert p.returncode == 0 and "Switched back to the CPU build" in p.stdout
    assert_cpu_build(home)
    # again: nothing to switch, and no restart asked for
    p = cli("--disable")
    assert p.returncode == 0 and "nothing changed" in p.stdout and "Restart" not in p.stdout


# ---- pure: the offer ------------------------------------------------------------------------

CPU_CHECK = {"torch": "2.13.0+cpu", "cuda": None, "cuda_available": False, "device_name": None, "overlay": None}


def test_the_offer_needs_an_nvidia_gpu_and_a_cpu_build():
    gpu = ge.read_nvidia(fake_nvml())
    assert gpu.names == ["NVIDIA GeForce RTX 3060"] and gpu.driver_cuda == (13, 0) and gpu.capability == (8, 6)
    assert ge.should_offer(gpu, CPU_CHECK)
    # no pynvml, no driver, no GPU: nothing to offer
    assert not ge.should_offer(ge.read_nvidia(fake_nvml(init_error=OSError("libnvidia-ml.so.1"))), CPU_CHECK)
    assert not ge.should_offer(ge.read_nvidia(fake_nvml(names=())), CPU_CHECK)
    assert not ge.should_offer(ge.GpuInfo(why="nvidia-ml-py is not installed"), CPU_CHECK)
    # CUDA already works; a CUDA build the driver cannot run (the doctor's case); a broken torch
    assert not ge.should_offer(gpu, {**CPU_CHECK, "torch": "2.13.0+cu130", "cuda": "13.0", "cuda_available": True})
    assert not ge.should_offer(gpu, {**CPU_CHECK, "cuda": "13.0"})
    assert not ge.should_offer(gpu, {**CPU_CHECK, "error": "ImportError: x"})
    assert not ge.should_offer(gpu, None)
    assert ge.offer_label() == "Enable GPU (downloads ~2.5 GB)"
    assert ge.offer_label(2_713_000_000) == "Enable GPU (downloads 2.7 GB)"


def test_read_nvidia_without_pynvml_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    gpu = ge.read_nvidia()
    assert gpu.names == [] and "nvidia-ml-py" in gpu.why


def test_the_cuda_variant_follows_the_driver_and_the_gpu():
    assert variants_for((13, 0), (8, 6)) == ["cu130", "cu128", "cu126"]
    assert variants_for((12, 4), (8, 6)) == ["cu128", "cu126"]        # an R550 driver: CUDA 12 builds
    assert variants_for((13, 0), (6, 1)) == ["cu126"]                 # Pascal: only the build that keeps it
    assert variants_for((11, 8), (8, 6)) == []
    assert variants_for(None, None) == ["cu130", "cu128", "cu126"]
    assert variant_indexes("cu130") == ["https://download.pytorch.org/whl/cu130", "https://pypi.org/simple"]
    assert ge.index_choices(None, ge.GpuInfo(["x"], (12, 8), (8, 9)))[0][0].endswith("/whl/cu128")
    with pytest.raises(GpuEnableError, match="update the driver"):
        ge.index_choices(None, ge.GpuInfo(["x"], (11, 4), (8, 6)))
    assert ge.index_choices("http://127.0.0.1:1/a http://127.0.0.1:1/b", None) == [
        ["http://127.0.0.1:1/a", "http://127.0.0.1:1/b"]]


def test_bitsandbytes_comes_along_only_where_the_bundle_stripped_its_cuda_libraries():
    assert ge.needs_full_bitsandbytes(["__init__.py", "libbitsandbytes_cpu.so"])
    assert not ge.needs_full_bitsandbytes(["libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so"])
    assert ge.companions() == []    # this checkout's venv has the full wheel


# ---- pure: pages, wheels, requirements -------------------------------------------------------

H = "a" * 64


def test_a_simple_page_is_read_as_the_pytorch_index_writes_it():
    page = (f'<a href="/whl/cu130/torch-2.13.0%2Bcu130-cp313-cp313-win_amd64.whl#sha256={H}" '
            f'data-dist-info-metadata="sha256={"b" * 64}" data-core-metadata="sha256={"b" * 64}">'
            'torch-2.13.0+cu130-cp313-cp313-win_amd64.whl</a><br/>'
            f'<a href="https://files.example.org/x/mpmath-1.3.0-py3-none-any.whl#md5=00" '
            'data-requires-python="&gt;=3.8" data-yanked="">mpmath-1.3.0-py3-none-any.whl</a>'
            '<a href="numpy-2.0.0.tar.gz" data-core-metadata="true">numpy-2.0.0.tar.gz</a>')
    torch, mpmath, sdist = parse_simple_page(page, "https://download.pytorch.org/whl/cu130/torch/")
    assert torch == Link("torch-2.13.0+cu130-cp313-cp313-win_amd64.whl",
                         "https://download.pytorch.org/whl/cu130/torch-2.13.0%2Bcu130-cp313-cp313-win_amd64.whl",
                         H, None, "b" * 64, False)
    assert torch.metadata_url.endswith("win_amd64.whl.metadata")
    assert (mpmath.sha256, mpmath.requires_python, mpmath.yanked, mpmath.metadata) == (None, ">=3.8", True, None)
    assert sdist.url == "https://download.pytorch.org/whl/cu130/torch/numpy-2.0.0.tar.gz" and sdist.metadata == ""


def _links(*names, **kw) -> list[Link]:
    return [Link(n, f"https://i/{n}", H, **kw) for n in names]


def test_the_wheel_fits_the_interpreter_the_platform_and_is_the_cuda_build():
    files = _links("torch-2.13.0+cu130-cp313-cp313-win_amd64.whl",
                   "torch-2.13.0+cu130-cp313-cp313-manylinux_2_28_x86_64.whl",
                   "torch-2.13.0+cu130-cp313-cp313t-manylinux_2_28_x86_64.whl",
                   "torch-2.13.0+cu130-cp312-cp312-manylinux_2_28_x86_64.whl",
                   "torch-2.13.0+cu130-cp313-cp313-manylinux_2_28_aarch64.whl",
                   "torch-2.13.0+cpu-cp313-cp313-manylinux_2_28_x86_64.whl",
                   "torch-2.13.0-cp313-cp313-manylinux_2_28_x86_64.whl",
                   "torch-2.13.1+cu130-cp313-cp313-manylinux_2_28_x86_64.whl",
                   "torch-2.12.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl",
                   "torch-2.13.0+cu130.tar.gz")
    req = Requirement("torch==2.13.0")
    pick = lambda target, cuda=True: (lambda f: f and f[1].filename)(best_wheel(files, req, target, cuda_local=cuda))
    assert pick(Target.for_platform("win_amd64", "3.13")) == "torch-2.13.0+cu130-cp313-cp313-win_amd64.whl"
    assert pick(Target.for_platform("manylinux_2_28_x86_64", "3.13")) == \
        "torch-2.13.0+cu130-cp313-cp313-manylinux_2_28_x86_64.whl"
    assert pick(Target.for_platform("manylinux_2_28_x86_64", "3.12")).startswith("torch-2.13.0+cu130-cp312")
    assert pick(Target.for_platform("manylinux_2_17_x86_64", "3.13")) is None   # glibc too old for _2_28
    assert pick(Target.for_platform("win_amd64", "3.11")) is None
    # without the CUDA requirement any local label fits, and the newest wins
    assert pick(Target.for_platform("win_amd64", "3.13"), cuda=False).startswith("torch-2.13.0+cu130")
    assert best_wheel(files, Requirement("torch>=2.13"), Target.for_platform("manylinux_2_28_x86_64", "3.13"),
                      cuda_local=True)[0] == Version("2.13.1+cu130")
    yanked = _links("torch-2.13.0+cu130-cp313-cp313-win_amd64.whl", yanked=True)
    old_python = _links("torch-2.13.0+cu130-cp313-cp313-win_amd64.whl", requires_python=">=3.14")
    for links in (yanked, old_python):
        assert best_wheel(links, req, Target.for_platform("win_amd64", "3.13"), cuda_local=True) is None


LINUX_TORCH_META = """Metadata-Version: 2.4
Name: torch
Version: 2.13.0+cu130
Requires-Dist: filelock
Requires-Dist: typing-extensions>=4.10.0
Requires-Dist: cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"
Requires-Dist: nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"
Requires-Dist: triton==3.7.1; platform_system == "Linux" and python_version < "3.15"
Requires-Dist: optree>=0.13.0; extra == "optree"

"""
TOOLKIT_META = """Name: cuda-toolkit
Version: 13.0.3.0
Requires-Dist: nvidia-cublas==13.1.1.3.*; sys_platform == 'linux' and extra == 'cublas'
Requires-Dist: nvidia-cuda-runtime==13.0.96.*; sys_platform == 'linux' and extra == 'cudart'
Requires-Dist: nvidia-cufft==12.0.0.61.*; sys_platform == 'linux' and extra == 'cufft'
Requires-Dist: nvidia-cublas==13.1.1.3.*; sys_platform == 'linux' and extra == 'all'
"""
CUDNN_META = "Name: nvidia-cudnn-cu13\nVersion: 9.20.0.48\nRequires-Dist: nvidia-cublas\n"


def test_requirements_apply_by_platform_and_extra():
    linux = Target.for_platform("manylinux_2_28_x86_64", "3.13").env
    windows = Target.for_platform("win_amd64", "3.13").env
    names = lambda meta, extras, env: [r.name for r in requirements_of(meta, extras, env)]
    assert names(LINUX_TORCH_META, {""}, linux) == ["filelock", "typing-extensions", "cuda-toolkit",
                                                     "nvidia-cudnn-cu13", "triton"]
    assert names(LINUX_TORCH_META, {""}, windows) == ["filelock", "typing-extensions"]
    assert names(TOOLKIT_META, {"", "cublas", "cudart"}, linux) == ["nvidia-cublas", "nvidia-cuda-runtime"]
    assert names(TOOLKIT_META, {""}, linux) == []


def _resolve(pages: dict[str, list[str]], metas: dict[str, str], present, target, roots=("torch==2.13.0",)):
    asked = []

    def links(name):
        asked.append(name)
        return _links(*pages.get(name, []))

    picks = resolve([Requirement(r) for r in roots], present=present, target=target, links=links,
                    metadata=lambda p: metas.get(p.name, f"Name: {p.name}\n"))
    return [(p.name, p.version) for p in picks], asked


LINUX_PAGES = {
    "torch": ["torch-2.13.0+cu130-cp313-cp313-manylinux_2_28_x86_64.whl",
              "torch-2.13.0+cu130-cp313-cp313-win_amd64.whl"],
    "cuda-toolkit": ["cuda_toolkit-13.0.3.0-py2.py3-none-any.whl", "cuda_toolkit-13.1.0.0-py2.py3-none-any.whl"],
    "nvidia-cudnn-cu13": ["nvidia_cudnn_cu13-9.20.0.48-py3-none-manylinux_2_27_x86_64.whl"],
    "nvidia-cublas": ["nvidia_cublas-13.1.1.3-py3-none-manylinux_2_27_x86_64.whl",
                      "nvidia_cublas-13.2.0.1-py3-none-manylinux_2_27_x86_64.whl"],
    "nvidia-cuda-runtime": ["nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"],
    "triton": ["triton-3.7.1-cp313-cp313-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"],
}


def test_resolving_the_linux_cuda_build_brings_the_nvidia_wheels_it_lacks():
    target = Target.for_platform("manylinux_2_28_x86_64", "3.13")
    metas = {"torch": LINUX_TORCH_META, "cuda-toolkit": TOOLKIT_META, "nvidia-cudnn-cu13": CUDNN_META}
    present = {"filelock": Version("3.20"), "typing-extensions": None, "torch": Version("2.13.0+cpu")}
    picks, asked = _resolve(LINUX_PAGES, metas, present, target)
    assert picks == [("torch", "2.13.0+cu130"), ("cuda-toolkit", "13.0.3.0"), ("nvidia-cudnn-cu13", "9.20.0.48"),
                     ("triton", "3.7.1"), ("nvidia-cublas", "13.1.1.3"), ("nvidia-cuda-runtime", "13.0.96")]
    assert "filelock" not in asked and "typing-extensions" not in asked and "optree" not in asked
    # an old filelock in the shipped environment is not enough, so a newer one comes along
    metas["torch"] = LINUX_TORCH_META.replace("Requires-Dist: filelock\n", "Requires-Dist: filelock>=4\n")
    with pytest.raises(NotFound, match="no filelock >=4 .*needed by torch"):
        _resolve(LINUX_PAGES, metas, present, target)


def test_on_windows_the_cuda_build_comes_alone():
    picks, asked = _resolve(LINUX_PAGES, {"torch": LINUX_TORCH_META}, {"filelock": None, "typing-extensions": None},
                            Target.for_platform("win_amd64", "3.13"))
    assert picks == [("torch", "2.13.0+cu130")] and asked == ["torch"]


def test_resolving_refuses_conflicts_unhashed_files_and_names_what_is_missing():
    target = Target.for_platform("manylinux_2_28_x86_64", "3.13")
    conflict = {"torch": "Name: torch\nRequires-Dist: a\nRequires-Dist: b\n", "b": "Name: b\nRequires-Dist: a<1\n"}
    pages = {"torch": LINUX_PAGES["torch"], "a": ["a-1.0-py3-none-any.whl"], "b": ["b-1.0-py3-none-any.whl"]}
    with pytest.raises(ResolveError, match=r"a<1 \(needed by b\) conflicts with a 1.0"):
        _resolve(pages, conflict, {}, target)
    with pytest.raises(NotFound, match="no CUDA build of torch ==2.14.0 for cp313 manylinux_2_28_x86_64") as e:
        _resolve(pages, {}, {}, target, roots=("torch==2.14.0",))
    assert e.value.name == "torch"

    def unhashed(name):
        return [Link(n, f"https://i/{n}", None) for n in LINUX_PAGES.get(name, [])]

    with pytest.raises(ResolveError, match="without a sha256 hash"):
        resolve([Requirement("torch==2.13.0")], present={}, target=target, links=unhashed,
                metadata=lambda p: "Name: torch\n")


def test_wheel_members_cannot_leave_their_folder(tmp_path):
    assert _member_path(tmp_path, "torch/__init__.py") == tmp_path / "torch" / "__init__.py"
    assert _member_path(tmp_path, "torch-2.13.0.data/purelib/torch/x.py") == tmp_path / "torch" / "x.py"
    assert _member_path(tmp_path, "torch-2.13.0.data/scripts/torchrun") is None
    for bad in ("../evil.py", "torch/../../evil.py", "/etc/passwd", "C:/evil.py", "torch\\..\\..\\evil.py"):
        with pytest.raises(GpuEnableError, match="refusing"):
            _member_path(tmp_path, bad)


def test_a_wheel_that_escapes_is_refused_and_nothing_changes(home, tmp_path):
    w = torch_wheel(tmp_path / "w", requires=[])
    import zipfile

    with zipfile.ZipFile(w, "a") as z:
        z.writestr("../../escaped.py", "print('no')\n")
    with SimpleIndex() as ix:
        ix.add(w)
        with pytest.raises(GpuEnableError, match="refusing a wheel member named '../../escaped.py'"):
            ge.enable(ix.url, extras=[])
    assert not list(tmp_path.rglob("escaped.py"))
    assert not (home / "gpu" / "site.new").exists() and not (home / "gpu" / "ACTIVE").exists()


def test_indexes_must_be_https_beyond_this_computer(home):
    with pytest.raises(GpuEnableError, match="must be https"):
        ge.enable("http://download.example.org/whl/cu130", extras=[])
    assert not (home / "gpu" / "site").exists()


def test_one_install_at_a_time(home, index):
    gdir = home / "gpu"
    gdir.mkdir()
    with ge._Lock(gdir):
        with pytest.raises(GpuEnableError, match="another Potluck is installing"):
            ge.enable(index.url, extras=[])
    assert not (gdir / "site").exists() and not (gdir / "downloads").exists()
