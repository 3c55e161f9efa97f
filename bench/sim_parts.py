"""What bench/simulator.py simulates: the requests (a seeded workload shaped like the
Azure conversation trace), the policies the head runs, speculation's settings, the
pipeline (profiles, links, the busy receiver's hold) and a step's compute time from a
stage's profile. bench/sim_events.py runs them on its simulated clock."""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.core.profile import PROFILE_CONTEXT, interp  # noqa: E402
from engine.core.speculation import SpecConfig  # noqa: E402

# ---- workload ---------------------------------------------------------------------------
# Lengths shaped like the Azure LLM inference trace's conversation requests as MoLink uses
# it (prompts broad, median ~1k tokens, many under 500; outputs mostly under 200), with
# its filter: prompts over 2048 and outputs over 1024 tokens are dropped (redrawn here).
IN_MEDIAN, IN_SIGMA, IN_MAX = 900, 0.8, 2048
OUT_MEDIAN, OUT_SIGMA, OUT_MAX = 130, 1.0, 1024


def _lognormal(rng: random.Random, median: float, sigma: float, hi: int) -> int:
    while True:
        x = round(rng.lognormvariate(math.log(median), sigma))
        if 1 <= x <= hi:
            return x


def workload(rate: float, n: int, seed: int = 0, scale: float = 1.0) -> list[tuple[float, int, int]]:
    """n requests as (arrival time s, prompt tokens, output tokens): Poisson arrivals at
    `rate` requests/s; `scale` multiplies both lengths (e.g. 0.25 for a CPU-sized run).
    The same (rate, n, seed, scale) gives the same requests everywhere."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        n_in = _lognormal(rng, IN_MEDIAN, IN_SIGMA, IN_MAX)
        n_out = _lognormal(rng, OUT_MEDIAN, OUT_SIGMA, OUT_MAX)
        out.append((t, max(1, round(n_in * scale)), max(1, round(n_out * scale))))
    return out


# ---- what is simulated ------------------------------------------------------------------
@dataclass(frozen=True)
class Policy:
    link: str = "jit"                 # LinkScheduler mode: fifo | fixed | jit
    prompt_chunk: int | str | None = 64  # the head streams prompts in chunks of this many tokens
                                         # ("auto": engine/core/prompt_chunk.py's)
    dynamic: bool = False             # K from microbatch.choose (else fixed) ...
    micro_batches: int | None = None  # ... the fixed K (None: the number of stages)
    compress: str = "off"             # engine/core/compression.py policy: off | auto | prefill | all
    cut_in: bool = False              # decode steps cut into prompt steps (Head compute="decode-first")


POLICIES = {
    "fifo": Policy("fifo", prompt_chunk=None),        # whole volumes, first come first served
    "fifo-chunk": Policy("fifo"),                     # ... of prompts computed in 64-token chunks
    "fixed": Policy("fixed"),                         # decode first, fixed prefill chunks (20 ms of link)
    "jit": Policy("jit"),                             # decode first, just-in-time chunks
    "dynamic": Policy("jit", dynamic=True),           # ... and K in M..2M
    "compress": Policy("jit", dynamic=True, compress="auto"),
    "cut-in": Policy("jit", dynamic=True, cut_in=True),   # dynamic, and decode steps cut into prompt steps
}


@dataclass(frozen=True)
class Spec:
    """Speculative decoding on the simulated head (issue 34), decided by the engine's own
    engine/core/speculation.py SpecPolicy, fed the simulated clock's measurements as head.py
    feeds it the wall clock's: each decode row's k from k_for (capped so no row drafts past
    its n_out), a round drafting k carries 1 + k tokens and is charged as 1 + k decode rows
    (T_d of the step's decode tokens: the weights are read once), the host drafts k tokens
    for `draft` seconds each on the head's compute before the step, and the number that
    stand is drawn per round from a seeded truncated geometric (each drafted token stands
    with probability `accept`, given the ones before it stood; at most k). The round emits
    that many + 1 tokens; the rejected ones' KV is rolled back (nothing to simulate: the
    position advances by what stood)."""
    accept: float                       # per-token acceptance of the draft
    draft: float = 0.0                  # host seconds per drafted token
    seed: int = 0
    config: SpecConfig | None = None    # the policy's settings (None: SpecConfig())
    k: int | None = None                # draft this many every round instead of asking the policy

    def __post_init__(self):
        if not 0.0 <= self.accept <= 1.0 or self.draft < 0.0 or (self.k is not None and self.k < 0):
            raise ValueError(f"speculation settings out of range: {self}")


# bench/weaklink.py's names; its "defaults" cell speculates, which --validate does not
# model, so that cell is predicted as +auto-chunk's and may read slower than measured
ALIASES = {"fifo+c64": "fifo-chunk", "jit+dyn": "dynamic", "+auto-chunk": "dynamic", "defaults": "dynamic",
           "+cut-in": "cut-in", "+compress": "compress"}


@dataclass
class Pipeline:
    profiles: list[dict]              # per stage, head first: {"decode": [[rows, s]..], "prefill": [[tokens, s]..]}
    bandwidth: float                  # bytes/s of every stage's uplink
    delay: float                      # one-way seconds
    hidden_bytes: int                 # activation bytes per token per hop
    dtype_bytes: int = 2              # bytes per activation value (compression's ratio)
    kv_capacity: int = 1 << 18        # tokens of KV the pipeline holds (min over stages)
    max_batch: int = 32
    piece: int | None = None          # LinkSender's piece and in-flight floor in bytes
    min_in_flight: int | None = None  # (None: they follow the measured bandwidth, as live)
    n_wait: int = 30
    warm: bool = True                 # links start with their bandwidth and RTT measured
    cores: int | None = None          # compute threads share this many cores (None: a machine each)
    contention: float = 0.0           # slowdown per extra step running at once (shared memory bus)
    ctx_cost: float = 0.0             # decode cost of context (engine.core.profile.context_cost; 0: ignored)
    ack_hold: float = 0.0             # s a receiver's loop takes to acknowledge a piece (a busy CPU) ...
    hold_pongs: bool = True           # ... and to answer a ping, as the live loop does (False: an RTT
                                      # figure that leaves the hold out)
    hold_from: float = 0.0            # s into the run the hold begins (a friend starts a game)
    work_profiles: list[dict] | None = None  # what steps take, if not what `profiles` (the head's
                                             # and schedulers' view) say: see validate()

    @property
    def n_stages(self) -> int:
        return len(self.profiles)

    def hold_at(self, now: float) -> float:
        return self.ack_hold if now >= self.hold_from else 0.0


# wire overheads (bytes): frame header, per row in the meta, a new sequence's prompt ids
# and sampling parameters in the meta, a CHUNK frame's own header per piece
FRAME_HEADER, ROW_META, PROMPT_META, NEW_META, PIECE_HEADER = 64, 20, 6, 120, 80


class Curve:
    """engine.core.profile.interp through a profile's points, remembered per n (it is called a lot)."""

    def __init__(self, points: list):
        self.points, self._memo = points, {}

    def __call__(self, n: float) -> float:
        t = self._memo.get(n)
        if t is None:
            t = self._memo[n] = interp(self.points, n)
        return t


def decode_row(s, n: int) -> bool:
    """A decode row: one token, or (speculation) the last token and the k drafted after it."""
    return n == 1 or (n == getattr(s, "drafted", 0) + 1)


def step_time(decode: Curve, prefill: Curve, rows: list, ctx_cost: float = 0.0) -> float:
    """A step's compute as the stage runs it (StageModel._step): decode rows and prompt
    rows go as two sub-batches one after the other, prompt rows left-padded to the
    longest of them; a verification row of 1 + k tokens counts as 1 + k decode rows
    (speculation: the step reads the weights once). The decode profile was taken at a context of PROFILE_CONTEXT
    tokens; each decode row's longer context adds ctx_cost (engine.core.profile.context_cost)
    of a 1-row step per token."""
    n_decode = sum(n for s, n in rows if decode_row(s, n))
    prompts = [n for s, n in rows if not decode_row(s, n)]
    t = decode(n_decode) if n_decode else 0.0
    if ctx_cost and n_decode:
        extra = sum(n * max(0, s.n_in + s.generated - PROFILE_CONTEXT) for s, n in rows if decode_row(s, n))
        t += ctx_cost * decode(1) * extra
    if prompts:
        t += prefill(len(prompts) * max(prompts))
    return t

