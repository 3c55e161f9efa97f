"""Loading a stage's next slice ahead, while the pipeline serves (a stage's "prepare").

When the head takes a machine in, the split changes for everyone: the newcomer needs its
whole share, and the stages after the head shift down, each gaining a few layers it does
not hold. Loaded during the rearrangement, those reads paused every conversation. So the
head first asks each machine to load what its next slice lacks, while the pipeline goes
on, and the rearrangement after keeps it all (engine/model/handover.py).

  * a machine not serving (the newcomer; one back from sleep with its old slice):
    build_alone builds and measures the whole slice on its compute thread, as configure
    would, with room for no conversation yet; configure then takes its layers and its
    profile, so nobody waits for the measuring either;
  * a stage serving now: build_beside loads only the layers it lacks, on a thread of its
    own beside the steps, when its memory has room for them beside the slice it serves
    (else they load during the rearrangement, as before).
"""

from __future__ import annotations

from engine.core.precision import slice_bytes
from engine.core.profile import scaled
from engine.model.device import free_memory, kv_bytes_per_token
from engine.model.handover import HeldLayers, missing_pieces, not_held
from engine.model.measure import load_and_measure
from engine.model.sources import ModelError
from engine.model.stage import StageModel

# what a stage loading beside the one it serves leaves free of its device's memory: the
# serving stage's cache grows into it meanwhile
BESIDE_HEADROOM = 0.8


def build_alone(checked, msg: dict, held: HeldLayers | None, device, cores, progress):
    """The whole slice [start, end) built and measured (`held`: what the machine's old
    stage kept). Returns (the stage, (its profile, its layers, how it was built))."""
    start, end = msg["start"], msg["end"]
    stage, prof = load_and_measure(lambda: StageModel(
        checked.source, start, end, dtype=checked.dtype, device=device, reuse=held, kv_budget_tokens=0,
        progress=progress, cores=cores, weights=msg["weights"]))
    return stage, (prof, end - start, built_as(checked.fingerprint, msg))


def build_beside(checked, msg: dict, serving, device, memory_cap: int | None, progress,
                 held: HeldLayers | None = None, spare: bool = False) -> HeldLayers | None:
    """The layers of [start, end) that the stage `serving` lacks, and that it does not hold
    beside it already (`held`: loaded ahead before), built while it serves; None when it
    lacks none. Raises ModelError when they do not fit beside it. spare: they stay for as
    long as the arrangement does (engine/core/spares.py), so they leave the serving stage's
    cache the room its budget promised (a take-in's are gone at the configure that follows;
    until then the cache grows into BESIDE_HEADROOM's share)."""
    pieces = not_held(missing_pieces((serving.start, serving.end), (msg["start"], msg["end"])), held)
    if not pieces:
        return None
    need = sum(slice_bytes(checked.cfg, a, b, msg["weights"], checked.dtype.itemsize) for a, b in pieces)
    promised = cache_to_come(serving, checked.cfg) if spare else 0
    room = free_memory(device) * BESIDE_HEADROOM - promised
    if memory_cap is not None:
        room = min(room, memory_cap - serving.held_bytes() - promised - (held.nbytes() if held is not None else 0))
    if need > room:
        raise ModelError(f"no room for {need / 2**20:.0f} MiB more beside the layers it serves: "
                         "they load during the rearrangement")
    held = None
    for a, b in pieces:
        part = StageModel(checked.source, a, b, dtype=checked.dtype, device=device, kv_budget_tokens=0,
                          progress=progress, weights=msg["weights"], serving=False).hand_over()
        held = part if held is None else held.merge(part)
    return held


def cache_to_come(serving, cfg) -> int:
    """Bytes the serving stage's cache may still grow by: its budget was promised to the
    conversations it admits (a GPU's cache grows as replies need it), so layers held
    beside it (spare layers stay for as long as the arrangement does) must not take them."""
    kv = serving.kv
    per_token = kv_bytes_per_token(cfg, (serving.start, serving.end), kv.dtype)
    return max(0, kv.budget_tokens * per_token - kv.allocated_bytes())


def built_as(fingerprint: str, msg: dict) -> tuple:
    return (fingerprint, msg["dtype"], msg["weights"])


def ahead_profile(ahead: tuple | None, fingerprint: str, msg: dict) -> dict | None:
    """The profile build_alone measured, scaled to the slice configure asks for, when it
    was built alike: measuring again would pause every conversation."""
    if ahead is None or ahead[2] != built_as(fingerprint, msg):
        return None
    return scaled(ahead[0], (msg["end"] - msg["start"]) / max(1, ahead[1]))
