"""The one-process head's steps launched ahead on its stage (engine/core/ahead.py).

Only the head's compute thread touches this: it launches a step's plainly continuing
rows' next position behind the step's draw, and the next step takes what it can of it.
On by default where a step returns before it is done (a GPU); POTLUCK_LAUNCH_AHEAD=0
turns it off, =1 turns it on anywhere (the CPU tests: there a step is done when it
returns, so launching ahead gains nothing, but every reply must be the one without it).
"""

from __future__ import annotations

import logging
import os

import torch

from engine.core.ahead import AheadRow, launchable, split
from engine.model.device import to_device
from engine.model.stage import StageBatch

log = logging.getLogger("potluck.head")


def wanted(device: str) -> bool:
    """Whether a head on `device` launches ahead (POTLUCK_LAUNCH_AHEAD: 0 never, 1 always)."""
    env = os.environ.get("POTLUCK_LAUNCH_AHEAD", "")
    if env in ("0", "1"):
        return env == "1"
    return str(device).startswith("cuda")


class StepsAhead:
    def __init__(self, stage):
        self.stage = stage
        self.epoch = None
        self.rows: list[AheadRow] = []
        self.logits: torch.Tensor | None = None
        self._pending: list[tuple[int, int]] = []   # (seq_id, start) launched, its token not yet read
        self.launched = 0     # rows launched ahead
        self.taken = 0        # of them, rows a step took
        self.dropped = 0      # rows no step took (finished, cancelled, replayed)

    def forward(self, batch: StageBatch, x: torch.Tensor, epoch) -> torch.Tensor:
        """The step's logits as stage.forward returns them, its rows' first positions
        taken from what was launched ahead where they match."""
        ahead, logits = self.rows, self.logits
        self.rows, self.logits = [], None
        if self._pending:   # launched, but the step's tokens were never read (its draw failed)
            self._roll_back([AheadRow(sid, start, -1) for sid, start in self._pending])
            self._pending = []
        if not ahead:
            return self.stage.forward(batch, x)
        if epoch != self.epoch:
            self._roll_back(ahead)     # a rearrangement began since: its replay starts over
            return self.stage.forward(batch, x)
        offsets = [0]
        for n in batch.ns:
            offsets.append(offsets[-1] + n)
        firsts = x[torch.tensor(offsets[:-1], dtype=torch.long)].tolist() if batch.ns else []
        sp = split(ahead, batch.seq_ids, batch.starts, batch.ns, firsts, batch.keep)
        self._roll_back(sp.drop)
        self.taken += len(ahead) - len(sp.drop)
        rest_out = None
        if sp.rest:
            keeps = [r.keep for r in sp.rest]
            rest = StageBatch([batch.seq_ids[r.row] for r in sp.rest], [r.start for r in sp.rest],
                              [r.n for r in sp.rest], keeps if any(k != 1 for k in keeps) else None)
            xs = torch.cat([x[offsets[r.row + 1] - r.n: offsets[r.row + 1]] for r in sp.rest])
            rest_out = self.stage.forward(rest, xs)
            kept = batch.kept
            for r in sp.rest:
                if sp.done[r.row] is not None:
                    # a draft checked behind its launched position: every one of its tokens
                    # is a guess (the stage counts a step's first token as certain)
                    self.stage.kv.seqs[batch.seq_ids[r.row]].tentative = kept[r.row] - 1
        if not sp.rest and all(sp.use_logits) and sp.done == list(range(len(ahead))):
            return logits   # the whole step was launched ahead, row for row
        parts, o = [], 0
        rest_rows = {r.row: r for r in sp.rest}
        for r in range(len(batch.seq_ids)):
            i = sp.done[r]
            if i is not None and sp.use_logits[r]:
                parts.append(logits[i: i + 1])
            left = rest_rows.get(r)
            if left is not None:
                parts.append(rest_out[o: o + left.keep])
                o += left.keep
        return torch.cat(parts)

    def launch(self, batch: StageBatch, goes_on: list[bool], epoch):
        """sampler.step's `ahead`: queue the continuing rows' next position behind the
        draw, their inputs the drawn tokens on the device (None: nothing to launch)."""
        rows = launchable(batch.starts, batch.ns, batch.keep, goes_on)
        if not rows:
            return None

        def go(tokens: torch.Tensor) -> None:
            idx = [r for r, _ in rows]
            toks = tokens if len(idx) == tokens.shape[0] else tokens[to_device(idx, torch.long, tokens.device)]
            nxt = StageBatch([batch.seq_ids[r] for r in idx], [s for _, s in rows], [1] * len(idx))
            try:
                self.logits = self.stage.forward(nxt, toks)
            except Exception as exc:   # the step the head builds next computes it (and says why, if it fails)
                log.debug("a step launched ahead failed: %r", exc)
                self._roll_back([AheadRow(sid, s, -1) for sid, s in zip(nxt.seq_ids, nxt.starts)])
                return
            self._pending = list(zip(nxt.seq_ids, nxt.starts))
            self.epoch = epoch
            self.launched += len(rows)

        return go

    def read(self, entries: list[list]) -> None:
        """The step's tokens are on the host: the positions launched ahead know theirs."""
        if not self._pending:
            return
        tok = {e[0]: e[1] for e in entries}
        self.rows = [AheadRow(sid, start, tok[sid]) for sid, start in self._pending if sid in tok]
        self._pending = []

    def forget(self, seq_ids) -> None:
        """These sequences ended, or were taken over by a new request and cut back
        (kept_replies.py): what was launched ahead for them is void."""
        gone = set(seq_ids)
        self._roll_back([a for a in self.rows if a.seq_id in gone]
                        + [AheadRow(sid, start, -1) for sid, start in self._pending if sid in gone])
        self._pending = [(sid, start) for sid, start in self._pending if sid not in gone]
        stay = [i for i, a in enumerate(self.rows) if a.seq_id not in gone]
        if len(stay) < len(self.rows):
            # rows and logits go together, row i's logits at i
            self.logits = self.logits[stay] if self.logits is not None and stay else None
            self.rows = [self.rows[i] for i in stay]

    def _roll_back(self, rows) -> None:
        kv = self.stage.kv
        for a in rows:
            self.dropped += 1
            if kv.has(a.seq_id) and kv.length(a.seq_id) == a.start + 1:
                kv.truncate(a.seq_id, a.start)
