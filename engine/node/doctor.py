"""`potluck doctor`: can this machine compute on its GPU, can friends reach it, and if
not, what to do.

The facts come from NVML (is there an NVIDIA GPU and driver: node/gpu.py) and from torch
(is this a CUDA build, does it see the GPU); `advise` turns them into plain words and is
pure, so each case is tested without a GPU. The network's facts come from gathering a
host's candidates once (engine/wire/candidates.py: a trial port mapping on the router,
removed at once, and STUN), and `advise_network` says what they mean for joining across
homes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

# PyTorch's own package index for CUDA builds; the suffix is the CUDA version
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"


@dataclass
class Facts:
    gpus: list[str]              # NVIDIA GPUs NVML sees, by name
    nvml_why: str | None         # why NVML sees none (no driver, no library)
    torch_version: str
    torch_cuda: str | None       # the CUDA version torch was built for (None: a CPU build)
    cuda_available: bool         # torch can use a GPU now
    device: str                  # what `--device auto` picks


def gather() -> Facts:
    import torch

    from engine.model.device import pick_device
    from engine.node.gpu import read_gpus

    readings, why = read_gpus()
    return Facts([g.name for g in readings], why, torch.__version__.split("+")[0], torch.version.cuda,
                 torch.cuda.is_available(), pick_device("auto"))


def advise(f: Facts) -> tuple[bool, list[str]]:
    """(whether the GPU is used or there is none to use, what to tell the user)."""
    lines = [f"torch {f.torch_version} ({'CUDA ' + f.torch_cuda if f.torch_cuda else 'CPU build'})",
             f"NVIDIA GPUs: {', '.join(f.gpus) if f.gpus else 'none found (' + (f.nvml_why or 'no driver') + ')'}",
             f"--device auto computes on: {f.device}"]
    if not f.gpus:
        if f.cuda_available:      # a GPU torch sees without NVML (no nvidia-ml-py): it is used
            return True, lines + ["ok: computing on the GPU (install nvidia-ml-py for the tray's GPU readings)"]
        return True, lines + ["ok: no NVIDIA GPU here, so Potluck computes on the CPU"]
    if f.cuda_available:
        return True, lines + ["ok: computing on the GPU"] + more_gpus(f)
    if not f.torch_cuda:
        return False, lines + [
            "this torch is a CPU build, so your GPU sits idle. Install the CUDA build into Potluck's "
            "environment (about 2.5 GB):",
            f"  .venv/bin/pip install --force-reinstall 'torch=={f.torch_version}' --index-url {TORCH_CUDA_INDEX}",
            "  (cu128 = CUDA 12.8: pick the index of a CUDA version your driver supports; `nvidia-smi` shows "
            "the newest it supports, top right)"]
    return False, lines + [
        f"this torch is built for CUDA {f.torch_cuda} but cannot use the GPU: the NVIDIA driver is "
        "probably older than that CUDA version needs. Update the driver (`nvidia-smi` shows the CUDA "
        "version it supports), or install a torch built for an older CUDA, then run `potluck doctor` again"]


def more_gpus(f: Facts) -> list[str]:
    """A machine with several GPUs: each process computes on one (`auto` takes the first),
    so the others sit idle unless a stage is started on them: say how (a second stage
    process on loopback that the head is given, or a second share for a friend)."""
    if len(f.gpus) < 2:
        return []
    others = "the second" if len(f.gpus) == 2 else "another (cuda:1 below; cuda:2 and on likewise)"
    return [f"this computer has {len(f.gpus)} GPUs and each Potluck process computes on one, so only "
            f"{f.device} is used. To add {others} to the same model, start a stage on it and give its "
            "address to the head:",
            "  potluck stage --device cuda:1 --port 7860",
            "  potluck serve --stage-addr ws://127.0.0.1:7860      (or chat, or host)",
            "  (or lend it to a friend: potluck join CODE --device cuda:1)"]


@dataclass
class NetFacts:
    lan: list[str] = field(default_factory=list)      # private IPv4 addresses
    ipv6: list[str] = field(default_factory=list)     # global IPv6 addresses
    mapped: str | None = None                         # the trial mapping the router granted
    mapping_why: str = ""                             # why there was none
    nat: str = "unknown"                              # stun.nat_behaviour
    public: str | None = None                         # the public address STUN servers saw
    stun_servers: int = 0                             # how many were asked
    mapping_how: str = ""                             # UPnP-IGD, PCP or NAT-PMP: what the router speaks


async def gather_network(port: int | None = None) -> NetFacts:
    import secrets

    from engine.wire import candidates, stun

    # the trial asks for a port nobody uses: asking for a host's own (7870) would update
    # its live mapping, and removing the trial would then remove that
    port = port or 20000 + secrets.randbelow(30000)

    mapper = candidates.PortMapper(description="Potluck doctor (a trial, removed at once)", lease_s=120)
    try:
        g = await candidates.gather(port, upnp=True, mapper=mapper)
    finally:
        await mapper.close()
    ext = g.mapping.external
    return NetFacts([c.url for c in g.candidates if c.kind == "lan"], [c.url for c in g.candidates if c.kind == "ipv6"],
                    candidates.url_for(*ext) if ext else None, g.mapping.why_not, g.nat, g.public,
                    len(stun.servers_from_env()), g.mapping.how)


def _hosts(urls: list[str]) -> list[str]:
    return list(dict.fromkeys(urlsplit(u).hostname or u for u in urls))


def advise_network(n: NetFacts) -> list[str]:
    # the addresses alone: their port is the trial's, not the one a host listens on
    lan, ipv6 = _hosts(n.lan), _hosts(n.ipv6)
    lines = [f"LAN: {', '.join(lan) if lan else 'no private IPv4 address'}",
             f"IPv6: {', '.join(ipv6) if ipv6 else 'no global IPv6 address'}"]
    if n.mapped:
        trial = urlsplit(n.mapped)
        lines.append(f"router port mapping ({n.mapping_how or 'UPnP'}): granted (a trial of port {trial.port} on "
                     f"{trial.hostname}, removed at once): friends in other "
                     "homes can join you directly, with no relay")
    else:
        lines.append(f"router port mapping (UPnP, PCP, NAT-PMP): none -- {n.mapping_why}. Friends in other "
                     "homes reach you "
                     "by a punched hole where both NATs allow it (below), else need a relay, or a port you "
                     "forward by hand on your router (then give --advertise)")
    if not n.stun_servers:
        lines.append("NAT: not checked (no STUN servers: POTLUCK_STUN is empty)")
    elif n.nat == "unknown" and n.public is None:
        lines.append("NAT: unknown (no STUN server answered: offline, or UDP blocked)")
    else:
        meaning = {"open": "no NAT in front of this computer: friends reach it directly",
                   "endpoint-independent": "a friendly NAT: one mapping serves every peer, so hole "
                                           "punching works with a friend whose NAT is not symmetric",
                   "symmetric": "a strict NAT (a new port for each peer): no hole punching; direct paths "
                                "need a mapping or your friend's side to be reachable, else the relay",
                   "unknown": "only one STUN server answered"}[n.nat]
        lines.append(f"NAT: {n.nat} ({meaning}); public address {n.public}")
    return lines


def main(network: bool = True) -> int:
    ok, lines = advise(gather())
    print("\n".join(lines))
    if network:
        import asyncio

        print("\n".join(advise_network(asyncio.run(gather_network()))))
    return 0 if ok else 1
