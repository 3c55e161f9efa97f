"""A draft model on the host (issue 34, item 1b): a small model of the target's
tokenizer that guesses the next k tokens of every decoding sequence, greedily, beside
stage 0 on the host's own device. Its guesses are checked by the pipeline in one trip
(engine/pipeline/head.py); nothing of it ever leaves the host.

It is the engine's own machinery: one StageModel holding all the draft's layers (first
and last stage at once: token ids in, logits out) and its KV cache, so every sequence
drafting in a round is one batched step per drafted position, and a rejected guess is
rolled back by truncating the cache (engine/model/kv.py), not recomputed.

In step with the conversation: each round is handed each sequence's whole context (the
prompt and every emitted token, never a rejected guess). The draft's cache holds a
prefix of it from the last round -- the context then, and the guesses it fed itself
after it. The longest prefix both agree on stays; the rest is truncated away (the
rejected guesses) and the new tokens (the target's own token after the accepted ones,
or a whole prompt the first time) are fed in one step. A sequence the head no longer
holds is freed at the next round (`retain`).

Which model: `--draft MODEL[@WEIGHTS]`, any model spec Potluck loads ('default', a hub
id, a folder, a .gguf), at WEIGHTS (bf16 -- full precision at the compute dtype --,
int8 or nf4; default bf16). Its tokenizer must be the target's: the same vocabulary,
token for token (`check_tokenizers`). int8 on a CPU is torch's weight-only int8 kernel
(engine/model/cpu_linear.py), elsewhere bitsandbytes. On a CPU-only machine the default
model itself, quantized (`--draft default@int8`), is a stand-in that shows the mechanism:
its guesses agree with the target nearly always, but it is the target's own size, so a
drafted token costs most of what a whole trip's compute does, and the policy
(engine/core/speculation.py) only drafts with it over slow links. The catalog
(engine/model/catalog.py) names real pairs: a 1B sibling for a 70B.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.core import precision
from engine.model.cpu_linear import int8_kernel_works, use_int8_weights
from engine.model.kv import KVCapacityError
from engine.model.lean_decoder import LeanDecoder, supports
from engine.model.sources import ModelError, ModelSource, resolve
from engine.model.stage import StageBatch, StageModel

log = logging.getLogger("potluck.draft")

DRAFT_WEIGHTS = precision.EXPLICIT


def parse_draft(spec: str) -> tuple[str, str]:
    """'MODEL[@WEIGHTS]' -> (model spec, weights). WEIGHTS: bf16 (default), int8, nf4, int4."""
    spec = (spec or "").strip()
    if not spec:
        raise ModelError("--draft needs a model: 'default', a Hugging Face id, a folder or a .gguf")
    model, at, weights = spec.rpartition("@")
    if not at:
        return spec, precision.FULL
    if weights not in DRAFT_WEIGHTS:
        raise ModelError(f"draft weights {weights!r}: choose one of {', '.join(DRAFT_WEIGHTS)} "
                         f"(as in --draft {model or 'MODEL'}@int8)")
    if not model:
        raise ModelError(f"--draft {spec!r} names no model")
    return model, weights


def check_tokenizers(draft_tokenizer, target_tokenizer, draft_name: str, target_name: str) -> None:
    """A draft proposes token ids the target reads as its own: the vocabularies must be
    the same, id for id (special tokens included)."""
    a, b = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if a != b:
        differ = len(set(a.items()) ^ set(b.items()))
        raise ModelError(f"the draft model {draft_name} does not share {target_name}'s tokenizer "
                         f"({len(a)} and {len(b)} tokens, {differ} entries differ): a draft must be of the "
                         "same tokenizer family (the catalog names pairs that are)")


class DraftModel:
    """Greedy drafts for many sequences at once from one whole-model StageModel."""

    def __init__(self, model: StageModel | LeanDecoder, name: str, vocab_limit: int | None = None):
        if not (model.first and model.last):
            raise ValueError("a draft model holds all its layers")
        self.model = model
        self.name = name
        # ids the target can take: a draft whose LM head is padded wider proposes none beyond
        self.vocab_limit = vocab_limit or model.vocab_size
        self.tokens: dict[int, list[int]] = {}   # per sequence: what its KV cache holds
        self.next: dict[int, int] = {}           # ... and the guess after that (chain())
        self.drafted = 0                          # tokens proposed since load (status)
        self.from_chain = 0                       # ... of which the chain held (drafted ahead)
        # the last draft() call's cost per guess it computed, prompts' catch-up left out
        # (None: that call measured none); SpecPolicy.observe_draft's input
        self.seconds_per_token: float | None = None
        # ... and its steps after the first (one position each): what drafting ahead
        # runs at (None: it took none)
        self.seconds_per_position: float | None = None

    @classmethod
    def load(cls, spec: str, *, dtype: torch.dtype, device: str, kv_budget_tokens: int = 1 << 16,
             target_tokenizer=None, target_name: str = "the target", target_vocab: int | None = None,
             source: ModelSource | None = None, lean: bool | None = None) -> "DraftModel":
        if lean is None:
            lean = os.environ.get("POTLUCK_LEAN_DRAFT", "1") != "0"
        model_spec, weights = parse_draft(spec)
        source = source or resolve(model_spec)
        if target_tokenizer is not None:
            check_tokenizers(source.tokenizer(), target_tokenizer, source.name, target_name)
        n = source.config().num_hidden_layers
        # int8 on a CPU: torch's weight-only int8 kernel, not bitsandbytes' (whose CPU
        # kernels draft three to four times slower than float32: a draft slower than the
        # target it drafts for)
        cpu_int8 = weights == "int8" and torch.device(device).type == "cpu" and int8_kernel_works()
        stage = StageModel(source, 0, n, dtype=dtype, device=device, kv_budget_tokens=kv_budget_tokens,
                           weights=precision.FULL if cpu_int8 else weights)
        if cpu_int8:
            use_int8_weights(stage.model)
        model = stage
        # the lean loop over the same weights, without transformers' forward around them
        # (engine/model/lean_decoder.py: a drafted position 6-9% cheaper on a CPU thread);
        # POTLUCK_LEAN_DRAFT=0 keeps the StageModel's
        if lean and supports(stage):
            model = LeanDecoder(stage)
        label = source.name if weights == precision.FULL else f"{source.name} ({weights})"
        return cls(model, label, min(target_vocab or stage.vocab_size, stage.vocab_size))

    @property
    def param_bytes(self) -> int:
        return self.model.param_bytes()

    def free(self, seq_id: int) -> None:
        self.tokens.pop(seq_id, None)
        self.next.pop(seq_id, None)
        self.model.free(seq_id)

    def retain(self, live) -> None:
        """Free every sequence's cache but those of `live` (ids the head still holds)."""
        live = set(live)
        for sid in [s for s in self.tokens if s not in live]:
            self.free(sid)

    def ahead_of(self, seq_id: int, context: list[int]) -> int:
        """How many guesses after `context` the chain holds already (drafted ahead)."""
        known = self.chain(seq_id)
        return len(known) - len(context) if len(known) > len(context) and known[:len(context)] == context else 0

    def unread(self, seq_id: int, context: list[int]) -> int:
        """Tokens of `context` the draft's cache does not hold: what a draft after it
        would feed first (a whole prompt for a sequence new to the draft model)."""
        have = self.tokens.get(seq_id, [])
        keep, top = 0, min(len(have), len(context))
        while keep < top and have[keep] == context[keep]:
            keep += 1
        return len(context) - keep

    def chain(self, seq_id: int) -> list[int]:
        """What the draft has said of a sequence: the tokens its cache holds, then its
        guess after them. Greedy, so any context that is a prefix of it continues as the
        rest of it -- a round drafted ahead (`stop`) is served from here for free."""
        have = self.tokens.get(seq_id, [])
        nxt = self.next.get(seq_id)
        return have + [nxt] if nxt is not None else list(have)

    @torch.inference_mode()
    def draft(self, asks: list[tuple[int, list[int], int]], stop=None) -> dict[int, list[int]]:
        """asks: (seq_id, context, k) -- the sequence's every token so far, and how many to
        guess after it. Returns seq_id -> up to k guessed tokens (fewer where the cache is
        full: that sequence then drafts nothing this round, or where `stop()` turned true:
        it is asked before each position).

        Guesses the chain already holds after the context (drafted ahead while the last
        verification was in flight: the head's overlap, issue 34 item 4) cost nothing;
        the model carries on from the chain's end for the rest."""
        asks = [(sid, list(ctx), k) for sid, ctx, k in asks if k > 0 and ctx]
        if not asks or (stop is not None and stop()):
            return {}
        kv = self.model.kv
        out: dict[int, list[int]] = {}
        free = 0
        # 1. in step: keep the longest prefix the cache and the context agree on (at most
        # all but the context's last token, whose logits give the first guess)
        rows = []
        for sid, ctx, k in asks:
            known = self.chain(sid)
            if len(known) > len(ctx) and known[:len(ctx)] == ctx:
                out[sid] = known[len(ctx): len(ctx) + k]
                free += len(out[sid])
                if len(out[sid]) == k:
                    continue
                ctx, k = known, k - len(out[sid])   # carry on from the chain's end
            else:
                out[sid] = []
            have = self.tokens.get(sid, [])
            keep, top = 0, min(len(have), len(ctx) - 1)
            while keep < top and have[keep] == ctx[keep]:
                keep += 1
            if kv.has(sid) and kv.length(sid) > keep:
                kv.truncate(sid, keep)
            self.tokens[sid] = ctx[:keep]
            self.next.pop(sid, None)
            rows.append((sid, keep, ctx[keep:], k))
        self.seconds_per_token = self.seconds_per_position = None
        if not rows:
            self.drafted += free
            self.from_chain += free
            return out
        t0 = time.perf_counter()
        try:
            logits = self._step([(sid, start, feed) for sid, start, feed, _ in rows])
        except KVCapacityError as exc:
            log.warning("draft model: %s; no drafts this round", exc)
            for sid, _, _ in asks:
                self.free(sid)
            return {}
        guess = self._greedy(logits)
        t_first = time.perf_counter() - t0
        # a sequence new to the draft (or far behind it) was prefilled in that first step:
        # that is the prompt's cost, not a guess's, and would make drafting look several
        # times dearer than it is (the policy would then never draft again)
        caught_up = any(len(feed) > k + 1 for _, _, feed, k in rows)
        t1 = time.perf_counter()
        live = []
        for (sid, start, feed, k), g in zip(rows, guess):
            self.tokens[sid].extend(feed)
            out[sid].append(g)
            self.next[sid] = g
            if k > 1:
                live.append((sid, len(out[sid]) + k - 1))
        # 2. one batched step per further position, for the sequences that want it
        steps = 0
        while live and not (stop is not None and stop()):
            try:
                logits = self._step([(sid, len(self.tokens[sid]), [out[sid][-1]]) for sid, _ in live])
            except KVCapacityError as exc:
                log.warning("draft model: %s; drafts cut short", exc)
                break
            steps += 1
            nxt = []
            for (sid, want), g in zip(live, self._greedy(logits)):
                self.tokens[sid].append(out[sid][-1])
                out[sid].append(g)
                self.next[sid] = g
                if len(out[sid]) < want:
                    nxt.append((sid, want))
            live = nxt
        # a step drafts one position of every sequence still drafting; the first step counts
        # as one too where it only fed what the last round left (a position's worth): a run
        # stopped after it (a trip with no time for a second position) must still say so,
        # or drafting ahead would stay untimed, and be tried again, on every trip
        if not caught_up:
            self.seconds_per_position = (time.perf_counter() - t0) / (steps + 1)
        elif steps:
            self.seconds_per_position = (time.perf_counter() - t1) / steps
        drafted = sum(len(v) for v in out.values())
        computed = drafted - free   # the chain's guesses cost nothing here: the policy counts them apart
        rest, t_rest = computed - len(rows), time.perf_counter() - t1
        if not caught_up and computed:
            self.seconds_per_token = (t_first + t_rest) / computed
        elif rest > 0:
            self.seconds_per_token = t_rest / rest
        self.drafted += drafted
        self.from_chain += free
        return out

    def _step(self, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        batch = StageBatch([r[0] for r in rows], [r[1] for r in rows], [len(r[2]) for r in rows])
        x = torch.tensor([t for r in rows for t in r[2]], dtype=torch.long)
        return self.model.forward(batch, x)

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        return logits[:, : self.vocab_limit].argmax(-1).tolist()
