"""A failed join in words a person can act on (engine/node/plain_errors.py)."""

from __future__ import annotations

from engine.node.plain_errors import join_failed

ACCOUNT = ("could not reach the host's pipeline: the host refused: this invite is used up (2 use(s)) (also: direct "
           "(lan) ws://192.168.1.2:7870: [Errno 101] Connect call failed ('192.168.1.2', 7870); relay "
           "ws://11.54.0.1:8765/v1/join/abd14c83816159c1: the host refused: this invite is used up (2 use(s)))")


def test_each_reason_says_what_happened_and_what_to_do_without_the_engines_words():
    cases = {ACCOUNT: "new code",
             "could not reach the host's pipeline: cannot reach the host: direct (lan) ws://10.0.0.2:7870: "
             "[Errno 113] No route to host": "relay",
             # every address refused: most likely Potluck is not hosting there (tunnel_join)
             "could not reach the host's pipeline: cannot reach the host: direct (lan) ws://10.0.0.2:7870: "
             "[Errno 111] Connect call failed ('10.0.0.2', 7870). Something at the host's address turned the "
             "connection away: most likely Potluck is not hosting there now: ask them to start it":
                 "most likely Potluck is not hosting there now",
             "that invite code cannot be used: this invite has expired": "expired",
             "that invite code cannot be used: a typo? the check characters do not match": "copied all of it",
             "that invite code cannot be used: this code has a typo (its checksum does not match): copy it again":
                 "a character differs",
             "that invite code cannot be used: this code has a typo: 'U' (character 7) is never used in codes":
                 "character no code has",
             "something new and strange: OSError 42": "Try again"}
    for account, hint in cases.items():
        words = join_failed(account)
        assert hint in words, (account, words)
        for engine_word in ("ws://", "Errno", "OSError", "host's pipeline", "(also"):
            assert engine_word not in words, (engine_word, words)


def test_hosting_that_failed_says_why_without_addresses_or_stage_numbers():
    from engine.node.plain_errors import host_failed, membership_ended

    cases = {"cannot reach stage at ws://127.0.0.1:41235: [Errno 111] Connect call failed": "on and sharing",
             "a stage closed its connection during setup: received 1006": "went away while the model was loading",
             "[Errno 98] error while attempting to bind on address ('0.0.0.0', 8000): address already in use":
                 "port",
             "stage 2 (ws://127.0.0.1:41235#s3cr3t): CUDA out of memory. Tried to allocate 2.00 GiB": "smaller model",
             "stage 1 (ws://127.0.0.1:41235): the model 'x' is not one this computer accepts":
                 "Could not start the model: the model 'x' is not one this computer accepts."}
    for account, hint in cases.items():
        words = host_failed(account)
        assert hint in words, (account, words)
        for engine_word in ("ws://", "Errno", "stage 1", "stage 2", "s3cr3t", "0.0.0.0"):
            assert engine_word not in words, (engine_word, words)
    assert "removed this computer" in membership_ended("the host revoked this member")
    assert "stopped answering" in membership_ended("TunnelError: the host refused 5 times")


async def test_a_host_that_refused_is_not_said_to_be_unreachable(tmp_path, monkeypatch):
    """`potluck join` with a used-up code said "could not reach the host's pipeline: the
    host refused: this invite is used up": the host was reached, and refused."""
    import pytest

    from engine.node.homes import Friends, HomeError, join_stage
    from engine.wire.invite import parse
    from engine.wire.tunnel_join import Joiner

    monkeypatch.setattr(Joiner, "GIVE_UP_AFTER", 1)
    friends = Friends(str(tmp_path / "host"))
    await friends.open(listen="127.0.0.1:0")
    invite = parse(friends.invite(uses=1))
    first = None
    try:
        first = await join_stage(invite, name="a", config=str(tmp_path / "a"), threads=1, device="cpu")
        with pytest.raises(HomeError) as refused:
            await join_stage(invite, name="b", config=str(tmp_path / "b"), threads=1, device="cpu")
        said = str(refused.value)
        assert said.startswith("the host refused") and "used up" in said and "could not reach" not in said, said
        assert "new code" in join_failed(said)
    finally:
        if first is not None:
            await first.close("done")
        await friends.close()
