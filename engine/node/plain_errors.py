"""Why a join or hosting failed, in words a person can act on: what happened and what to
do. The engine's own account (every address tried, each one's socket error) goes along as
the details or to the log, for a bug report or `potluck doctor`, never as the message."""

from __future__ import annotations

import re

# (a phrase of the engine's account, what the person reads); the first that matches
_JOIN = (
    ("used up", "This invite code has already been used by as many computers as it admits. "
                "Ask your friend for a new code."),
    ("revoked", "Your friend withdrew this invite (or this computer's place in what they host). "
                "Ask them for a new code if they want you back."),
    ("expired", "This invite code has expired. Ask your friend for a new one."),
    ("checksum", "That invite code has a typo: a character differs from the code your friend sent. Copy it "
                 "again, or ask them to send it again."),
    ("never used in codes", "That invite code holds a character no code has: copy it again, or ask your friend "
                            "to send it again."),
    ("typo", "That is not a whole invite code: check that you copied all of it, or ask your friend to send "
             "it again."),
    ("cannot be used", "That is not an invite code Potluck can use: check that you copied all of it, or ask "
                       "your friend to send it again."),
    ("wrong join secret", "That invite code does not match what your friend hosts now. Ask them for "
                          "a new code."),
    ("not encrypted to this host", "Something answered at your friend's address that is not their computer, "
                                   "so Potluck did not connect. Ask your friend for a new code."),
    ("another pipeline", "Your friend has started hosting anew since this code was made. Ask them for a new code."),
    ("short code needs", "A short code needs the relay your friend uses too: fill it in under Advanced."),
    ("not hosting there now", "Your friend's computer (or their router) turned the connection away: most "
                              "likely Potluck is not hosting there now. Ask them to open Potluck and host "
                              "again, then try this code again. If it is hosting, they can host with a relay, "
                              "or turn on UPnP on their router."),
    ("reply code within", "Your friend did not connect with this computer's reply code in time, so joining "
                          "stopped. Check with them that they are hosting now (an invite they withdrew no "
                          "longer works), then join again."),
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
    return "Could not join your friend. Try again in a moment; if it keeps failing, ask your " \
           "friend for a new code."


# why hosting failed: (a phrase of the engine's account, what the person reads)
_HOST = (
    ("address already in use", "Another program already uses the port Potluck's API needs. Close that "
                               "program, or choose another port under Advanced, and host again."),
    ("cannot reach stage", "A friend's computer did not answer while it was being set up: check that "
                           "it is on and sharing, then host again."),
    ("closed its connection during setup", "A friend's computer went away while the model was loading: "
                                           "check that it is on and sharing, then host again."),
    ("no friend joined", "Not enough friends joined in time. Send them the invite again and host again."),
    ("timed out waiting", "Not enough friends joined in time. Send them the invite again and host again."),
    ("out of memory", "The model did not fit in the memory there is: choose a smaller model or 4-bit weights, "
                      "or invite a friend to share the load."),
    ("not enough memory", "The model did not fit in the memory there is: choose a smaller model or 4-bit "
                          "weights, or invite a friend to share the load."),
)

# the engine's words that must not reach a person: an address, a stage's number and address
_ENGINE = re.compile(r"\s*\(?wss?://[^\s)]*\)?|\bstage \d+\s*")


def host_failed(engine_account: str) -> str:
    """The message for hosting that failed. The engine's account goes to the log; a reason
    with no known wording keeps its text, minus addresses and stage numbers."""
    text = engine_account or ""
    low = text.lower()
    for phrase, words in _HOST:
        if phrase in low:
            return words
    said = _ENGINE.sub(" ", text).strip(" :")
    said = re.sub(r"\s{2,}", " ", said)
    return f"Could not start the model: {said}." if said else "Could not start the model. Try again."


def membership_ended(engine_account: str) -> str:
    """The message for a friend whose host ended this computer's membership."""
    if "revoked" in (engine_account or ""):
        return "Your friend removed this computer from what they host. Ask them for a new code if they want " \
               "you back."
    return "Your friend's computer stopped answering for good, so this computer stopped sharing with it. " \
           "Join again with their code when they host again."
