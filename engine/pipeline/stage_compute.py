"""A stage's step on its compute thread: the frames of one step checked, run through the
slice (merged where they can be), sampled on the last stage, and answered -- with each
row's own error where a step fails, one sequence at a time where memory runs out (a
mixin of StageServer, which owns the connections and the threads)."""

from __future__ import annotations

import logging
import time

import torch

from engine.core.compression import should_compress
from engine.core.sampling import SamplingError
from engine.model.device import step_failure
from engine.model.grammar import Grammars
from engine.model.stage import StageBatch
from engine.pipeline import step_rows
from engine.pipeline.kept_replies import apply_opening
from engine.wire import frames

log = logging.getLogger("potluck.stage")


class StageCompute:
    """What a step does with the frames it was given (self.stage, self.sampler,
    self.compress, self._to_host, self._link, self.device and self.trace are StageServer's)."""

    def _check_frame(self, frame: frames.Frame):
        if self.stage is None:
            raise frames.FrameError("stage is not configured")
        if frame.type != frames.FrameType.ACTIVATIONS:
            raise frames.FrameError("data connections carry activations only")
        if frame.tensor.shape[1] != self.stage.hidden_size:
            raise frames.FrameError(f"hidden size {frame.tensor.shape[1]} != model's {self.stage.hidden_size}")
        if frame.quantized:
            frame.tensor = frame.tensor.to(self.stage.dtype)  # int8 blocks, dequantized by wire
        elif frame.tensor.dtype != self.stage.dtype:
            raise frames.FrameError(f"dtype {frame.tensor.dtype} != stage dtype {self.stage.dtype}")

    def _gated_compute(self, queued: list[frames.Frame], cut_in: bool) -> list:
        self.trace("compute")
        with self.stage.gate.step(decode=cut_in):
            for f in queued:   # kept replies let go or taken over, once, before any step of them
                apply_opening(f.meta, self.stage, self.sampler)
            out = self._compute(queued)
        self.trace("computed")
        return out

    def _compute(self, queued: list[frames.Frame]) -> list:
        """Runs on the compute thread: one output per frame (see _compute_one)."""
        if len(queued) == 1:
            return _results(self._compute_one(queued[0]))
        stage = self.stage
        rows = [r for f in queued for r in f.meta["rows"]]
        keeps = [step_rows.kept(f) for f in queued]
        keep = [k for ks in keeps for k in ks]
        batch = StageBatch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                           keep if any(k > 1 for k in keep) else None)
        try:
            if stage.last:
                unknown = [s for s in batch.seq_ids if not self.sampler.knows(s)]
                if unknown:
                    more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
                    raise ValueError(f"no sampling parameters for sequences {unknown[:8]}{more}")
            out = stage.forward(batch, torch.cat([f.tensor for f in queued]))
            self.trace("forwarded")   # on a GPU: launched, not done (the tokens' or frame's copy waits)
        except (ValueError, SamplingError, RuntimeError):
            return [r for f in queued for r in _results(self._compute_one(f))]  # each frame: its own error
        results, o = [], 0
        for f, ks in zip(queued, keeps):
            ids = [r[0] for r in f.meta["rows"]]
            width = sum(ks) if stage.last else sum(r[2] for r in f.meta["rows"])
            part = out[o: o + width]
            o += width
            if stage.last:
                meta = {"tokens": self.sampler.step(ids, part, None, step_rows.keep(f), step_rows.positions(f),
                                                    step_rows.drafts(f))}
                results.append(("head", frames.encode(frames.FrameType.TOKENS, f.micro_batch, f.step, meta)))
            else:
                q8 = self.compress == "all"
                results.append(("next", frames.encode(frames.FrameType.ACTIVATIONS, f.micro_batch, f.step,
                                                    f.meta, part, q8=q8, to_host=self._to_host), "decode"))
        return results

    def _compute_one(self, frame: frames.Frame):
        """Returns ("head" | "next", bytes[, kind]) to send, None, or a list of those."""
        stage = self.stage
        rows = frame.meta["rows"]
        batch = StageBatch([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], step_rows.keep(frame))
        forks = step_rows.forks(frame)
        try:
            if stage.last and not frame.meta.get("partial"):
                if self.sampler.grammars is None:   # loads nothing until a request has a schema
                    self.sampler.grammars = Grammars(stage.source.tokenizer, stage.vocab_size)
                self.sampler.open_new(frame.meta.get("new", {}), stage.vocab_size)
                unknown = [s for s in batch.seq_ids if not self.sampler.knows(s)]
                if unknown:
                    more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
                    raise ValueError(f"no sampling parameters for sequences {unknown[:8]}{more}")
            t0 = time.perf_counter()
            out = stage.forward(batch, frame.tensor)
            self.trace("forwarded")   # on a GPU: launched, not done (the tokens' or frame's copy waits)
            compute_seconds = time.perf_counter() - t0
            for parent, children in forks.items():
                for c in children:
                    stage.fork(parent, c)
        except (ValueError, SamplingError, RuntimeError) as exc:   # torch.OutOfMemoryError too
            if isinstance(exc, torch.OutOfMemoryError) and len(rows) > 1:
                return self._compute_rows(frame, exc)    # again, one sequence at a time
            log.warning("step failed: %s", exc)
            return ("head", step_rows.failed(frame, step_failure(exc, str(self.device))))
        if stage.last and frame.meta.get("partial"):
            return None  # a prompt chunk: nothing to sample yet
        if stage.last:
            meta = {"tokens": self.sampler.step(batch.seq_ids, out, forks, batch.keep, step_rows.positions(frame),
                                                step_rows.drafts(frame))}
            return ("head", frames.encode(frames.FrameType.TOKENS, frame.micro_batch, frame.step, meta))
        kind = "decode" if step_rows.is_decode(frame) else "prefill"
        link = self._link   # read once: the event loop may drop it meanwhile (a new arrangement)
        bandwidth = link.sched.link.bandwidth if link is not None else float("inf")
        q8 = should_compress(self.compress, kind, out.numel() * out.element_size(), bandwidth, compute_seconds)
        return ("next", frames.encode(frames.FrameType.ACTIVATIONS, frame.micro_batch, frame.step,
                                    frame.meta, out, q8=q8, to_host=self._to_host), kind)

    def _compute_rows(self, frame: frames.Frame, first: BaseException):
        """A step that ran out of memory, again one sequence at a time: those that fit go
        on, those that still do not get a clear error (the head frees them everywhere).
        Safe to repeat: KV is written by position and a sequence's length moves only
        when its step completes (model/kv.py, model/stage.py)."""
        stage, rows = self.stage, frame.meta["rows"]
        why = step_failure(first, str(self.device))
        forks = step_rows.forks(frame)
        outs, good, failed, o = [], [], [], 0
        for r, k in zip(rows, step_rows.kept(frame)):
            x = frame.tensor[o: o + r[2]]
            o += r[2]
            try:
                outs.append(stage.forward(StageBatch([r[0]], [r[1]], [r[2]], None if k == 1 else [k]), x))
                good.append(r)
            except torch.OutOfMemoryError as exc:
                failed.append([r[0], step_failure(exc, str(self.device))])
                continue
            for c in forks.get(r[0], ()):
                try:
                    stage.fork(r[0], c)
                except (ValueError, RuntimeError) as exc:   # no room for the copy: that choice fails
                    failed.append([c, step_failure(exc, str(self.device))])
            forks[r[0]] = [c for c in forks.get(r[0], ()) if stage.kv.has(c)]
        log.warning("out of memory in a step of %d sequences: %d went on one by one (%s)", len(rows), len(good), why)
        # every failed row carries its reason: each cut to its share of what a frame holds
        failed = [[c, step_rows.fit_reason(w, frames.MAX_META // 2 // max(1, len(failed)))] for c, w in failed]
        ids = [r[0] for r in good]
        if stage.last:
            sub = {**frame.meta, "rows": good}
            good_frame = frames.Frame(frame.type, frame.micro_batch, frame.step, sub, None)
            entries = self.sampler.step(ids, torch.cat(outs), forks, step_rows.keep(good_frame),
                                        step_rows.positions(good_frame), step_rows.drafts(frame)) if outs else []
            meta = {"tokens": entries, "errors": failed}
            return ("head", frames.encode(frames.FrameType.TOKENS, frame.micro_batch, frame.step, meta))
        out = []
        if failed:
            # told apart from the step's result (step 0), which the rows that fit still bring
            out.append(("head", frames.encode(frames.FrameType.TOKENS, frame.micro_batch, 0,
                                              {"tokens": [], "errors": failed})))
        if not good:
            return out
        keep = {str(s) for s in ids}
        meta = {**frame.meta, "rows": good}
        for part in ("new", "drafts", "rewind"):
            if part in meta:
                meta[part] = {k: v for k, v in meta[part].items() if k in keep}
        kind = "decode" if step_rows.is_decode(frame) else "prefill"
        return out + [("next", frames.encode(frames.FrameType.ACTIVATIONS, frame.micro_batch, frame.step, meta,
                                             torch.cat(outs)), kind)]


def _results(out) -> list:
    """_compute_one's answer as a list (a step retried row by row may answer twice)."""
    return out if isinstance(out, list) else [out]
