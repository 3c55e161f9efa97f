"""core/kept_prefixes.py and the scheduler's count of what is kept: which ended reply a
new prompt takes over, how much of it, and which go when room or time runs out."""

from __future__ import annotations

from engine.core.kept_prefixes import KeptPrefixes, common_prefix
from engine.core.scheduler import Scheduler, Seq

CHAT = list(range(100, 140))          # a conversation's first turn and its reply


def test_the_longest_common_start_is_taken_and_the_last_prompt_token_is_left_to_compute():
    k = KeptPrefixes(min_match=4)
    assert k.keep(1, CHAT, now=0) == []
    assert k.keep(2, CHAT[:10] + [7, 7, 7], now=1) == []
    follow_up = CHAT + [1, 2, 3]
    assert k.take(follow_up) == (1, len(CHAT))        # every kept token, the new ones to compute
    assert 1 not in k and 2 in k and k.tokens == 13 and k.ids() == [2]
    # the same prompt again: its last token is computed, its logits draw the reply
    k.keep(3, CHAT, now=2)
    assert k.take(CHAT) == (3, len(CHAT) - 1)
    assert (k.hits, k.reused_tokens) == (2, 2 * len(CHAT) - 1)


def test_too_little_in_common_is_no_match_and_too_short_a_reply_is_not_kept():
    k = KeptPrefixes(min_match=16)
    assert k.keep(1, CHAT[:15], now=0) == [1]         # freed at once
    assert len(k) == 0
    k.keep(2, CHAT, now=0)
    assert k.take(CHAT[:15] + [1] * 30) is None and 2 in k
    assert KeptPrefixes(most=0).keep(5, CHAT, now=0) == [5]   # keeping switched off


def test_a_new_conversation_sharing_only_the_system_prompt_leaves_anothers_kept_reply():
    system = list(range(500, 530))                    # the chat template's start, in every prompt
    k = KeptPrefixes(min_match=16)
    k.keep(1, system + list(range(1000, 2000)), now=0)   # a friend's long conversation
    assert k.take(system + [7, 8, 9]) is None and 1 in k
    k.keep(2, system + [1, 2, 3, 4, 5], now=1)           # a short one: most of it is the template
    assert k.take(system + [7, 8, 9]) == (2, 30) and 1 in k
    # a regenerated reply (the same prompt, the reply's tokens dropped) takes its own over
    k.keep(3, system + list(range(3000, 3100)) + [9] * 40, now=2, prompt=130)
    assert k.take(system + list(range(3000, 3100))) == (3, 129)
    # and a follow-up that parts from a reply longer than its prompt early in the reply
    # (a template that drops the last turn's thinking) saves the prompt
    k.keep(4, system + list(range(4000, 4100)) + [8] * 400, now=3, prompt=130)
    assert k.take(system + list(range(4000, 4100)) + [8, 7, 7, 7]) == (4, 131)
    assert 1 in k                                      # the friend's is still there for its follow-up


def test_the_least_recently_used_go_first_for_room_count_and_age():
    k = KeptPrefixes(min_match=4, most=2, idle_s=100)
    k.keep(1, CHAT, now=0)
    k.keep(2, CHAT[:20], now=10)
    assert k.keep(3, CHAT[:30], now=20) == [1]        # a third: the oldest goes
    assert k.evict(25) == [2, 3]                      # 20 tokens were not enough room
    k.keep(4, CHAT, now=50)
    k.keep(5, CHAT, now=120)
    assert k.next_expiry() == 50
    assert k.expired(now=160) == [4] and list(k.clear()) == [5] and k.tokens == 0
    assert k.next_expiry() is None
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([], [1]) == 0


def test_the_scheduler_counts_kept_tokens_and_says_how_many_must_go():
    s = Scheduler(n_stages=2, capacity=100, micro_batches=1, prompt_chunk=None)
    s.kept = 60
    s.add(Seq(1, prompt_len=30, max_tokens=20))       # needs 50: 10 more than is free
    assert s.room_wanted() == 10
    assert s.schedule() == []                         # it waits for the room
    s.kept = 50                                       # the head let a kept reply go
    assert s.room_wanted() == 0 and [g.seqs[0].id for g in s.schedule()] == [1]
    s.add(Seq(2, prompt_len=90, max_tokens=10))       # more than all that is kept
    assert s.room_wanted() == 50


def test_a_reply_that_must_read_the_same_computes_the_kept_prompts_step_again():
    """same_step (greedy or seeded): where the prompts part inside the kept request's prompt
    step, the step is computed again from where it began; past its prompt (a follow-up)
    or without same_step, every kept token is taken."""
    system = list(range(500, 530))
    turn2 = system + list(range(600, 700))              # a second turn: its step began at 30
    k = KeptPrefixes(min_match=16)
    k.keep(1, turn2 + [9] * 20, now=0, prompt=len(turn2), opened=30)
    assert k.take(turn2, same_step=True) == (1, 30)    # the same request again
    k.keep(1, turn2 + [9] * 20, now=1, prompt=len(turn2), opened=30)
    assert k.take(turn2) == (1, len(turn2) - 1)        # a sampled one: its last token alone
    k.keep(1, turn2 + [9] * 20, now=2, prompt=len(turn2), opened=30)
    assert k.take(turn2 + [9] * 20 + [4, 4], same_step=True) == (1, len(turn2) + 20)   # a follow-up
    # a fresh prompt's step began at 0: a repeat computes it all, and takes its slot over
    k.keep(2, turn2 + [9] * 20, now=3, prompt=len(turn2))
    assert k.take(turn2, same_step=True) == (2, 0) and len(k) == 0
