"""The head's spare layers (SpareLayers, a mixin of Head): after each formation, every
machine loads beside its slice the layers a stage's loss would give it, so that a stage
lost without notice costs no loading (the decisions: engine/core/spares.py).

They load once the pipeline is idle (or SPARE_WAIT_S after it formed, if it never is),
on each stage's load-ahead thread, beside the steps, and only where the machine's memory
has room beside the slice it serves and within its owner's limit
(engine/pipeline/load_ahead.py); a machine without room loads its share of a loss when
it comes, as before. Anything else that rearranges the pipeline (a machine taken in, one
leaving with notice, a loss) stops them first; the next formation plans them again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from websockets.exceptions import ConnectionClosed

from engine.core.partition import NoRoom
from engine.core.spares import Spares, spare_count, spare_ranges, spares_on
from engine.model.sources import ModelError
from engine.pipeline.requests import PipelineError
from engine.wire import frames

log = logging.getLogger("potluck.head")

SPARE_WAIT_S = 20.0      # a pipeline busy from its start loads them after this anyway
_IDLE_POLL_S = 0.25


class SpareLayers:
    """Head's spare layers (a mixin of Head): _arm_spares after a formation,
    _disarm_spares before anything else rearranges."""

    _spares: Spares | None = None
    _spares_task: asyncio.Task | None = None

    @property
    def spare_layers(self) -> int:
        """Layers held spare over every machine now (0: none, or still loading)."""
        return self._spares.layers if self._spares is not None else 0

    def _arm_spares(self):
        self._disarm_spares()
        if spares_on() and self.remotes and self.recovery.failed is None and not self.recovery.closed:
            self._spares_task = asyncio.ensure_future(self._load_spares())

    def _disarm_spares(self):
        """Stop loading spares and forget the plans: the arrangement they were for is ending.
        (What a stage loaded stays with it until its next configure, which keeps what it needs.)"""
        task, self._spares_task, self._spares = self._spares_task, None, None
        if task is not None and not task.done():
            task.cancel()

    async def _until_idle(self, at_most: float):
        end = time.monotonic() + at_most
        while time.monotonic() < end and any(not s.done for s in self.seqs.values()):
            await asyncio.sleep(_IDLE_POLL_S)

    async def _load_spares(self):
        try:
            await self._until_idle(SPARE_WAIT_S)
            plans = {}
            for lost, r in enumerate(self.remotes, start=1):
                try:
                    planned = await self._plan_without_pause([x for x in self.remotes if x is not r], quiet=True)
                except NoRoom:
                    continue   # the others could not hold the model: requests would wait for a machine
                if planned[1][1] == self.weights:   # (a loss that changes the precision keeps nothing)
                    plans[lost] = planned
            spares = self._spares = Spares({self.remotes[i - 1].address: p for i, p in plans.items()}, self.weights)
            targets = spare_ranges(self.ranges, {i: p[1][2] for i, p in plans.items()})
            if spare_count(self.ranges, targets) == 0:
                return
            t0 = time.monotonic()
            spares.layers = await self._prepare_ranges({r.address: t for r, t in zip(self.remotes, targets[1:])},
                                                       targets[0], self.weights, spare=True)
            log.info("%d spare layer(s) loaded beside the slices in %.1f s: a stage lost without notice "
                     "costs no loading", spares.layers, time.monotonic() - t0)
        except asyncio.CancelledError:
            raise
        except (PipelineError, ModelError, ConnectionClosed, OSError, frames.FrameError) as exc:
            log.warning("no spare layers: %s", exc)
