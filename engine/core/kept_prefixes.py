"""Replies' KV left on the stages for the follow-up, sans-I/O.

A chat sends the whole conversation with every turn, and without this each turn computed
all of it again on every stage: after a long paste, a short follow-up waited seconds for
its first token, and across homes every turn's prompt crossed every link again. So when
a reply ends, its sequence is not freed: its KV stays on every stage, kept here under the
tokens it holds. A new prompt that starts with most of the same tokens takes the kept
sequence over (its id, and its KV cut back to where the two part), and only the rest of
the prompt is computed. vLLM's automatic prefix caching and SGLang's radix cache do this per
block of tokens on one machine; here a whole sequence is the unit, because every stage
holds its own slice of it and one sequence id names it on all of them.

What is kept costs KV memory the pipeline could give to new requests: the scheduler
counts it (core/scheduler.py `kept`), and the head lets the least recently used go when
a request needs the room, when more than `most` are kept, or after `idle_s` unused.

    kept = KeptPrefixes()
    kept.keep(seq_id, tokens, now)           # a reply ended: its KV stays
    hit = kept.take(prompt)                  # (seq_id, n): n prompt tokens are cached
    ids = kept.evict(need_tokens)            # room for a request: these go
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MIN_MATCH = 16      # a shorter common start saves less than a step's fixed cost
# a kept reply is taken over only by a prompt that holds at least this share of its prompt:
# every chat prompt starts with the same system prompt, and a friend's new conversation
# taking over someone's 2,000-token conversation to save its 30 tokens of template would
# cost that conversation's follow-up the whole 2,000. Of its prompt, not of all it holds:
# a follow-up may part from it early in a long reply (a template that drops the last
# turn's thinking, a reply that tokenizes otherwise as text) and still save the prompt
TAKE_SHARE = 0.5
MOST = 8            # sequences kept at once (each holds a KV slot on every stage)
IDLE_S = 600.0      # a conversation nobody followed up for this long lets its memory go


@dataclass
class Kept:
    tokens: list[int]
    since: float
    prompt: int       # of the tokens, the ended request's prompt
    opened: int = 0   # where that prompt's step began (what was cached before it: taken over)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KeptPrefixes:
    def __init__(self, min_match: int = MIN_MATCH, most: int = MOST, idle_s: float = IDLE_S,
                 take_share: float = TAKE_SHARE):
        self.min_match, self.most, self.idle_s, self.take_share = min_match, most, idle_s, take_share
        self._kept: OrderedDict[int, Kept] = OrderedDict()   # least recently used first
        self.hits = 0
        self.reused_tokens = 0

    @property
    def tokens(self) -> int:
        """KV tokens the kept sequences hold on every stage."""
        return sum(len(k.tokens) for k in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._kept

    def ids(self) -> list[int]:
        return list(self._kept)

    def keep(self, seq_id: int, tokens: list[int], now: float, prompt: int | None = None,
             opened: int = 0) -> list[int]:
        """A reply ended and its KV holds `tokens` (what went into the model: the `prompt`
        first, then the reply but its last token, which was drawn and never fed back);
        `opened`: where the step that computed the prompt began.
        Returns the sequences to free now: this one when it is too short to be worth
        keeping, and the least recently used when more than `most` are kept."""
        if len(tokens) < self.min_match or self.most <= 0:
            return [seq_id]
        prompt = len(tokens) if prompt is None else min(prompt, len(tokens))
        self._kept[seq_id] = Kept(list(tokens), now, prompt, min(opened, prompt))
        self._kept.move_to_end(seq_id)
        out = []
        while len(self._kept) > self.most:
            out.append(self._kept.popitem(last=False)[0])
        return out

    def take(self, prompt: list[int], same_step: bool = False) -> tuple[int, int] | None:
        """The kept sequence sharing the longest start with `prompt`, taken out: (its id,
        how many of the prompt's tokens its KV holds). At least the prompt's last token is
        left to compute: its logits draw the reply's first token. None when no kept
        sequence shares `min_match` tokens and `take_share` of its prompt with it (a start
        shorter than that is computed again, and the kept reply stays for its own
        conversation).

        `same_step`, for a reply that must read as the kept one did (greedy, or seeded):
        where the two part inside the kept request's prompt step, the step is computed
        again as it was, from where it began. A token's last bits follow the step that
        computed it (a prompt's last token in its step's rows, or alone, reduce in other
        orders), so a repeat that computed only the last token could part from the first
        send at a near tie; the cost is the last turn's prompt again, not the conversation."""
        best, best_n = None, 0
        for sid, k in self._kept.items():
            n = common_prefix(k.tokens, prompt)
            if n > best_n and n >= self.take_share * k.prompt:
                best, best_n = sid, n
        best_n = min(best_n, len(prompt) - 1)
        if best is None or best_n < self.min_match:
            return None
        k = self._kept[best]
        if same_step and k.opened < best_n <= k.prompt:
            best_n = k.opened
        del self._kept[best]
        self.hits += 1
        self.reused_tokens += best_n
        return best, best_n

    def evict(self, need: int) -> list[int]:
        """The least recently used, until `need` tokens are let go (or none is left)."""
        out, freed = [], 0
        while self._kept and freed < need:
            sid, k = self._kept.popitem(last=False)
            out.append(sid)
            freed += len(k.tokens)
        return out

    def expired(self, now: float) -> list[int]:
        """Those unused for `idle_s`, taken out: their memory goes back to the stages."""
        out = [sid for sid, k in self._kept.items() if now - k.since >= self.idle_s]
        for sid in out:
            del self._kept[sid]
        return out

    def next_expiry(self) -> float | None:
        """When the least recently used will have been unused `idle_s` (None: nothing kept)."""
        return min((k.since for k in self._kept.values()), default=None) if self._kept else None

    def clear(self) -> list[int]:
        out = list(self._kept)
        self._kept.clear()
        return out
