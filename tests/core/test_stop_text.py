"""A reply's text against its stop sequences (engine/core/stop_text.py): nothing of a stop
is ever released, nothing else is held past the point where it could not begin one."""

from __future__ import annotations

import random

import pytest

from engine.core.stop_text import StopText


def run(pieces, stops):
    st = StopText(stops)
    out = []
    for i, p in enumerate(pieces):
        out += st.add(p, i)
        if st.stopped:
            break
    else:
        out += st.flush()
    return st, out


def test_a_stop_of_several_tokens_releases_nothing_of_itself():
    st, out = run(["Hello", "!", " How", " can", " I", " help"], ["How can I"])
    assert st.stopped and "".join(t for t, _ in out) == "Hello! "
    # the piece the stop begins in comes out cut, with its payload; nothing after it
    assert out == [("Hello", 0), ("!", 1), (" ", 2)]


def test_text_is_held_only_while_it_could_begin_a_stop():
    st = StopText(["How can I"])
    assert st.add("Hello", 0) == [("Hello", 0)]
    assert st.add(" How", 1) == []            # "How" may begin the stop
    assert st.add(" are", 2) == [(" How", 1), (" are", 2)]   # it did not
    assert not st.stopped and st.flush() == []


def test_held_text_comes_out_when_the_reply_ends_otherwise():
    st, out = run(["Say", " How", " can"], ["How can I"])
    assert not st.stopped and out == [("Say", 0), (" How", 1), (" can", 2)]


def test_no_stop_releases_every_piece_at_once():
    st = StopText([])
    assert [st.add(p, i) for i, p in enumerate(["a", "", "b"])] == [[("a", 0)], [("", 1)], [("b", 2)]]


def test_the_earliest_of_two_stops_ending_in_one_piece_wins():
    st, out = run(["x", "abcd"], ["cd", "ab"])
    assert "".join(t for t, _ in out) == "x" and st.text == "x"


def test_a_stop_at_the_very_start_releases_nothing():
    st, out = run(["END", "more"], ["END"])
    assert st.stopped and out == []


def test_a_stop_found_after_the_reply_stopped_is_refused():
    st, _ = run(["a", "b"], ["b"])
    with pytest.raises(ValueError):
        st.add("c", 9)


@pytest.mark.parametrize("seed", range(40))
def test_against_the_whole_text_cut_at_its_first_stop(seed):
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    st, out = run(pieces, stops)
    ends = [text.find(s) + len(s) for s in stops if s in text]
    if ends:
        # the reply ends with the piece that completes the first stop: cut before it
        upto = min(ends)
        seen = "".join(pieces)[:0]
        for p in pieces:
            seen += p
            if len(seen) >= upto:
                break
        first = min(seen.find(s) for s in stops if s in seen)
        expected = seen[:first]
    else:
        expected = text
    assert "".join(t for t, _ in out) == expected == st.text
    assert st.stopped == bool(ends)
    payloads = [p for _, p in out]
    assert payloads == sorted(set(payloads))   # in order, each at most once
