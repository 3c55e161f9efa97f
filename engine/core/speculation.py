"""How many tokens to draft per sequence (issue 34): speculation only where it pays.

Between homes a decode step is a trip round the ring; a draft of k tokens checked in
that one trip (engine/core/spec_verify.py) emits 1 to k + 1 tokens for the price of one
trip plus the draft's and the verification's extra work. Whether that pays depends on
numbers only the running system knows, so SpecPolicy is a plain object fed
measurements (the head on the wall clock, bench/simulator.py on a simulated one) that
answers k per sequence, 0 meaning a plain decode step.

The model. With a per-token acceptance a (each drafted token stands with probability a,
given the ones before it stood), a round drafting k tokens emits
    E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)     (k + 1 when a = 1)
tokens and takes
    T(k) = trip + n * k * (draft + verify_extra)
where trip is a measured plain decode step (wire and compute, the whole ring), draft the
host's seconds per drafted token, verify_extra how much longer a step is per extra token
it carries (where steps of two or more sizes have been timed, a line through them
instead: `verify_cost`, since on a CPU the first extra token costs most), and n the
active sequences: the host drafts for every one of them and every
stage computes everyone's extra tokens, so with n sequences sharing the pipeline each
one's k lengthens the round n sharers wait on (n = 1 alone). k is the argmax of
E(k) / T(k) over 0..k_max, and 0 unless it beats a plain step by `margin` (5%): measured
numbers are noisy, and a gain inside the noise is not worth the rollbacks and the
host's work. On a fast link the trip is mostly compute, an extra token costs nearly a
step, and this gives 0; across homes the trip is mostly wire and k grows.

Drafted ahead: with a draft model, the host drafts on while a verification is in flight
(engine/pipeline/head.py, issue 34 item 4), so a round may find its first `free` guesses
already made. Those cost the round only their verification:
    T(k) = trip + n * (k * verify_extra + max(0, k - free) * draft)
so a round takes what the chain holds and pays for more only where that still pays.

Drafting ahead costs the host something too (a core, and the interpreter it shares
with its own stage), so it only runs where a trip has time for at least two drafted
positions and those would make a round pay (`ahead_pays`). A position's time is kept per
load (active sequences): a burst's tail drafts several rows a position beside busier
stages, which says nothing of the lone user after it.

Busy: above `busy_above` active sequences (4), or with as many micro-batches in flight
as there are stages (every stage has work queued), speculation is off for everyone. Active
means every sequence the pipeline holds (set_load), in every micro-batch, not the rows
of the step being built: a step of one row among four busy micro-batches is a busy
pipeline. The
micro-batches (DESIGN.md) already fill the ring's bubbles then, the stages are
compute-bound, and rejected draft tokens are compute taken from other people's tokens:
throughput matters more than one person's latency, and the n-scaled cost above
understates that once the pipeline has no idle time left to hide extra work in.

Acceptance is estimated per sequence from what its rounds did: a round that drafted k
and kept n is n successes and, if n < k, one failure (the tokens after a rejection were
never tested, so kept / drafted would understate a). The counts decay by `memory` per
round (0.9: the last ten-odd rounds weigh most, as a reply moves between prose and
quoting) over a Beta prior of mean `prior_accept` (0.5) and weight `prior_weight` (2
tokens): a new sequence starts optimistic enough to try, and its own rounds take over
within a few trips.

Re-probe: a sequence turned off by low acceptance sends no evidence, so it would stay
off; if speculation would pay at a good acceptance (`probe_accept`, 0.8) it drafts k = 1
once every `reprobe_every` (16) rounds, and a change of content (the reply starts
quoting code) turns it back on.

Start gently: until a verification step has been timed (verify_extra) and a draft
(draft), k is at most 1. An unmeasured cost would count as free, and free extra tokens
make the largest k look best: the first rounds would send k_max drafted tokens through
every stage before anyone knew what one costs. One drafted token measures both.

Pure and deterministic: no clock, no I/O, the same measurements give the same answers.
k_for counts rounds for the re-probe, so call it once per decode round of a sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def expected_tokens(a: float, k: int) -> float:
    """Tokens a round drafting k emits when each drafted token stands with probability a
    (given the ones before it stood): the accepted prefix plus the target's own token."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def round_time(k: int, trip: float, draft: float, verify_extra, sharers: int = 1, free: int = 0) -> float:
    """Seconds of a round drafting k: a plain trip plus the verification of k extra tokens
    and the drafting of those not drafted ahead (beyond `free`), for each of the
    `sharers` active sequences. verify_extra: seconds per extra token, or a function of
    a step's extra tokens giving their seconds (SpecPolicy.verify_cost)."""
    verify = verify_extra(sharers * k) if callable(verify_extra) else sharers * k * verify_extra
    return trip + verify + sharers * max(0, k - free) * draft


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least squares a + b*k through (k, seconds), both kept >= 0 (an extra token never
    saves time)."""
    n = len(points)
    mk = sum(points) / n
    me = sum(points.values()) / n
    var = sum((k - mk) ** 2 for k in points)
    b = max(0.0, sum((k - mk) * (e - me) for k, e in points.items()) / var) if var else 0.0
    a = me - b * mk
    if a < 0.0:   # through the origin instead
        a, b = 0.0, sum(k * e for k, e in points.items()) / sum(k * k for k in points)
    return a, max(0.0, b)


def best_k(a: float, trip: float, draft: float, verify_extra, k_max: int,
           sharers: int = 1, margin: float = 0.05, free: int = 0) -> int:
    """The k in 0..k_max with the most tokens per second, or 0 when that does not beat a
    plain step by the margin (ties: the smaller k)."""
    plain = 1.0 / trip
    best, best_rate = 0, plain
    for k in range(1, k_max + 1):
        rate = expected_tokens(a, k) / round_time(k, trip, draft, verify_extra, sharers, free)
        if rate > best_rate:
            best, best_rate = k, rate
    return best if best_rate >= plain * (1.0 + margin) else 0


@dataclass(frozen=True)
class SpecConfig:
    k_max: int = 8               # drafted tokens per round at most (the step's extra rows)
    margin: float = 0.05         # a k > 0 must beat a plain step by this fraction
    busy_above: int = 4          # active sequences above which speculation is off
    prior_accept: float = 0.5    # acceptance a new sequence is assumed to have ...
    prior_weight: float = 2.0    # ... worth this many tokens of evidence
    memory: float = 0.9          # the evidence's decay per observed round
    smoothing: float = 0.2       # weight of a new timing measurement (EWMA)
    reprobe_every: int = 16      # rounds between k = 1 probes of a sequence turned off
    probe_accept: float = 0.8    # probe only where speculation would pay at this acceptance

    def __post_init__(self):
        if self.k_max < 0 or self.busy_above < 1 or self.reprobe_every < 1:
            raise ValueError("k_max >= 0, busy_above >= 1 and reprobe_every >= 1")
        if not (0.0 < self.prior_accept < 1.0 and self.prior_weight > 0.0 and 0.0 < self.memory <= 1.0
                and 0.0 < self.smoothing <= 1.0 and 0.0 < self.probe_accept <= 1.0 and self.margin >= 0.0):
            raise ValueError(f"speculation settings out of range: {self}")


@dataclass
class _Seq:
    hits: float = 0.0       # decayed drafted tokens that stood
    misses: float = 0.0     # decayed rejections (at most one per round)
    rounds: int = 0         # trips observed (plain ones too)
    proposed: int = 0
    accepted: int = 0
    idle: int = 0           # rounds since it last drafted, while off for low acceptance
    k: int = 0              # the last answer


class SpecPolicy:
    def __init__(self, config: SpecConfig | None = None):
        self.config = config or SpecConfig()
        self._seqs: dict[int, _Seq] = {}
        # measurements, smoothed; None until the first. While the draft or the verification
        # is unmeasured, k is at most 1 (start gently): the first rounds that draft measure them.
        self.trip: float | None = None      # seconds of a plain decode step, head to head
        self._draft: float | None = None    # seconds per drafted token
        self._verify: float | None = None   # seconds per extra token in a step
        self._verify_by_k: dict[int, float] = {}   # a step's extra tokens -> the seconds they add
        # seconds per position drafted ahead, by the active sequences then (_load_key): a
        # burst's last few users draft several rows a position beside busier stages, and
        # their timing must not turn drafting ahead off for the one person after them
        self._ahead: dict[int, float] = {}
        self.active = 1
        self.full = False
        # totals over every sequence since start, the dropped ones too (status)
        self._rounds = self._tokens = self._proposed = self._accepted = 0

    # ---- measurements ---------------------------------------------------------------------
    def observe_round(self, seq_id: int, proposed: int, accepted: int) -> None:
        """One trip of a sequence: `proposed` tokens drafted (0 for a plain step), the first
        `accepted` of them stood; the round emitted accepted + 1 tokens."""
        if not (0 <= accepted <= proposed):
            raise ValueError(f"accepted {accepted} of {proposed} proposed")
        s = self._seqs.setdefault(seq_id, _Seq())
        s.rounds += 1
        s.proposed += proposed
        s.accepted += accepted
        self._rounds += 1
        self._tokens += accepted + 1
        self._proposed += proposed
        self._accepted += accepted
        if proposed:
            m = self.config.memory
            s.hits = s.hits * m + accepted
            s.misses = s.misses * m + (accepted < proposed)

    def observe_trip(self, seconds: float) -> None:
        """A plain decode step's round trip, head to head: the links and every stage's compute."""
        if seconds > 0.0 and math.isfinite(seconds):
            self.trip = self._smooth(self.trip, seconds)

    def observe_draft(self, seconds_per_token: float) -> None:
        if seconds_per_token >= 0.0 and math.isfinite(seconds_per_token):
            self._draft = self._smooth(self._draft, seconds_per_token)

    def observe_verify_extra(self, seconds_per_extra_token: float, k: int | None = None) -> None:
        """(step time with k + 1 tokens - with 1) / k. A noisy difference of two timings
        can come out negative: read as free, not as a gain. With k (the step's extra
        tokens, all its sequences') it also goes to that k's own estimate: what an extra
        token costs need not be the same for the first and the eighth (verify_cost)."""
        if math.isfinite(seconds_per_extra_token):
            per = max(0.0, seconds_per_extra_token)
            self._verify = self._smooth(self._verify, per)
            if k is not None and k >= 1:
                self._verify_by_k[k] = self._smooth(self._verify_by_k.get(k), per * k)

    def verify_cost(self, k: int) -> float:
        """Seconds a step's k extra tokens add to it. On a GPU they are nearly free (the
        weights are read once for every row); on one CPU thread the second row costs as
        much as the next six (a matrix-vector product becomes a small matrix product): a
        line through what steps of each k measured, where two or more k have been seen;
        else k times the per-token estimate."""
        if k <= 0:
            return 0.0
        if k in self._verify_by_k:
            return self._verify_by_k[k]
        if len(self._verify_by_k) < 2:
            return k * self.verify_extra
        fixed, per = fit_line(self._verify_by_k)
        return fixed + per * k

    def set_load(self, active_sequences: int, full: bool = False) -> None:
        """Every sequence the pipeline now holds (all micro-batches), for the busy cut-off
        and the n sharing each round; `full`: its micro-batches keep every stage busy
        (as many in flight as stages), so there is no idle time for extra tokens to hide in."""
        self.active = max(1, int(active_sequences))
        self.full = bool(full)

    def drop(self, seq_id: int) -> None:
        """A sequence finished or was cancelled: forget it (the totals keep its rounds)."""
        self._seqs.pop(seq_id, None)

    def _smooth(self, old: float | None, new: float) -> float:
        if old is None:
            return new
        w = self.config.smoothing
        return (1.0 - w) * old + w * new

    @property
    def draft(self) -> float:
        return self._draft or 0.0

    @property
    def verify_extra(self) -> float:
        return self._verify or 0.0

    @property
    def measured(self) -> bool:
        """Whether a draft and a verification have both been timed (until then k <= 1)."""
        return self._draft is not None and self._verify is not None

    # ---- decisions ------------------------------------------------------------------------
    def acceptance(self, seq_id: int) -> float:
        """The estimated per-token acceptance of a sequence (the prior's mean if unseen)."""
        c = self.config
        s = self._seqs.get(seq_id) or _Seq()
        return (c.prior_accept * c.prior_weight + s.hits) / (c.prior_weight + s.hits + s.misses)

    @property
    def busy(self) -> bool:
        """More sequences than speculation serves: nobody drafts (nor drafts ahead)."""
        return self.active > self.config.busy_above or self.full

    def observe_ahead(self, seconds_per_position: float) -> None:
        """How long a position drafted ahead took (while the trip was in flight, beside
        whatever else the host computed then): how many guesses a trip has time for, at
        the present load."""
        if seconds_per_position > 0.0 and math.isfinite(seconds_per_position):
            key = self._load_key()
            self._ahead[key] = self._smooth(self._ahead.get(key), seconds_per_position)

    def _load_key(self) -> int:
        return min(self.active, self.config.busy_above)

    def ahead_pays(self, seq_id: int, untried: bool = True) -> bool:
        """Whether drafting ahead during this sequence's trips is worth its cost: the
        guesses a trip has time for (one position of them goes on the target's own next
        token) must make a round worth drafting. It is not free -- the draft model's
        thread takes a core and the host's interpreter from the stage it computes
        beside -- so where a trip is hardly longer than a drafted position (a fast link)
        nobody drafts ahead. Untimed at this load, it is tried (`untried`; False: not
        until it is timed -- for work too dear to try it with, a prompt's prefill)."""
        c = self.config
        if self.trip is None or self.busy or c.k_max == 0:
            return False
        ahead = self._ahead.get(self._load_key())
        if ahead is None:   # untried at this load: try it (its first runs time it)
            if not untried:
                return False
            free = c.k_max
        else:
            free = min(c.k_max, int(self.trip / max(ahead, 1e-6)) - 1)
        if free < 1:
            return False
        return best_k(self.acceptance(seq_id), self.trip, self.draft, self.verify_cost, c.k_max,
                      self.active, c.margin, free) > 0

    def k_for(self, seq_id: int, free: int = 0) -> int:
        """Tokens to draft for this sequence's next round (0: a plain step), `free` of them
        drafted ahead already. Once per round."""
        s = self._seqs.setdefault(seq_id, _Seq())
        s.k = self._choose(s, seq_id, max(0, free))
        return s.k

    def _choose(self, s: _Seq, seq_id: int, free: int) -> int:
        c = self.config
        if self.trip is None or c.k_max == 0 or self.busy:
            s.idle = 0
            return 0

        def pick(a: float) -> int:
            return best_k(a, self.trip, self.draft, self.verify_cost, c.k_max, self.active, c.margin, free)

        k = pick(self.acceptance(seq_id))
        if k:
            s.idle = 0
            return k if self.measured else 1
        if not pick(c.probe_accept):
            s.idle = 0          # off whatever the acceptance: the link or the load, not the content
            return 0
        s.idle += 1
        if s.idle >= c.reprobe_every:
            s.idle = 0
            return 1
        return 0

    # ---- status ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """For status and the chat window: tokens per trip and acceptance (kept / drafted),
        overall and per live sequence, and the measurements the decisions use."""
        def ratio(x: int, y: int) -> float | None:
            return x / y if y else None

        return {
            "tokens_per_trip": ratio(self._tokens, self._rounds),
            "acceptance": ratio(self._accepted, self._proposed),
            "rounds": self._rounds,
            "trip": self.trip, "draft": self.draft, "verify_extra": self.verify_extra, "measured": self.measured,
            "verify_by_k": dict(sorted(self._verify_by_k.items())),
            "ahead": self._ahead.get(self._load_key()), "ahead_by_load": dict(sorted(self._ahead.items())),
            "active": self.active,
            "sequences": {
                sid: {"k": s.k, "acceptance": ratio(s.accepted, s.proposed),
                      "estimate": self.acceptance(sid),
                      "tokens_per_trip": ratio(s.rounds + s.accepted, s.rounds), "rounds": s.rounds}
                for sid, s in self._seqs.items()},
        }


# Below this many tokens a pass, guessing ahead has made no visible difference: a person
# is not told about it (the status JSON keeps the figures)
SAID_FROM = 1.1


def describe(info: dict | None) -> str:
    """'guessing ahead: 2.4 tokens a pass through the model, 71% of guesses right' (and
    the draft model, when one guesses) from Head.info()["speculation"], for status and the
    chat window, in people's words (a pass: one round of the pipeline, every stage once,
    which a person waits for); '' where speculation has not run (off, or nothing drafted yet)."""
    if not info or info.get("mode") == "off" or not info.get("acceptance") or not info.get("tokens_per_trip"):
        return ""   # off, nothing drafted yet, or no guess right so far: nothing it explains
    if info["tokens_per_trip"] < SAID_FROM:
        return ""   # "1.0 tokens a pass, 2% right" read as a fault, and explains no speed
    draft = info.get("draft")
    by = f" ({draft})" if draft and draft != "prompt lookup" else ""
    return (f"guessing ahead{by}: {info['tokens_per_trip']:.1f} tokens a pass through the model, "
            f"{info['acceptance']:.0%} of guesses right")
