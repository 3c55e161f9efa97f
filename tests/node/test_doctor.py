"""`potluck doctor` (engine/node/doctor.py): what a GPU owner is told, case by case."""

import subprocess
import sys
from pathlib import Path

from engine.node.doctor import TORCH_CUDA_INDEX, Facts, advise

ROOT = Path(__file__).resolve().parents[2]


def facts(**over):
    base = dict(gpus=["NVIDIA GeForce RTX 3090"], nvml_why=None, torch_version="2.13.0", torch_cuda=None,
                cuda_available=False, device="cpu")
    return Facts(**{**base, **over})


def test_a_cpu_build_of_torch_beside_an_nvidia_gpu_gets_the_install_line():
    ok, lines = advise(facts())
    text = "\n".join(lines)
    assert not ok and "CPU build" in text and "RTX 3090" in text
    assert f"pip install --force-reinstall 'torch==2.13.0' --index-url {TORCH_CUDA_INDEX}" in text


def test_a_cuda_build_that_cannot_use_the_gpu_points_at_the_driver():
    ok, lines = advise(facts(torch_cuda="12.8"))
    assert not ok and "driver" in lines[-1] and "12.8" in lines[-1]


def test_a_working_gpu_and_a_machine_without_one_are_both_fine():
    ok, lines = advise(facts(torch_cuda="12.8", cuda_available=True, device="cuda:0"))
    assert ok and lines[-1].startswith("ok: computing on the GPU") and "cuda:0" in lines[2]
    ok, lines = advise(facts(gpus=[], nvml_why="NVML: NVMLError_LibraryNotFound"))
    assert ok and "computes on the CPU" in lines[-1] and "LibraryNotFound" in lines[1]


def test_a_second_gpu_is_said_with_how_to_add_it_to_the_model():
    # each process computes on one GPU: the second would sit idle without a word
    two = facts(gpus=["NVIDIA GeForce RTX 3090"] * 2, torch_cuda="12.8", cuda_available=True, device="cuda:0")
    ok, lines = advise(two)
    text = "\n".join(lines)
    assert ok and "2 GPUs" in text and "only cuda:0 is used" in text
    assert "potluck stage --device cuda:1" in text and "--stage-addr ws://127.0.0.1:7860" in text
    ok, lines = advise(facts(torch_cuda="12.8", cuda_available=True, device="cuda:0"))
    assert ok and "GPUs and each" not in "\n".join(lines)


def test_the_command_runs_here():
    out = subprocess.run([sys.executable, "-m", "engine", "doctor"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "--device auto computes on: cpu" in out.stdout


def test_the_network_advice_says_what_the_router_and_nat_mean_for_friends():
    from engine.node.doctor import NetFacts, advise_network

    granted = "\n".join(advise_network(NetFacts(lan=["ws://192.168.1.5:7870"], mapped="ws://81.2.69.160:7870",
                                                nat="endpoint-independent", public="81.2.69.160", stun_servers=3)))
    assert "granted (a trial of port 7870 on 81.2.69.160, removed at once)" in granted and "no relay" in granted
    # the trial's port is no port a host uses: the addresses alone
    assert "LAN: 192.168.1.5\n" in granted and ":7870" not in granted
    assert "friendly NAT" in granted and "no global IPv6" in granted
    refused = "\n".join(advise_network(NetFacts(mapping_why="no UPnP router answered", nat="symmetric",
                                                public="81.2.69.160", stun_servers=3)))
    assert "no UPnP router answered" in refused and "relay" in refused and "forward" in refused
    assert "strict NAT" in refused
    offline = "\n".join(advise_network(NetFacts(stun_servers=2)))
    assert "no STUN server answered" in offline
    assert "not checked" in "\n".join(advise_network(NetFacts()))
