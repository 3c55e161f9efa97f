"""A stage's compute profile: how long a decode step of n rows and a prefill of n
tokens take on its machine, as curves of measured points. The link scheduler predicts
its windows from it and the head sizes its micro-batches from everyone's. Measuring
one is the model layer's job (engine/model/measure.py); here are the curves, their
validation when they come off the wire, and how they follow the steps in service."""

from __future__ import annotations

import statistics

PROFILE_CONTEXT = 8  # tokens a decode probe's rows attend to, a few more in the smaller batches (measure.py; bench/simulator.py reads it)


def interp(points: list, n: float) -> float:
    """Piecewise-linear in n through measured (n, seconds); linear beyond the ends."""
    pts = sorted((float(a), float(b)) for a, b in points)
    if not pts:
        return 0.0
    if len(pts) == 1:
        return pts[0][1] * max(n, 1) / max(pts[0][0], 1)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if n <= x1 or (x1, y1) == pts[-1]:
            return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))
    return pts[-1][1]


def scaled(profile: dict, factor: float) -> dict:
    """The profile of the same machine holding `factor` times as many layers: a step's
    time grows with the layers it runs. What a stage that takes over a friend's layers
    starts from instead of profiling again; its steps in service correct it (StepLog)."""
    return {name: [[n, min(MAX_STEP_SECONDS, s * factor)] for n, s in curve] for name, curve in profile.items()}


# ---- the profile in service -----------------------------------------------------------
# A startup profile is a snapshot: probes of 8-token contexts on a freshly loaded stage,
# timed alone on the machine. In service the same steps attend to hundreds of tokens,
# share the machine, and the machine itself drifts. One bench/weaklink.py FIFO cell
# (2 stages at ~60 Mbit/s-equivalent, this 2-core machine) ran its 1- and 2-row steps
# from a fifth to well over half slower in service than its startup profile said (see
# bench/RESULTS.md); every decision taken from the snapshot was taken for a faster machine.
# So each stage keeps timing its own steps and its profile follows what it measures.
MAX_POINTS = 32          # points per curve a peer may send (we send 6 and 2)
MAX_STEP_SECONDS = 3600.0


def check_profile(p) -> dict:
    """A profile from the network: {"decode": [[n, s]..], "prefill": [[n, s]..]}, each
    curve 1..MAX_POINTS points of a positive whole n and a finite time in [0, an hour].
    Raises ValueError; returns it unchanged."""
    if not isinstance(p, dict) or set(p) != {"decode", "prefill"}:
        raise ValueError("a profile has exactly the curves 'decode' and 'prefill'")
    for name, curve in p.items():
        if not isinstance(curve, list) or not 1 <= len(curve) <= MAX_POINTS:
            raise ValueError(f"profile curve {name!r} must hold 1..{MAX_POINTS} points")
        for pt in curve:
            if not (isinstance(pt, list) and len(pt) == 2):
                raise ValueError(f"profile curve {name!r}: each point is [n, seconds]")
            n, s = pt
            if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= 1 << 20:
                raise ValueError(f"profile curve {name!r}: n must be a positive whole number")
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= MAX_STEP_SECONDS:
                raise ValueError(f"profile curve {name!r}: seconds must be a number in [0, 3600]")
    return p


class StepLog:
    """A stage's step times in service, and the profile they make. Pure: fed
    (kind, n, seconds), it answers a profile with the startup one's points.

    A decode point with enough steps of exactly its row count takes their median;
    the others are the startup value times the median ratio of all recent decode
    steps to what the startup curve predicted for them (so 5- and 6-row steps move
    the 4- and 8-row points too). Prefill likewise, by ratio. Medians over a window
    of recent steps: one step that met a page fault or a neighbour's burst moves
    nothing."""

    def __init__(self, startup: dict, window: int = 32, min_steps: int = 3):
        self.startup = {k: [list(pt) for pt in v] for k, v in startup.items()}
        self.window = window
        self.min_steps = min_steps
        self._points = {n for n, _ in self.startup.get("decode", [])}
        self._exact: dict[int, list[float]] = {}
        self._ratio: dict[str, list[float]] = {"decode": [], "prefill": []}
        self.steps = 0

    def observe(self, kind: str, n: int, seconds: float) -> None:
        curve = self.startup.get(kind)
        if not curve or n <= 0 or not 0 <= seconds <= MAX_STEP_SECONDS:
            return
        predicted = interp(curve, n)
        if predicted > 0:
            self._push(self._ratio[kind], seconds / predicted)
        if kind == "decode" and n in self._points:
            self._push(self._exact.setdefault(n, []), seconds)
        self.steps += 1

    def _push(self, xs: list, x: float) -> None:
        xs.append(x)
        if len(xs) > self.window:
            del xs[0]

    def profile(self) -> dict:
        out = {}
        for kind, curve in self.startup.items():
            ratios = self._ratio.get(kind, [])
            scale = statistics.median(ratios) if len(ratios) >= self.min_steps else 1.0
            pts = []
            for n, s in curve:
                own = self._exact.get(n, []) if kind == "decode" else []
                pts.append([n, statistics.median(own) if len(own) >= self.min_steps else s * scale])
            out[kind] = pts
        return out


def differs(a: dict, b: dict, rel: float = 0.05) -> bool:
    """Whether any point of profile a is more than `rel` off b's (or the points differ)."""
    for kind in set(a) | set(b):
        pa, pb = a.get(kind, []), b.get(kind, [])
        if [n for n, _ in pa] != [n for n, _ in pb]:
            return True
        for (_, x), (_, y) in zip(pa, pb):
            if abs(x - y) > rel * max(abs(y), 1e-9):
                return True
    return False
