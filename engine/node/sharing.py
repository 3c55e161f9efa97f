"""Being a good guest on a friend's GPU: when sharing must pause, as a pure object.

`SharePolicy.evaluate()` is fed a GPU reading (gpu.py), the PIDs that are Potluck's
own, the owner's idle time and a clock; it answers whether sharing may run now and,
if not, why in words the owner understands. No I/O, no NVML: the node's loop does the
reading and the draining; tests feed readings by hand.

Limits (all optional):
- VRAM cap: Potluck's own processes may use at most this many MB; above it, pause.
- Temperature: pause at or above `temp_pause_c`, resume only once it has fallen to
  `temp_resume_c` (hysteresis: a GPU hovering at the limit does not flap).
- Another heavy GPU process (a game): pause while another process holds more than
  `other_process_mb` of VRAM; resume `other_grace_s` after it is gone.
- Only when idle: run only when the owner has been idle `idle_after_s` or longer
  (an unknown idle time counts as "not idle": we cannot tell, so we stay polite).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields


def _finite_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


@dataclass
class Limits:
    vram_cap_mb: float | None = None
    temp_pause_c: float | None = 83.0
    temp_resume_c: float | None = 75.0
    pause_for_other_processes: bool = True
    other_process_mb: float = 1024.0
    other_grace_s: float = 30.0
    only_when_idle: bool = False
    idle_after_s: float = 300.0

    def validate(self) -> "Limits":
        for f in fields(self):   # a wrong type said as such ("'<=' not supported" said nothing)
            v, optional = getattr(self, f.name), "None" in str(f.type)
            if isinstance(f.default, bool):
                if not isinstance(v, bool):
                    raise ValueError(f"{f.name} must be true or false")
            elif not (v is None and optional) and not _finite_number(v):
                raise ValueError(f"{f.name} must be a number" + (" (or empty)" if optional else ""))
        if self.vram_cap_mb is not None and self.vram_cap_mb <= 0:
            raise ValueError("the VRAM cap must be positive (or empty for no cap)")
        if (self.temp_pause_c is None) != (self.temp_resume_c is None):
            raise ValueError("set both the pause and the resume temperature, or neither")
        if self.temp_pause_c is not None and self.temp_resume_c >= self.temp_pause_c:
            raise ValueError("the resume temperature must be below the pause temperature")
        if self.other_process_mb < 0 or self.other_grace_s < 0 or self.idle_after_s < 0:
            raise ValueError("thresholds must not be negative")
        return self

    @classmethod
    def from_json(cls, d: dict | None) -> "Limits":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in names}).validate()

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Decision:
    paused: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


class SharePolicy:
    def __init__(self, limits: Limits | None = None):
        self.limits = (limits or Limits()).validate()
        self._hot = False                       # temperature hysteresis state
        self._other_seen_at: float | None = None

    def evaluate(self, reading, own_pids: set[int], idle_seconds: float | None, now: float) -> Decision:
        """reading: a gpu.GpuReading or None (no NVIDIA GPU: only the idle rule applies)."""
        lim = self.limits
        reasons = []
        if reading is not None:
            if lim.temp_pause_c is not None:
                if self._hot:
                    self._hot = reading.temperature_c > lim.temp_resume_c
                else:
                    self._hot = reading.temperature_c >= lim.temp_pause_c
                if self._hot:
                    reasons.append(f"the GPU is hot ({reading.temperature_c:.0f} °C); sharing resumes at "
                                   f"{lim.temp_resume_c:.0f} °C")
            own_mb = sum(p.memory_mb for p in reading.processes if p.pid in own_pids)
            if lim.vram_cap_mb is not None and own_mb > lim.vram_cap_mb:
                reasons.append(f"Potluck uses {own_mb:.0f} MB of GPU memory, more than the {lim.vram_cap_mb:.0f} MB "
                               "you allowed in Settings")
            if lim.pause_for_other_processes:
                heavy = [p for p in reading.processes
                         if p.pid not in own_pids and p.memory_mb >= lim.other_process_mb]
                if heavy:
                    self._other_seen_at = now
                    # a process id is no help to the person who reads this
                    reasons.append("another program is using the GPU heavily")
                elif self._other_seen_at is not None and now - self._other_seen_at < lim.other_grace_s:
                    left = lim.other_grace_s - (now - self._other_seen_at)
                    reasons.append(f"another program used the GPU until just now; resuming in {left:.0f} s")
        if lim.only_when_idle:
            if idle_seconds is None:
                reasons.append("sharing only while you are away, and this computer cannot tell")
            elif idle_seconds < lim.idle_after_s:
                reasons.append("sharing only while you are away")
        return Decision(bool(reasons), reasons)

    def vram_allowance_mb(self, reading, own_pids: set[int]) -> float | None:
        """How much VRAM Potluck may plan for: free memory, within the cap."""
        if reading is None:
            return None
        others = sum(p.memory_mb for p in reading.processes if p.pid not in own_pids)
        room = reading.memory_total_mb - others
        return room if self.limits.vram_cap_mb is None else min(room, self.limits.vram_cap_mb)
