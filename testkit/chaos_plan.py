"""The chaos run's decisions, with no I/O: which faults, when and on whom (a seeded
schedule), what each client request is, whether every outcome was right (the checker),
and how much each process grew. testkit/chaos.py carries them out on emulated homes.

    episodes = schedule(seed=7, seconds=300, friends=2)      # what to break, in order
    verdict = check(reference, outcomes)                      # every request's outcome judged
    growth = grew(samples, warmup_s=60)                       # RSS, descriptors per process

Why a checker and not a smoke test: a pipeline that "survives" faults could still answer
a request twice, shorten a reply and call it finished, or hang a client forever; each of
those is an outcome a person would see, so each is counted (after Jepsen: record every
operation, judge them all afterwards).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# what can happen to a home during an evening (Chaos Mesh's kinds, in a home's words)
KINDS = (
    "kill",         # a friend's node dies at once (SIGKILL): the app crashed, the PC lost power
    "freeze",       # a friend's node and its stage stop (SIGSTOP) 2-60 s: a laptop asleep
    "cut",          # a friend's home drops every packet 2-60 s: the Wi-Fi or the line went
    "slow",         # a friend's uplink collapses to 1 Mbit/s and comes back: someone uploads
    "relay",        # the relay restarts
    "nat_flush",    # a router forgets its NAT state (a reboot): new public ports mid-session
    "share",        # a friend switches sharing off, then on again
    "host_restart",  # the host's node is restarted (the app quit and opened again)
)
# several at once: two faults together, and a second one while the first is recovered from
COMBOS = ("two", "during_recovery")
FRIEND_KINDS = ("kill", "freeze", "cut", "slow", "share", "nat_flush")


@dataclass(frozen=True)
class Fault:
    kind: str
    target: int          # the home: 0 the host's, 1.. a friend's
    duration_s: float    # how long it lasts before it is undone (0: a one-off)


@dataclass(frozen=True)
class Episode:
    """One disturbance: its faults start together, or (during_recovery) the second once the
    host is recovering from the first."""
    name: str
    faults: tuple[Fault, ...]
    after_recovery_starts: bool = False
    calm_s: float = 10.0     # quiet time after the pipeline is whole again


def _fault(rng: random.Random, kind: str, friends: int, short: bool) -> Fault:
    friend = rng.randint(1, friends)
    hi = 20.0 if short else 60.0
    if kind in ("freeze", "cut"):
        return Fault(kind, friend, round(rng.uniform(2.0, hi), 1))
    if kind in ("slow", "share"):
        return Fault(kind, friend, round(rng.uniform(5.0, hi), 1))
    if kind == "kill":
        return Fault(kind, friend, round(rng.uniform(2.0, 10.0), 1))   # until it is started again
    if kind == "nat_flush":
        return Fault(kind, rng.randint(0, friends), 0.0)
    if kind == "relay":
        return Fault(kind, -1, round(rng.uniform(1.0, 5.0), 1))
    if kind == "host_restart":
        return Fault(kind, 0, 0.0)
    raise ValueError(f"unknown fault kind {kind!r}")


def schedule(seed: int, seconds: float, friends: int = 2, kinds=KINDS + COMBOS, short: bool = False,
             mean_s: float = 40.0) -> list[Episode]:
    """Episodes for a run of `seconds`, drawn from `seed`: every kind comes once (in a
    shuffled order) before any comes again, so a short run still sees each. mean_s: the
    time one episode is expected to take with its recovery, to size the list; the
    runner stops drawing when its time is up."""
    rng = random.Random(seed)
    out: list[Episode] = []
    n = max(len(kinds), int(seconds / mean_s) + 1)
    bag: list[str] = []
    while len(out) < n:
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        name = bag.pop()
        calm = round(rng.uniform(5.0, 20.0), 1)
        if name == "two":
            a, b = rng.sample(FRIEND_KINDS, 2)
            fa = _fault(rng, a, friends, short)
            fb = _fault(rng, b, friends, short)
            if friends > 1 and fb.target == fa.target and b != "nat_flush":
                fb = Fault(fb.kind, 1 + (fa.target % friends), fb.duration_s)
            out.append(Episode("two", (fa, fb), calm_s=calm))
        elif name == "during_recovery":
            first = _fault(rng, "kill", friends, short)
            other = 1 + (first.target % friends) if friends > 1 else first.target
            second = Fault(rng.choice(("freeze", "cut", "kill")), other, round(rng.uniform(3.0, 15.0), 1))
            out.append(Episode("during_recovery", (first, second), after_recovery_starts=True, calm_s=calm))
        else:
            out.append(Episode(name, (_fault(rng, name, friends, short),), calm_s=calm))
    return out


# ---- the clients' requests ----------------------------------------------------------
LONG_TEXT = ("The history of the city goes back many centuries. Merchants came from far away to trade "
             "salt, cloth and spices, and the river carried their boats to the sea. ")
PROMPTS = ("What is the capital of France?", "Name three colours of the rainbow.",
           "Write one sentence about the sea.", "What do bees make?", "Say hello to my friend Ana.",
           "How many legs does a spider have?")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@dataclass(frozen=True)
class Request:
    key: str             # the same key is the same request: its reply must be the same
    kind: str            # chat (streamed, greedy), seeded (n=2, sampled with a seed), tool, long
    body: dict = field(hash=False, compare=False)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def requests() -> list[Request]:
    """The pool the clients draw from: each one's undisturbed reply is the reference."""
    out = []
    for i, p in enumerate(PROMPTS):
        out.append(Request(f"chat{i}", "chat", {"messages": [{"role": "user", "content": p}], "temperature": 0,
                                                "max_tokens": 32, "stream": True}))
    for i, p in enumerate(PROMPTS[:3]):
        out.append(Request(f"seeded{i}", "seeded", {"messages": [{"role": "user", "content": p}], "n": 2,
                                                    "temperature": 0.9, "seed": 1000 + i, "max_tokens": 24}))
    for i, city in enumerate(("Paris", "Lisbon")):
        out.append(Request(f"tool{i}", "tool", {
            "messages": [{"role": "user", "content": f"What is the weather in {city}?"}],
            "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "temperature": 0, "max_tokens": 40, "stream": True}))
    for i in range(2):
        text = LONG_TEXT * (22 + 3 * i) + "Summarise this in one sentence."
        out.append(Request(f"long{i}", "long", {"messages": [{"role": "user", "content": text}], "temperature": 0,
                                                "max_tokens": 16, "stream": True}))
    return out


# ---- the checker --------------------------------------------------------------------
OK, WRONG, FAILED, LOST = "ok", "wrong", "failed", "lost"


def answer(outcome: dict) -> tuple | None:
    """What a completed outcome answered, comparable across runs: each choice's text,
    tool calls and finish reason, in choice order."""
    choices = outcome.get("choices")
    if not choices:
        return None
    return tuple((c.get("text", ""), c.get("tool_calls") or "", c.get("finish_reason")) for c in choices)


def judge(outcome: dict, reference: tuple | None) -> tuple[str, str]:
    """One request's verdict and why: ok, wrong (a completed reply that differs from the
    undisturbed one: shortened, changed or doubled), failed (it ended with an error that
    says why), lost (no outcome by its deadline, an error with no reason, answered twice)."""
    status = outcome.get("status")
    if status == "hang":
        return LOST, f"no answer within {outcome.get('deadline_s')} s"
    if outcome.get("dupes"):
        return LOST, f"answered twice: {outcome['dupes']}"
    if status == "error":
        why = (outcome.get("error") or "").strip()
        return (FAILED, why) if why else (LOST, "an error with no reason")
    if status != "done":
        return LOST, f"unknown status {status!r}"
    got = answer(outcome)
    if got is None or any(c[2] not in ("stop", "length", "tool_calls") for c in got):
        return WRONG, f"finished without a finish reason: {got}"
    if reference is None:
        return WRONG, "no undisturbed reply to compare with"
    if got != reference:
        return WRONG, f"differs from the undisturbed reply: {got!r} vs {reference!r}"
    return OK, ""


def check(reference: dict[str, tuple], outcomes: list[dict]) -> dict:
    """Every outcome judged: counts by verdict and by request kind, failures by reason
    (first words), and the wrong and lost ones in full."""
    counts = {OK: 0, WRONG: 0, FAILED: 0, LOST: 0}
    by_kind: dict[str, dict[str, int]] = {}
    reasons: dict[str, int] = {}
    bad = []
    for o in outcomes:
        verdict, why = judge(o, reference.get(o.get("key")))
        counts[verdict] += 1
        by_kind.setdefault(o.get("kind", "?"), {OK: 0, WRONG: 0, FAILED: 0, LOST: 0})[verdict] += 1
        if verdict == FAILED:
            reasons[_reason(why)] = reasons.get(_reason(why), 0) + 1
        elif verdict != OK:
            bad.append({"id": o.get("id"), "key": o.get("key"), "verdict": verdict, "why": why[:500],
                        "t0": o.get("t0")})
    stalls = [o for o in outcomes if o.get("status") == "done" and o.get("max_gap_s")]
    worst = max(stalls, key=lambda o: o["max_gap_s"], default={})
    return {"counts": counts, "by_kind": by_kind, "reasons": reasons, "bad": bad,
            "worst_stall_s": worst.get("max_gap_s") or 0.0, "worst_stall_at": worst.get("gap_at")}


def _reason(why: str) -> str:
    return " ".join(why.split()[:8])[:80]


# ---- per-process growth -------------------------------------------------------------
def _slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (0 for fewer than two points)."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def grew(samples: list[dict], warmup_s: float, min_life_s: float = 0.0, born: dict[int, float] | None = None
         ) -> list[dict]:
    """Per process (by pid): its first sample after warm-up against its last and its
    largest, for RSS, descriptors and threads. samples: {t, pid, role, rss, fds, threads,
    children}; t counts from the run's start. Warm-up counts from the run's start and,
    for a process started later (again, after a fault), from when it was first seen
    (born: pid -> t, default its first sample here): until then its growth is its
    loading. Processes sampled for under min_life_s after their warm-up are left out."""
    by_pid: dict[int, list[dict]] = {}
    born = dict(born or {})
    for s in samples:
        born[s["pid"]] = min(born.get(s["pid"], s["t"]), s["t"])
    for s in samples:
        if s["t"] >= max(warmup_s, born[s["pid"]] + warmup_s if born[s["pid"]] > 0 else warmup_s):
            by_pid.setdefault(s["pid"], []).append(s)
    out = []
    for pid, ss in by_pid.items():
        ss.sort(key=lambda s: s["t"])
        first, last = ss[0], ss[-1]
        if last["t"] - first["t"] < min_life_s:
            continue
        peak = max(s["rss"] for s in ss)
        # a node holding more layers at the end than at the start (a rearrangement) grew
        # by their weights: what it says it holds is taken off, what is left is its own
        held = (last.get("held") or 0) - (first.get("held") or 0)
        own = [s["rss"] - (s.get("held") or 0) for s in ss]
        # a leak climbs from window to window; one quiet moment against another swings by
        # whatever the allocator kept that time: the first third's median against the last's
        k = max(1, len(ss) // 3)
        early, late = sorted(own[:k])[(k - 1) // 2], sorted(own[-k:])[(k - 1) // 2]
        out.append({"pid": pid, "role": first["role"], "life_s": round(last["t"] - first["t"], 1),
                    "rss_mb": round(first["rss"] / 2**20, 1), "rss_last_mb": round(last["rss"] / 2**20, 1),
                    "rss_growth": round(last["rss"] / first["rss"] - 1.0, 4) if first["rss"] else 0.0,
                    "rss_peak_growth": round(peak / first["rss"] - 1.0, 4) if first["rss"] else 0.0,
                    "rss_own_growth": round((last["rss"] - first["rss"] - held) / first["rss"], 4)
                    if first["rss"] else 0.0,
                    "rss_window_growth": round((late - early) / first["rss"], 4) if first["rss"] else 0.0,
                    "rss_trend_mb_h": round(_slope([s["t"] for s in ss], own) * 3600 / 2**20, 1),
                    "samples": len(ss),
                    "layers": [first.get("layers"), last.get("layers")],
                    "held_mb": [round((first.get("held") or 0) / 2**20), round((last.get("held") or 0) / 2**20)],
                    "fds": first["fds"], "fds_last": last["fds"], "fds_max": max(s["fds"] for s in ss),
                    "threads": first["threads"], "threads_last": last["threads"],
                    "children": first["children"], "children_last": last["children"]})
    out.sort(key=lambda r: r["role"])
    return out
