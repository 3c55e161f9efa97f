"""A conversation fitted to the model's context window by leaving out its oldest turns.

A chat that goes on long enough outgrows the window (8,192 tokens for the default model:
an evening's chat). The API refuses such a prompt, as OpenAI's does; the chat window and
`potluck chat` would then stop answering, and the only way on was a new conversation.
Asked to (the API's `context_overflow: "drop_oldest"`), the oldest turns are left out
instead, whole: a turn starts at a user message, so what is kept never opens with a
reply or a tool's result whose call was left out. System messages always stay, wherever
they stand (they say how to answer, not what was said), and so does the newest turn, even
when it does not fit on its own (then the caller says so, as before). Pure: the caller counts a candidate's tokens (its chat template applied).
"""

from __future__ import annotations

from typing import Callable, Sequence

OVERFLOW_CHOICES = ("error", "drop_oldest")


def prompt_budget(context_length: int, max_tokens: int) -> int:
    """The most prompt tokens a fitted conversation may hold: room is left for the reply,
    up to a quarter of the window (a reply asked to be longer is cut at the window's end,
    as any reply is)."""
    return context_length - max(1, min(max_tokens, context_length // 4))


def fit(messages: Sequence[dict], count: Callable[[list[dict]], int], budget: int,
        whole: int | None = None) -> tuple[list[dict], int]:
    """(the messages kept, how many were left out). Drops as few whole turns as bring
    count(kept) to at most budget; count need not be cheap, it is called O(log turns)
    times, on conversations up to about twice what fits. whole: the whole conversation's
    count, where the caller has it."""
    msgs = list(messages)
    if (count(msgs) if whole is None else whole) <= budget:
        return msgs, 0
    first = next((i for i, m in enumerate(msgs) if m.get("role") != "system"), len(msgs))
    # where a kept part may begin: a user message after the first turn
    starts = [i for i in range(first + 1, len(msgs)) if msgs[i].get("role") == "user"]
    if not starts:
        return msgs, 0

    def kept(start: int) -> list[dict]:
        return [m for m in msgs[:start] if m.get("role") == "system"] + msgs[start:]

    # the first start that fits, else the last. Searched from the newest end, 1, 2, 4...
    # turns back, then bisected: what is counted stays near the window's size, where a
    # bisection over the whole conversation counts half of it first (a client's thousand
    # long messages were counted ten times over, a minute of templating)
    hi = len(starts) - 1             # known to fit (else nothing does)
    fits = count(kept(starts[hi])) <= budget
    step, lo = 1, -1                 # lo: known not to fit (-1: nothing known)
    while fits and hi > 0:
        probe = max(0, hi - step)
        if count(kept(starts[probe])) <= budget:
            hi, step = probe, step * 2
        else:
            lo = probe
            break
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if count(kept(starts[mid])) <= budget:
            hi = mid
        else:
            lo = mid
    out = kept(starts[hi])
    return out, len(msgs) - len(out)


def fitted_prompt(template: Callable[[list[dict]], list[int]], messages: Sequence[dict], context_length: int,
                  max_tokens: int) -> tuple[list[int], int]:
    """The conversation's prompt (template: messages -> token ids, its chat template
    applied), its oldest turns left out where it holds more than prompt_budget; and how
    many messages were left out."""
    prompt = template(list(messages))
    budget = prompt_budget(context_length, max_tokens)
    if len(prompt) <= budget:
        return prompt, 0
    kept, dropped = fit(messages, lambda ms: len(template(ms)), budget, whole=len(prompt))
    return (template(kept) if dropped else prompt), dropped
