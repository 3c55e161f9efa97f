"""The head's scheduler without sockets: plain inputs -> plan (engine/core/scheduler.py)."""

import math

import pytest

from engine.core.link_scheduler import LinkEstimate
from engine.core.prompt_chunk import CAP
from engine.core.scheduler import RETUNE_EVERY_S, Scheduler, Seq

# a stage whose decode step costs 10 ms at 1 row and 20 ms at 16; prefill 1 ms/token
PROFILE = {"decode": [[1, 0.010], [16, 0.020]], "prefill": [[32, 0.032], [256, 0.256]]}


def seqs(*lens, max_tokens=10):
    return [Seq(i, n, max_tokens) for i, n in enumerate(lens, start=1)]


def sched(n_stages=2, capacity=10_000, **kw):
    kw.setdefault("hop_bytes", 1000)
    return Scheduler(n_stages, capacity, **kw)


def decoding(s, n):
    """n short requests, admitted and through their first step: every micro-batch decodes."""
    for q in seqs(*[5] * n):
        s.add(q)
    for g in s.schedule():
        s.step_rows(g)
        s.on_result(g)


def link(mbit=10.0, rtt=0.02):
    est = LinkEstimate()
    est.observe_goodput(mbit * 1e6 / 8)
    est.observe_rtt(rtt)
    return est


def test_admission_fills_idle_micro_batches_by_fair_share():
    s = sched(micro_batches=2)
    for q in seqs(5, 6, 7, 8):
        s.add(q)
    launched = s.schedule()
    assert [g.id for g in launched] == [0, 1]
    assert [[q.id for q in g.seqs] for g in launched] == [[1, 2], [3, 4]]   # ceil(4 / 2) each
    assert all(g.in_flight and g.step == 1 for g in launched)
    assert s.reserved == sum(q.reservation for g in launched for q in g.seqs) and not s.waiting
    assert s.schedule() == []          # everything is in flight: nothing more to launch


def test_admission_waits_for_kv_and_resumes_when_released():
    a, b = seqs(60, 60, max_tokens=40)           # 100 tokens of KV each
    s = sched(capacity=150, micro_batches=2)
    s.add(a)
    s.add(b)
    (g,) = s.schedule()
    assert g.seqs == [a] and s.waiting == [b]    # b does not fit beside a
    a.done = True
    assert s.release(a) and s.reserved == 0
    s.on_result(g)
    launched = s.schedule()
    assert [q for x in launched for q in x.seqs] == [b]


def test_step_rows_open_new_sequences_and_decode_one_token_for_the_others():
    s = sched(micro_batches=1)
    old, new = seqs(5, 7)
    old.opened, old.pos = True, 6
    s.add(old)
    s.add(new)
    (g,) = s.schedule()
    rows = s.step_rows(g)
    assert [(r.seq, r.pos, r.n, r.new) for r in rows] == [(old, 6, 1, False), (new, 0, 7, True)]
    assert new.opened and new.in_flight == 7 and old.in_flight == 1
    s.advance(new)
    assert new.pos == 7 and new.in_flight == 0
    new.done = True
    s.on_result(g)
    assert g.seqs == [old] and not g.in_flight and old.in_flight == 0


def test_a_newcomer_gets_a_micro_batch_of_its_own_when_all_are_decoding():
    s = sched(n_stages=2)                        # dynamic: M..2M
    assert s.dynamic and s.micro_batches == 2
    decoding(s, 2)                               # both micro-batches decoding, back at the head
    late = seqs(50)[0]
    late.id = 99
    s.add(late)
    launched = s.schedule()
    holder = [g for g in launched if late in g.seqs]
    assert len(s.groups) == 3 and holder and holder[0].id == 2 and holder[0].seqs == [late]
    # it leaves once its request is done (trailing, empty, idle)
    s.step_rows(holder[0])
    late.done = True
    s.release(late)
    s.on_result(holder[0])
    s.schedule()
    assert len(s.groups) == 2


def test_a_fixed_count_keeps_newcomers_in_decoding_batches():
    s = sched(n_stages=2, micro_batches=2)
    decoding(s, 2)
    late = Seq(99, 50, 10)
    s.add(late)
    s.schedule()
    assert len(s.groups) == 2 and any(late in g.seqs for g in s.groups)


def test_stages_sharing_this_cpu_get_one_micro_batch_and_whole_lone_prompts():
    s = sched(n_stages=3, shared_cpu=True)
    assert s.micro_batches == 1 and not s.dynamic
    q = seqs(300)[0]
    s.add(q)
    assert s.chunk_size(PROFILE["prefill"], None) == CAP
    assert s.prompt_chunk(q, PROFILE["prefill"], None) is None      # alone: one whole step


def test_a_lone_prompt_is_cut_finer_so_every_stage_works_on_it():
    s = sched(n_stages=2, prompt_chunk=64)
    q = seqs(100)[0]
    s.add(q)
    assert s.prompt_chunk(q, PROFILE["prefill"], 1e6) == max(16, math.ceil(100 / 4))
    s.add(Seq(2, 100, 10))                                            # not alone any more
    assert s.prompt_chunk(q, PROFILE["prefill"], 1e6) == 64


def test_auto_chunks_follow_the_link():
    s = sched(n_stages=2, prompt_chunk="auto", hop_bytes=2304)
    slow = s.chunk_size(PROFILE["prefill"], 0.4e6)     # ~3 Mbit/s
    fast = s.chunk_size(PROFILE["prefill"], 1e9)
    assert fast == CAP and 0 < slow < fast
    assert Scheduler(2, prompt_chunk=None).chunk_size(PROFILE["prefill"], 1e6) is None
    assert Scheduler(1, prompt_chunk=64).prefill_chunk is None        # no link, no chunks
    with pytest.raises(ValueError):
        Scheduler(2, prompt_chunk=0)


def test_retune_picks_more_micro_batches_over_a_long_link_and_retires_extra_ones():
    # steps that grow with their rows, and a link whose delay leaves bubbles to fill
    steep = {"decode": [[1, 0.01], [16, 0.16]], "prefill": PROFILE["prefill"]}
    s = sched(n_stages=2, hop_bytes=1000)
    for q in seqs(*[5] * 16):
        s.add(q)
    assert s.retune_due(0.0)
    s.retune(0.0, [steep, steep], link(mbit=100, rtt=0.4))
    assert s.micro_batches > 2 and len(s.groups) == s.micro_batches
    assert not s.retune_due(RETUNE_EVERY_S / 2) and s.retune_due(RETUNE_EVERY_S)
    s.retune(1.0, [steep, steep], link(mbit=10_000, rtt=0.0002))   # the link got short
    assert s.micro_batches == 2 and len(s.groups) == 2                  # empty extra ones left


def test_retune_without_a_link_or_with_a_fixed_count_changes_nothing():
    s = sched(n_stages=2)
    s.retune(0.0, [PROFILE, PROFILE], None)
    assert s.micro_batches == 2
    f = sched(n_stages=2, micro_batches=3)
    f.retune(0.0, [PROFILE, PROFILE], link(mbit=1))
    assert f.micro_batches == 3 and len(f.groups) == 3


def test_release_of_a_waiting_or_in_flight_sequence():
    s = sched(micro_batches=1)
    a, b = seqs(5, 5)
    s.add(a)
    (g,) = s.schedule()
    s.add(b)
    assert s.withdraw(b) and not s.withdraw(b)           # cancelled before it started
    assert not s.release(b)                              # never admitted: nothing to return
    a.done = True
    assert s.release(a) and s.reserved == 0
    assert g.seqs == [a]                                 # in flight: it leaves when the step is back
    s.on_result(g)
    assert g.seqs == []


def test_a_removed_micro_batch_keeps_its_step_count():
    """Frames of a micro-batch that left must not match a new one with the same id."""
    s = sched(n_stages=2)
    decoding(s, 2)
    late = Seq(9, 5, 10)
    s.add(late)
    (g3,) = [g for g in s.schedule() if late in g.seqs]
    steps = g3.step
    s.step_rows(g3)
    late.done = True
    s.release(late)
    s.on_result(g3)
    s.schedule()                                          # g3 leaves
    s.add(Seq(10, 5, 10))
    again = [g for g in s.schedule() if g.id == g3.id]
    assert again and again[0].step > steps


# ---- n > 1: a request's other choices fork from its prompt step ----------------------

def with_forks(n_forks, prompt=5, max_tokens=10, first_id=1):
    lead = Seq(first_id, prompt, max_tokens)
    lead.forks = [Seq(first_id + 1 + i, prompt, max_tokens) for i in range(n_forks)]
    return lead


def test_forks_are_admitted_with_their_parent_and_join_at_its_prompt_step():
    s = sched(micro_batches=1)
    lead = with_forks(2)
    s.add(lead)
    assert s.active() == 3 and all(f.parent is lead for f in lead.forks)
    (g,) = s.schedule()
    assert g.seqs == [lead] and s.reserved == 3 * lead.reservation   # each fork holds a copy
    forks = list(lead.forks)
    rows = s.step_rows(g)
    # one row computes the prompt; the forks ride on it, in flight, and are in the batch
    assert [(r.seq, r.n, r.new, r.forks) for r in rows] == [(lead, 5, True, forks)]
    assert g.seqs == [lead] + forks and not lead.forks
    assert all(f.opened and f.in_flight == 5 and f.parent is None for f in forks)
    for q in g.seqs:
        s.advance(q)
    s.on_result(g)
    assert all(q.pos == 5 for q in g.seqs)
    (g2,) = s.schedule()
    assert [(r.seq, r.pos, r.n, r.new) for r in s.step_rows(g2)] == [(q, 5, 1, False) for q in [lead] + forks]


def test_a_request_waits_until_the_kv_holds_all_its_choices():
    s = sched(capacity=40, micro_batches=1)
    lead = with_forks(2)                                   # 3 x 15 tokens
    s.add(lead)
    assert s.schedule() == [] and s.waiting == [lead]
    s.capacity = 45
    assert [g.seqs for g in s.schedule()] == [[lead]]


def test_a_waiting_fork_that_is_cancelled_returns_its_reservation():
    s = sched(micro_batches=1)
    lead = with_forks(2)
    s.add(lead)
    s.schedule()
    f = lead.forks[0]
    assert s.withdraw(f) and f.parent is None and lead.forks == [lead.forks[0]]
    assert s.reserved == 2 * lead.reservation
    assert not s.release(f)                                # never in a micro-batch


def test_a_cancelled_parent_hands_its_forks_on():
    s = sched(micro_batches=1)
    lead = with_forks(2)
    a, b = lead.forks
    s.add(Seq(99, 5, 10))
    s.add(lead)
    assert s.withdraw(lead)                                # still queued: the first fork takes its place
    assert s.waiting[1] is a and a.forks == [b] and b.parent is a and a.parent is None
    assert s.active() == 3


def test_an_admitted_parent_that_leaves_before_its_step_requeues_its_forks():
    s = sched(micro_batches=1)
    lead = with_forks(2)
    a, b = lead.forks
    s.add(lead)
    (g,) = s.schedule()
    g.in_flight = False                                    # (its launch had not built the step)
    lead.done = True
    assert s.release(lead)
    assert s.reserved == 0 and s.waiting == [a] and a.forks == [b] and g.seqs == []
    (g,) = s.schedule()
    assert g.seqs == [a] and s.reserved == 2 * a.reservation


# ---- one stage: the prompt lane (a long prompt in pieces between the decode steps) ----

def test_a_long_prompt_goes_through_the_lane_and_short_ones_pass_it():
    from engine.core.prompt_chunk import lane_chunk_tokens

    s = sched(n_stages=1)
    s.lane_chunk = lane_chunk_tokens(PROFILE["prefill"])   # 1 ms a token: 256 tokens a piece
    assert s.lane_chunk == 256
    long1, long2, short, edge = Seq(1, 2000, 10), Seq(2, 1500, 10), Seq(3, 20, 10), Seq(4, 512, 10)
    for q in (long1, long2, short, edge):
        s.add(q)
    assert s.take_for_lane() is long1 and s.lane is long1
    assert s.take_for_lane() is None                        # one prompt in the lane at a time
    [g] = s.schedule()
    assert g.seqs == [short, edge]                          # two pieces or fewer go whole; long2 waits
    assert s.reserved == long1.need + short.need + edge.need and s.active() == 4
    long1.pos = 2000 - 200                                  # the head computed all but its last piece
    s.lane_done(long1)
    assert s.lane is None and s.waiting[0] is long1 and s.reserved == short.need + edge.need
    assert s.take_for_lane() is long2


def test_a_prompt_in_the_lane_that_ends_returns_its_reservation():
    s = sched(n_stages=1)
    s.lane_chunk = 256
    q = Seq(1, 4000, 10)
    s.add(q)
    assert s.take_for_lane() is q and s.reserved == q.need
    assert s.release(q) is True        # it holds KV: the head frees it everywhere
    assert s.lane is None and s.reserved == 0 and s.active() == 0


def test_the_lane_leaves_requests_of_several_choices_and_many_stages_alone():
    s = sched(n_stages=1)
    s.lane_chunk = 256
    parent, fork = Seq(1, 4000, 10), Seq(2, 4000, 10)
    parent.forks = [fork]
    s.add(parent)
    assert s.take_for_lane() is None
    [g] = s.schedule()
    assert g.seqs == [parent]
    s = sched(n_stages=2)              # no lane set: prompts stream in link-sized chunks instead
    s.add(Seq(1, 4000, 10))
    assert s.take_for_lane() is None


def test_lane_pieces_follow_the_stages_speed():
    from engine.core.prompt_chunk import LANE_MAX, LANE_MIN, lane_chunk_tokens

    assert lane_chunk_tokens(None) is None and lane_chunk_tokens([]) is None
    slow = [[256, 2.0], [1024, 8.0]]                  # a CPU: 128 tokens a second
    fast = [[256, 0.002], [4096, 0.03]]               # a GPU
    assert lane_chunk_tokens(slow) == LANE_MIN and lane_chunk_tokens(fast) == LANE_MAX
