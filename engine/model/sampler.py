"""The sampler that runs on the last stage.

Each request carries its own parameters (engine/core/sampling.py); a batch mixes greedy
and sampled rows. A seeded request's randomness for each token comes from its seed and
the token's position alone (not from a generator that advances draw by draw): its draw
does not depend on its batch mates, and a sequence replayed onto new stages after a
friend's machine left (engine/pipeline/head.py) draws exactly what it would have drawn.

The draw itself runs batched where the logits are (engine/model/draw.py: penalties,
temperature, top-k, top-p and an inverse-CDF pick for all rows at once), so on a GPU only
token ids cross to the CPU; what a row needs from here is one uniform, a seeded row's
from random.Random(draw_seed(seed, position)), the same on any device.

`step` is what a last stage runs: one token per row, plus one per fork (a request's
other choices, n > 1, sampled from their parent's logits at the step that completes its
prompt), and log-probabilities for the rows that ask for them.

A request with a JSON schema (response_format) draws only what its grammar allows next
(engine/model/grammar.py): its rows' logits are masked on a copy, so its logprobs stay
the raw model's, and a batch without such a request never copies or masks anything.

Penalties, in this order, on a copy of a row's logits before temperature, top-k and top-p
(vLLM's order): the repetition penalty (HF's: the prompt's and the reply's tokens), then
OpenAI's frequency and presence penalties, logits[j] -= count[j] * frequency_penalty +
(count[j] > 0) * presence_penalty, count[j] the times this choice generated token j (its
prompt does not count). The counts are rebuilt, never carried: a sequence replayed after
a rearrangement counts the tokens its frame says it generated (`replayed`), and a fork
(a request's other choice, n > 1) starts from none, so each choice counts its own. Like
the grammar's mask, none of this reaches the logprobs: they are the raw model's.

A verification row of speculative decoding (issue 34) is penalized position by position:
position j after the history plus the draft's tokens 0..j-1 (its pick is used only where
the picks before it equalled the draft, so those are the tokens plain decoding would have
drawn before it). Knowing the draft, every position of every verification row in a step
is drawn in one batched draw, with one read of the picks (before the draft reached the
last stage, each penalized position was drawn alone: k + 1 reads a row). The picks are
recorded; the next step's position (`positions`) then says how many were kept, and the
picks past it leave the history and the counts again, so they hold exactly the accepted
tokens and the bonus one.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import numpy as np
import torch

from engine.core.sampling import SamplingParams
from engine.model.device import to_device
from engine.model.draw import HostRead, Penalties, Shape, draw
from engine.model.grammar import GrammarError
from engine.model.token_history import TokenHistory

# OpenAI's floor for a log-probability (what -inf, a masked-out token, becomes): JSON has
# no infinities, and a token frame carries only finite values
LOGPROB_FLOOR = -9999.0


class Sampler:
    """Keeps per-sequence state: token history for the repetition penalty, generated-token
    counts for the presence/frequency penalties, grammar state, the next position."""

    def __init__(self, grammars=None):
        # seq_id -> its tokens, for the repetition penalty (empty for requests without it)
        self._history: dict[int, TokenHistory] = {}
        self._params: dict[int, SamplingParams] = {}
        self._pos: dict[int, int] = {}  # the position of the next token each sequence draws
        # engine/model/grammar.py Grammars: set by whoever knows the model's tokenizer
        self.grammars = grammars
        self._constraints: dict = {}    # seq_id -> grammar.Constraint, constrained requests only
        self._counts: dict[int, Counter] = {}  # seq_id -> generated token counts, penalized requests only
        # seq_id -> (the position after, the picks) of a penalized sequence's last
        # verification step: what its next step's position rolls back from the history
        # and the counts where the draft was partly rejected
        self._tails: dict[int, tuple[int, list[int]]] = {}
        # the uniforms of unseeded rows (a seeded row's come from its seed and position)
        self._rng = random.Random()

    def open(self, seq_id: int, params: SamplingParams, prompt: list[int], replayed: int = 0) -> None:
        """replayed: how many of the prompt's last tokens this sequence generated before
        (a replay after a rearrangement): its grammar goes on after them, and its presence
        and frequency penalties count them."""
        if params.json_schema is not None:
            if self.grammars is None:
                raise GrammarError("this stage cannot hold replies to a JSON schema")
            c = self.grammars.constraint(params.json_schema)
            if replayed:
                c.consume(prompt[len(prompt) - replayed:])
            self._constraints[seq_id] = c
        else:
            self._constraints.pop(seq_id, None)
        self._params[seq_id] = params
        self._history[seq_id] = TokenHistory(prompt if params.repetition_penalty != 1.0 else ())
        if params.penalized:
            self._counts[seq_id] = Counter(prompt[len(prompt) - replayed:] if replayed else ())
        else:
            self._counts.pop(seq_id, None)
        self._pos[seq_id] = len(prompt)
        self._tails.pop(seq_id, None)

    def open_new(self, new: dict, vocab_size: int) -> None:
        """The sequences a step opens (a frame's `new`, checked by engine/wire/frames.py)
        and their forks."""
        for k, v in new.items():
            if any(t >= vocab_size for t in v["prompt"]):
                raise ValueError(f"sequence {k}: prompt token ids outside the vocabulary")
            self.open(int(k), SamplingParams.from_dict(v["sampling"]), v["prompt"], v.get("replayed", 0))
            for c, seed in v.get("forks", []):
                self.open_fork(c, int(k), seed, v["prompt"])

    def open_fork(self, child: int, parent: int, seed: int | None, prompt: list[int]) -> None:
        """A request's other choice: sampled as its first choice is, with its own seed (and
        its own penalty counts: it has generated nothing yet)."""
        self.open(child, replace(self._params[parent], seed=seed), prompt)

    def knows(self, seq_id: int) -> bool:
        return seq_id in self._params

    def close(self, seq_id: int) -> None:
        self._history.pop(seq_id, None)
        self._params.pop(seq_id, None)
        self._pos.pop(seq_id, None)
        self._constraints.pop(seq_id, None)
        self._counts.pop(seq_id, None)
        self._tails.pop(seq_id, None)

    def step(self, seq_ids: list[int], logits: torch.Tensor, forks: dict[int, list[int]] | None = None,
             keep: list[int] | None = None, positions: list[int] | None = None,
             drafts: dict[int, list[int]] | None = None, ahead=None) -> list[list]:
        """logits [B, vocab] -> token entries, one per row then one per fork (its parent's
        row): [seq_id, token] or, for a row that asked for logprobs, [seq_id, token,
        logprob, [[token, logprob], ...top_logprobs]].

        keep: logits per row (None: one each; logits is then [sum(keep), vocab]). A row
        with keep > 1 is a verification step of speculative decoding (issue 34): it gets
        keep entries [seq_id, token], in order, the token plain decoding would draw after
        each prefix of its draft, which the head compares with the draft
        (engine/core/spec_verify.py verify_greedy; for a sampled row this is
        verify_sampled's deterministic-draft scheme with per-position draws: a seeded row
        draws position p from draw_seed(seed, p) whatever the step, so its reply is the
        one plain decoding gives).
        positions: the position of the (first) token each row draws, start + n - keep + 1
        (None: where the sampler's count says): after a verification step whose draft was
        partly rejected, the count is wrong and the step's rows say where they are.
        drafts: a penalized verification row's drafted tokens (keep - 1 of them), which
        its positions are penalized after.
        ahead(tokens): called with the rows' drawn tokens still on the device, before they
        are read, to queue the next step behind them (engine/core/ahead.py); only for a
        plain step (no verification, no forks, no logprobs, which read the logits after
        the draw and would wait for that next step too)."""
        if positions is not None:
            for sid, p in zip(seq_ids, positions):
                if sid in self._pos:
                    self._pos[sid] = p
                    self._roll_back(sid, p)
        if self._tails:
            for sid in seq_ids:
                self._tails.pop(sid, None)
        if keep is not None and any(k > 1 for k in keep):
            return self._step_verify(seq_ids, logits, forks, keep, drafts or {})
        ids = list(seq_ids)
        if forks:
            rows = list(range(len(seq_ids)))
            for i, s in enumerate(seq_ids):
                for c in forks.get(s, ()):
                    ids.append(c)
                    rows.append(i)
            if len(ids) > len(seq_ids):
                logits = logits[to_device(rows, torch.long, logits.device)]
        want = [i for i, s in enumerate(ids) if self._params[s].logprobs]
        toks = self.sample(ids, logits, ahead if len(ids) == len(seq_ids) and not want else None)
        entries = [[s, t] for s, t in zip(ids, toks)]
        if want:  # requests that did not ask pay nothing for it
            self._logprobs(entries, want, logits, toks)
        return entries

    def _step_verify(self, seq_ids: list[int], logits: torch.Tensor, forks, keep: list[int],
                     drafts: dict[int, list[int]]) -> list[list]:
        plain_rows, plain_ids, o = [], [], 0
        # every position of every verification row, drawn together
        rows, shapes, owners, before, verified = [], [], [], [], []
        for sid, k in zip(seq_ids, keep):
            if k == 1:
                plain_rows.append(o)
                plain_ids.append(sid)
                o += 1
                continue
            p = self._params[sid]
            if not speculable(p):
                raise ValueError(f"sequence {sid}: its sampling settings rule out speculative decoding")
            draft = drafts.get(sid)
            if _penalized(p) and (draft is None or len(draft) != k - 1):
                raise ValueError(f"sequence {sid}: a penalized verification row needs its {k - 1} drafted tokens")
            if draft and max(draft) >= logits.shape[1]:   # an index on the device: checked here
                raise ValueError(f"sequence {sid}: drafted token ids outside the vocabulary")
            pos = self._pos[sid]
            for j in range(k):
                rows.append(o + j)
                shapes.append(self._shape(p, pos + j))
                owners.append(sid)
                before.append(draft[:j] if draft else [])
            verified.append((sid, k))
            o += k
        entries = []
        if rows:
            x = logits if len(rows) == logits.shape[0] else \
                logits.index_select(0, to_device(rows, torch.long, logits.device))
            if all(s.greedy for s in shapes) and not any(_penalized(self._params[s]) for s, _ in verified):
                toks = x.argmax(-1).tolist()
            else:
                toks = draw(x, shapes, self._penalties(owners, before)).tolist()
            i = 0
            for sid, k in verified:
                picks = toks[i:i + k]
                i += k
                p = self._params[sid]
                for t in picks:
                    self._record(sid, p, t)
                self._pos[sid] += k
                if _penalized(p):
                    self._tails[sid] = (self._pos[sid], picks)
                entries.extend([sid, t] for t in picks)
        if plain_ids:
            idx = to_device(plain_rows, torch.long, logits.device)
            entries = self.step(plain_ids, logits.index_select(0, idx), forks) + entries
        return entries

    def _record(self, seq_id: int, p: SamplingParams, tok: int) -> None:
        """A drawn token into the history (repetition penalty) and the counts (presence,
        frequency)."""
        if p.repetition_penalty != 1.0:
            self._history[seq_id].append(tok)
        counts = self._counts.get(seq_id)
        if counts is not None:
            counts[tok] += 1

    def _roll_back(self, seq_id: int, pos: int) -> None:
        """The sequence's next token is drawn at pos: a verification step's picks past
        it (its draft was rejected there; the picks up to it are the accepted tokens and
        the bonus one) leave the history and the counts."""
        tail = self._tails.pop(seq_id, None)
        if tail is None:
            return
        end, toks = tail
        extra = end - pos
        if extra <= 0:
            return
        if extra > len(toks):
            raise ValueError(f"sequence {seq_id}: position {pos} is before its last verification step")
        if self._params[seq_id].repetition_penalty != 1.0:
            self._history[seq_id].truncate(pos)
        counts = self._counts.get(seq_id)
        if counts is not None:
            for t in toks[len(toks) - extra:]:
                counts[t] -= 1
                if counts[t] <= 0:
                    del counts[t]

    def _logprobs(self, entries: list[list], want: list[int], logits: torch.Tensor, toks: list[int]) -> None:
        # The log-softmax of the raw model logits, before the penalties (repetition,
        # presence, frequency), a grammar's mask, temperature, top-k and top-p shape what
        # is drawn from: what OpenAI reports (and vLLM by default), the model's own
        # belief, the same whatever the sampling settings. With plain greedy decoding the
        # sampled token is therefore top_logprobs[0] (with penalties or a mask it may not be).
        idx = to_device(want, torch.long, logits.device)
        lsm = torch.log_softmax(logits.index_select(0, idx).float(), dim=-1)
        lsm = torch.nan_to_num(lsm, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp(LOGPROB_FLOOR, 0.0)
        chosen = lsm.gather(1, torch.tensor([[toks[i]] for i in want], device=lsm.device)).view(-1).tolist()
        k = max(self._params[entries[i][0]].top_logprobs for i in want)
        top_v = top_i = None
        if k:
            top_v, top_i = (t.tolist() for t in lsm.topk(min(k, lsm.shape[-1]), dim=-1))
        for j, i in enumerate(want):
            n = self._params[entries[i][0]].top_logprobs
            top = [[top_i[j][m], top_v[j][m]] for m in range(min(n, len(top_i[j])))] if n else []
            entries[i] += [chosen[j], top]

    def sample(self, seq_ids: list[int], logits: torch.Tensor, ahead=None) -> list[int]:
        """logits [B, vocab] float32 -> one token id per row (ahead: see step)."""
        params = [self._params[s] for s in seq_ids]
        constrained = [i for i, s in enumerate(seq_ids) if s in self._constraints] if self._constraints else ()
        if constrained:
            logits = self._masked(seq_ids, logits, constrained)
        if all(p.is_greedy and p.repetition_penalty == 1.0 and not p.penalized for p in params):
            drawn = logits.argmax(-1)  # the common fast path, one op for the batch
        else:
            shapes = [self._shape(p, self._pos[s]) for s, p in zip(seq_ids, params)]
            drawn = draw(logits, shapes, self._penalties(seq_ids))
        if ahead is None:
            out = drawn.tolist()
        else:
            read = HostRead(drawn)
            ahead(drawn)
            out = read.tolist()
        for s, t in zip(seq_ids, out):
            self._pos[s] += 1
            self._record(s, self._params[s], t)
        for i in constrained:
            self._constraints[seq_ids[i]].consume([out[i]])
        return out

    def _masked(self, seq_ids: list[int], logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A copy of the logits whose constrained rows allow only what their grammar does."""
        logits = logits.clone()
        for i in rows:
            row = logits[i].detach().to("cpu", torch.float32, copy=True)
            self._constraints[seq_ids[i]].apply(row)
            logits[i] = row.to(logits.device, logits.dtype)
        return logits

    def _shape(self, p: SamplingParams, position: int) -> Shape:
        """What the draw of one row needs (engine/model/draw.py): a seeded row's uniform
        comes from its seed and the token's position alone, so the same seed draws the
        same reply on any device, beside any batch mates, and after a replay."""
        if p.is_greedy:
            return Shape(greedy=True)
        rng = random.Random(draw_seed(p.seed, position)) if p.seed is not None else self._rng
        return Shape(greedy=False, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                     uniform=rng.random())

    def _penalties(self, seq_ids: list[int], before: list[list[int]] | None = None) -> Penalties:
        """The rows' penalties, flat: the repetition penalty on each distinct token of the
        history, presence and frequency on each token generated; before[i]: tokens row i
        is drawn after beyond its sequence's record (a verification row's draft)."""
        pen = Penalties.none()
        rep_rows, rep_tokens, rep_factor = [], [], []   # per row: its index, tokens, factor
        for i, sid in enumerate(seq_ids):
            p = self._params[sid]
            more = before[i] if before else ()
            hist = self._history.get(sid)
            if p.repetition_penalty != 1.0 and (hist or more):
                toks = hist.distinct() if hist is not None else np.empty(0, dtype=np.int64)
                if more:
                    extra = [t for t in dict.fromkeys(more) if hist is None or t not in hist]
                    toks = np.concatenate([toks, np.asarray(extra, dtype=np.int64)])
                rep_rows.append(i)
                rep_tokens.append(toks)
                rep_factor.append(p.repetition_penalty)
            counts = self._counts.get(sid)
            if counts is not None and more:
                counts = counts + Counter(more)
            if counts:
                pen.sub_rows += [i] * len(counts)
                pen.sub_tokens += list(counts)
                pen.sub_amount += [c * p.frequency_penalty + p.presence_penalty for c in counts.values()]
        if rep_rows:
            # arrays joined in C: a Python list of every pair cost ~0.1 us a pair, each step
            lengths = [len(t) for t in rep_tokens]
            pen.rep_rows = np.repeat(np.asarray(rep_rows, dtype=np.int64), lengths)
            pen.rep_tokens = np.concatenate(rep_tokens)
            pen.rep_factor = np.repeat(np.asarray(rep_factor, dtype=np.float32), lengths)
        return pen


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.penalized


def speculable(p: SamplingParams) -> bool:
    """Whether a request's replies may be drafted and verified (issue 34): greedy or
    sampled decoding, with or without penalties (the repetition penalty, presence and
    frequency: a verification row's position j is penalized after the draft's tokens at
    0..j-1, which are the tokens before it wherever its pick is used, and the picks past
    the accepted ones are rolled back). Not with logprobs (each token would
    need its own) or a grammar (json_schema: response_format, forced tool calls: the mask
    moves with every token)."""
    return not p.logprobs and p.json_schema is None


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for one token: the request's seed and the token's position,
    mixed (splitmix64) so neighbouring positions and seeds draw unrelated numbers."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
