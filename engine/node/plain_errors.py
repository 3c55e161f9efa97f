"""Why a join failed, in words a person can act on: what happened and what to do. The
engine's own account (every address tried, each one's socket error) goes along as the
details, for a bug report or `potluck doctor`, never as the message."""

from __future__ import annotations

# (a phrase of the engine's account, what the person reads); the first that matches
_JOIN = (
    ("used up", "This invite code has already been used by as many computers as it admits. "
                "Ask your friend for a new code."),
    ("revoked", "Your friend withdrew this invite (or this computer's place in their pipeline). "
                "Ask them for a new code if they want you back."),
    ("expired", "This invite code has expired. Ask your friend for a new one."),
    ("typo", "That is not a whole invite code: check that you copied all of it, or ask your friend to send "
             "it again."),
    ("cannot be used", "That is not an invite code Potluck can use: check that you copied all of it, or ask "
                       "your friend to send it again."),
    ("wrong join secret", "That invite code does not match your friend's pipeline any more. Ask them for "
                          "a new code."),
    ("not encrypted to this host", "Something answered at your friend's address that is not their computer, "
                                   "so Potluck did not connect. Ask your friend for a new code."),
    ("another pipeline", "Your friend's computer now hosts a different pipeline. Ask them for a new code."),
    ("short code needs", "A short code needs the relay your friend uses too: fill it in under Advanced."),
    ("cannot reach the host", "Could not reach your friend's computer from here. Check that Potluck is "
                              "running there and hosting; if it is, they can host with a relay, or turn on "
                              "UPnP on their router (`potluck doctor` shows what their router allows)."),
    ("could not reach the host", "Could not reach your friend's computer from here. Check that Potluck is "
                                 "running there and hosting; if it is, they can host with a relay, or turn on "
                                 "UPnP on their router (`potluck doctor` shows what their router allows)."),
)


def join_failed(engine_account: str) -> str:
    """The message for a join that failed (the engine's account of why as details)."""
    text = engine_account or ""
    for phrase, words in _JOIN:
        if phrase in text:
            return words
    return "Could not join your friend's pipeline. Try again in a moment; if it keeps failing, ask your " \
           "friend for a new code."
