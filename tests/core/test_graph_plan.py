"""Which decode steps replay a CUDA graph, and which graphs a stage keeps
(engine/core/graph_plan.py)."""

from __future__ import annotations

from engine.core.graph_plan import GraphBook, GraphPlan, StepShape


def test_rows_round_up_to_a_bucket_and_keys_to_a_power_of_two():
    plan = GraphPlan()
    assert plan.shape_for([1], [10], [0]) == StepShape(1, 1, 256, 0)
    assert plan.shape_for([1] * 3, [10, 300, 5], [0, 1, 2]) == StepShape(4, 1, 512, 0)
    assert plan.shape_for([1] * 9, [0] * 9, list(range(9))) == StepShape(16, 1, 256, 0)
    assert plan.shape_for([1], [256], [0]).kv_len == 512      # position 256 is the 257th key
    assert plan.shape_for([1], [255], [0]).kv_len == 256


def test_rows_in_the_first_slots_read_a_slice_others_gather():
    plan = GraphPlan()
    assert plan.shape_for([1, 1], [3, 4], [0, 1]).lo == 0
    assert plan.shape_for([1, 1], [3, 4], [1, 0]).lo is None
    assert plan.shape_for([1, 1], [3, 4], [0, 2]).lo is None
    # adjacent elsewhere gather too: a graph per first slot would be a capture mid-reply
    # each time a conversation lands in a new slot
    assert plan.shape_for([1, 1], [3, 4], [5, 6]).lo is None
    assert plan.shape_for([1], [3], [1]) == plan.shape_for([1], [9], [7]) == StepShape(1, 1, 256, None)


def test_verification_rows_are_a_bucket_of_their_own_width():
    plan = GraphPlan()
    assert plan.shape_for([5, 5], [10, 20], [0, 1], keep=[5, 5]) == StepShape(2, 5, 256, 0)
    # a prompt piece of a few tokens is no verification: its step runs eagerly
    assert isinstance(plan.shape_for([5], [0], [0], keep=None), str)


def test_steps_that_fit_no_bucket_say_why():
    plan = GraphPlan(max_kv=1024)
    assert plan.shape_for([1, 5], [3, 3], [0, 1], keep=[1, 5]) == "rows of different lengths"
    assert plan.shape_for([12], [0], [0], keep=[12]) == "rows of 12 tokens (a prompt)"
    assert plan.shape_for([1] * 33, [0] * 33, list(range(33))) == "33 rows, more than 32"
    assert plan.shape_for([1], [1024], [0]) == "a context of 1025 tokens, past 1024"
    # a context under the limit whose bucket would pass it attends over the limit
    assert GraphPlan(max_kv=600).shape_for([1], [520], [0]).kv_len == 600


def test_warm_shapes_are_decode_steps_in_the_first_slots_one_user_anywhere_and_its_verifications():
    shapes = GraphPlan().warm_shapes(16)
    assert [(s.rows, s.tokens, s.lo) for s in shapes] == [
        (1, 1, 0), (2, 1, 0), (4, 1, 0), (8, 1, 0), (16, 1, 0), (1, 1, None),
        (1, 2, 0), (1, 3, 0), (1, 5, 0), (1, 9, 0), (1, 2, None), (1, 3, None), (1, 5, None), (1, 9, None)]
    assert all(s.kv_len == 256 for s in shapes)
    assert all(s.tokens == 1 for s in GraphPlan(max_tokens=1).warm_shapes(16))


def test_a_verification_step_is_padded_to_its_bucket_of_tokens():
    plan = GraphPlan()
    got = {n: plan.shape_for([n, n], [10, 250], [0, 1], keep=[n, n]) for n in range(2, 10)}
    assert {n: s.tokens for n, s in got.items()} == {2: 2, 3: 3, 4: 5, 5: 5, 6: 9, 7: 9, 8: 9, 9: 9}
    # the keys cover the padding positions' writes: 250 + 9 past 256
    assert got[4].kv_len == 256 and got[6].kv_len == 512
    assert plan.shape_for([1], [10], [0]).tokens == 1


def test_the_book_evicts_the_least_recently_used_graph():
    book = GraphBook(max_graphs=2)
    a, b, c = StepShape(1, 1, 256, 0), StepShape(2, 1, 256, 0), StepShape(4, 1, 256, 0)
    assert book.captured(a, 0.1, 10) == []
    assert book.captured(b, 0.1, 10) == []
    book.used(a)                     # b is now the least recently used
    assert book.captured(c, 0.1, 10) == [b]
    assert book.live == [a, c]
    assert book.summary()["captures"] == 3 and book.summary()["replays"] == 1


def test_failed_captures_are_not_retried_and_enough_of_them_stop_capturing():
    book = GraphBook(max_failures=2)
    a, b, c = StepShape(1, 1, 256, 0), StepShape(2, 1, 256, 0), StepShape(4, 1, 256, 0)
    book.capture_failed(a, "RuntimeError: operation not permitted when stream is capturing")
    assert not book.may_capture(a) and book.may_capture(b) and book.disabled is None
    book.capture_failed(b, "RuntimeError: again")
    assert not book.may_capture(c)
    assert "2 captures failed" in book.disabled and "again" in book.disabled
    assert book.summary()["failed"][a.label()].startswith("RuntimeError")


def test_failed_verification_captures_stop_only_verification_captures():
    """One user's verification steps are tried at load: a family whose several tokens a
    row take a path that cannot be captured must keep its decode steps' graphs."""
    book = GraphBook(max_failures=2)
    v2, v3, v5 = (StepShape(1, t, 256, 0) for t in (2, 3, 5))
    book.capture_failed(v2, "refused: reads the host")
    book.capture_failed(v3, "refused: reads the host")
    assert book.disabled is None and "2 captures of verification" in book.verify_disabled
    assert not book.may_capture(v5) and book.may_capture(StepShape(1, 1, 512, 0))
    assert book.summary()["verify_disabled"] == book.verify_disabled


def test_few_rows_attend_over_more_keys_where_they_cost_little_beside_the_weights():
    from engine.core.graph_plan import row_floors

    per_token = 32 * 2 * 8 * 128 * 2                   # an 8B model's keys and values, bf16
    floors = row_floors(16 * 10**9, per_token, cap=2048)
    assert floors == ((1, 2048), (2, 1024), (4, 512))  # 8 and 16 rows: 256, as before
    assert row_floors(270 * 10**6, 30 * 2 * 3 * 64 * 2, cap=2048) == ()   # a 135M model: none
    assert row_floors(16 * 10**9, per_token, cap=512) == ((1, 512), (2, 512), (4, 512))   # the reserve bounds it
    plan = GraphPlan(floors=floors)
    # one user's chat crosses no bucket until 2,048 tokens; 16 users' steps as before
    assert {plan.shape_for([1], [s], [0]).kv_len for s in (10, 300, 1500, 2047)} == {2048}
    assert plan.shape_for([1], [2048], [0]).kv_len == 4096
    assert plan.shape_for([1] * 16, list(range(16)), list(range(16))).kv_len == 256
    assert [(s.rows, s.tokens, s.kv_len) for s in plan.warm_shapes(16)][:6] == [
        (1, 1, 2048), (2, 1, 1024), (4, 1, 512), (8, 1, 256), (16, 1, 256), (1, 1, 2048)]
    assert all(s.kv_len == 2048 for s in plan.warm_shapes(16) if s.tokens > 1)


def test_near_the_context_limit_a_verification_step_is_not_padded_past_it():
    plan = GraphPlan(max_kv=1024)
    assert plan.shape_for([4], [1018], [0], keep=[4]).tokens == 5
    assert plan.shape_for([4], [1020], [0], keep=[4]).tokens == 4      # 1020 + 5 would pass 1024
    assert plan.shape_for([4], [1021], [0], keep=[4]) == "a context of 1025 tokens, past 1024"


def test_few_rows_keys_are_also_weighed_in_the_time_their_attention_takes():
    """On a GPU one row's attention walks its keys a block per key/value head, far below
    the bandwidth its bytes would take: the byte rule's floors come down where the time
    attending over them adds more than the share, stay where it does not."""
    from engine.core.graph_plan import timed_floors

    byte_floors = ((1, 2048), (2, 1024), (4, 512))
    weights = 4.5e-3          # an 8B model's weights read in 4.5 ms
    starved = lambda rows, keys: 4e-6 + 0.035e-6 * keys          # ~13 us a layer at 256 keys
    assert timed_floors(byte_floors, starved, weights, layers=32) == ()
    fast = lambda rows, keys: 4e-6 + rows * keys * 128 * 1024 / 32 / 3e12   # at the bandwidth
    assert timed_floors(byte_floors, fast, weights, layers=32) == byte_floors
    # between: one user's 512 keys add 0.11 ms (within 3% of 4.5 ms), 1,024 add 0.34
    middling = lambda rows, keys: 4e-6 + rows * 0.0138e-6 * keys
    assert timed_floors(byte_floors, middling, weights, layers=32) == ((1, 512),)
    # timed only where the byte rule allows more keys, each count once per row bucket
    asked = []
    timed_floors(byte_floors, lambda r, k: asked.append((r, k)) or 0.0, weights, layers=32)
    assert sorted(set(asked)) == sorted(asked) and max(k for r, k in asked if r == 4) == 512


def test_the_key_buckets_one_users_floor_gave_up_for_time_are_captured_at_load():
    from engine.core.graph_plan import ahead_keys

    byte_floors = ((1, 2048), (2, 1024), (4, 512))
    assert ahead_keys(byte_floors, ()) == (512, 1024, 2048)
    assert ahead_keys(byte_floors, ((1, 1024),)) == (2048,)
    assert ahead_keys(byte_floors, byte_floors) == ()
    assert ahead_keys((), ()) == ()
    plan = GraphPlan(ahead=ahead_keys(byte_floors, ()))
    shapes = plan.warm_shapes(16)
    assert len(shapes) == len(GraphPlan().warm_shapes(16)) + 3
    assert [(s.rows, s.tokens, s.kv_len, s.lo) for s in shapes[-3:]] == [(1, 1, 512, 0), (1, 1, 1024, 0),
                                                                         (1, 1, 2048, 0)]
    # a chat's context past 256 finds its one-user decode graph among them
    assert plan.shape_for([1], [300], [0]) == shapes[-3]
