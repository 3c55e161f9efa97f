"""A one-process head's next step, launched before this step's tokens are read (issue 42).

On a GPU a step returns once its kernels are queued. The head then reads the step's
tokens (a wait for the GPU), streams them, schedules and builds the next step, and only
then queues it: all that while the GPU is idle, at one user most of a millisecond a
token on an H200 (bench/RESULTS.md, 2026-12-04). A row that plainly goes on takes as its
next input exactly the token this step draws, and that token is on the device before
the host reads it. So the head queues those rows' next position right behind the draw,
its input the drawn tokens where they are, and reads the tokens after: the GPU computes
the next step while the host does its part (SGLang's and vLLM's overlapped scheduling,
in our terms).

What the next step holds is still the head's to decide, as before: a row may have
finished (its position computed ahead is dropped: rolled back if it is still cached),
a request may have joined (computed as usual), a row may bring a draft to check (its
first position is the one computed ahead; the draft is computed after it). This module
is that matching, pure: fed the rows launched ahead and the step the head built, it says
which positions are done, what is left to compute, and what to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class AheadRow:
    """A row's position computed ahead: `token` went in at `start`."""
    seq_id: int
    start: int
    token: int


@dataclass(frozen=True)
class Rest:
    """What is left of a step's row i to compute: n tokens from start, keep logits."""
    row: int
    start: int
    n: int
    keep: int


@dataclass
class Split:
    done: list[int | None]     # per row of the step: the ahead row whose logits are its first position's
    use_logits: list[bool]     # per row: whether those logits are among what the row returns
    rest: list[Rest]           # what the stage still computes, in row order
    drop: list[AheadRow]       # positions computed ahead that no row took (roll back if still cached)


def split(ahead: Sequence[AheadRow], seq_ids: Sequence[int], starts: Sequence[int], ns: Sequence[int],
          first_tokens: Sequence[int], keep: Sequence[int] | None = None) -> Split:
    """Match a step's rows with the positions computed ahead.

    A row takes its ahead position when it starts where that did, with the token that
    went in there (anything else -- a replay after failover, a rollback -- is computed
    as the head built it). A taken row's first position is done: it returns the ahead
    logits if it wants its first position's (a plain decode row, or a verification that
    keeps every position), and the rest of its tokens, if any, are computed after it."""
    by_seq = {a.seq_id: (i, a) for i, a in enumerate(ahead)}
    done: list[int | None] = []
    use: list[bool] = []
    rest: list[Rest] = []
    taken: set[int] = set()
    for r, (sid, start, n, first) in enumerate(zip(seq_ids, starts, ns, first_tokens)):
        kept = keep[r] if keep is not None else 1
        hit = by_seq.get(sid)
        if hit is None or hit[1].start != start or hit[1].token != first or n < 1:
            done.append(None)
            use.append(False)
            rest.append(Rest(r, start, n, kept))
            continue
        i, _ = hit
        taken.add(i)
        done.append(i)
        use.append(kept == n)
        if n > 1:
            rest.append(Rest(r, start + 1, n - 1, min(kept, n - 1)))
    drop = [a for i, a in enumerate(ahead) if i not in taken]
    return Split(done, use, rest, drop)


def launchable(starts: Sequence[int], ns: Sequence[int], keep: Sequence[int] | None,
               goes_on: Sequence[bool]) -> list[tuple[int, int]]:
    """The rows of a step whose next position can be launched ahead, as (row, start):
    rows the head expects to go on (not at their token limit or the context's end) whose
    step draws one token. After a verification the next position depends on how much of
    the draft stands, which only the host learns."""
    out = []
    for r, (start, n, more) in enumerate(zip(starts, ns, goes_on)):
        kept = keep[r] if keep is not None else 1
        if more and kept == 1:
            out.append((r, start + n))
    return out
