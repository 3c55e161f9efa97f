"""engine/core/conversation_fit.py: the oldest whole turns left out, as few as fit."""

from __future__ import annotations

import pytest

from engine.core.conversation_fit import fit, prompt_budget


def words(msgs: list[dict]) -> int:
    """A stand-in chat template: a few tokens a message, one a word."""
    return sum(3 + len(m["content"].split()) for m in msgs)


def turns(n: int, size: int = 10) -> list[dict]:
    out = []
    for i in range(n):
        out += [{"role": "user", "content": " ".join([f"q{i}"] * size)},
                {"role": "assistant", "content": " ".join([f"a{i}"] * size)}]
    return out


def test_a_conversation_that_fits_is_left_as_it_is():
    msgs = [{"role": "system", "content": "be brief"}] + turns(3)
    assert fit(msgs, words, 10_000) == (msgs, 0)


@pytest.mark.parametrize("budget", [8, 40, 60, 75, 100, 130, 200])
def test_the_oldest_whole_turns_go_first_and_no_more_than_needed(budget):
    system = {"role": "system", "content": "be brief"}
    msgs = [system] + turns(6) + [{"role": "user", "content": "and now?"}]
    kept, dropped = fit(msgs, words, budget)
    assert kept[0] == system and kept[-1] == msgs[-1]
    assert kept[1]["role"] == "user" and kept[1:] == msgs[1 + dropped:]       # whole turns, oldest first
    if words(kept) > budget:
        assert kept == [system, msgs[-1]]         # only the newest turn is left, and it does not fit
    else:
        longer = [system] + msgs[1 + dropped - 2:]
        assert dropped == 0 or words(longer) > budget     # one turn fewer left out would not fit


def test_a_tool_result_is_never_kept_without_its_call():
    msgs = [{"role": "user", "content": "weather? " * 20},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "content": "sunny " * 20, "tool_call_id": "c1"},
            {"role": "assistant", "content": "It is sunny."},
            {"role": "user", "content": "thanks"}]
    kept, dropped = fit(msgs, words, 20)
    assert (kept, dropped) == ([msgs[-1]], 4)


def test_system_messages_stay_wherever_they_stand():
    rules = {"role": "system", "content": "From now on answer in French."}
    msgs = turns(3) + [rules] + turns(2) + [{"role": "user", "content": "and now?"}]
    kept, dropped = fit(msgs, words, 60)
    assert rules in kept and kept[-1] == msgs[-1] and len(kept) + dropped == len(msgs)
    assert kept[0] == rules and kept[1]["role"] == "user"


def test_one_message_or_one_turn_is_never_dropped():
    one = [{"role": "user", "content": "x " * 500}]
    assert fit(one, words, 10) == (one, 0)
    with_system = [{"role": "system", "content": "s"}] + one
    assert fit(with_system, words, 10) == (with_system, 0)


def test_room_is_left_for_the_reply():
    assert prompt_budget(8192, 256) == 8192 - 256
    assert prompt_budget(8192, 100_000) == 8192 - 2048     # a quarter of the window at most
    assert prompt_budget(100, 0) == 99


def test_a_long_conversation_is_counted_near_what_fits_not_whole():
    """A client's thousand turns with room for a few: each count is of a conversation at
    most about twice what is kept (counting is templating and tokenizing: a bisection over
    the whole counted half of it first), and there are few of them."""
    msgs = [{"role": "system", "content": "be brief"}] + turns(1000)
    sizes = []

    def counting(ms):
        sizes.append(len(ms))
        return words(ms)

    kept, dropped = fit(msgs, counting, 120, whole=words(msgs))   # as fitted_prompt has it
    assert kept == [msgs[0]] + msgs[1 + dropped:] and words(kept) <= 120 < words([msgs[0]] + msgs[dropped - 1:])
    assert max(sizes) <= 2 * len(kept) + 2 and len(sizes) <= 8, sizes
