"""The command line's argument types (engine/cli/): each holds a value to its range as
the command line is read. A mistake said there costs a line; found after the model loaded,
it cost minutes."""

from __future__ import annotations

import argparse
import ipaddress
import re

from engine.core.local_stages import MOST as MOST_LOCAL_STAGES
from engine.core.sampling import PENALTY_RANGE, SamplingParams
from engine.core.ws_address import address_problem


def prompt_chunk_arg(text: str):
    """--prompt-chunk: 'auto' or a positive number of tokens."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a positive number of tokens")
    return n


def ranged_arg(parse, lo, hi, what: str):
    """An argparse type: `parse(text)` from lo to hi, else argparse's error saying `what`."""
    def arg(text: str):
        try:
            v = parse(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:   # NaN is out of every range
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return v
    return arg


# --presence-penalty / --frequency-penalty: OpenAI's range
penalty_arg = ranged_arg(float, *PENALTY_RANGE, f"a number from {PENALTY_RANGE[0]:g} to {PENALTY_RANGE[1]:g}")
port_arg = ranged_arg(int, 0, 65535, "a port number (1 to 65535, or 0 for a free one)")
# an invite's life: a code that has expired as it is printed helps nobody (at most a year)
hours_arg = ranged_arg(float, 1 / 60, 24 * 366, "a number of hours from 1/60 (a minute) to a year")
stages_arg = ranged_arg(int, 1, MOST_LOCAL_STAGES, f"a number of stages from 1 to {MOST_LOCAL_STAGES}")
# tokens, friends, uses, threads
count_arg = ranged_arg(int, 1, float("inf"), "a whole number from 1")
# groups of requests in flight: the head picks from the stages to twice as many; each
# group more splits the same users thinner and adds a trip's bookkeeping (100000 left a
# reply waiting for ever)
MOST_MICRO_BATCHES = 64
micro_batches_arg = ranged_arg(int, 1, MOST_MICRO_BATCHES, f"a number of micro-batches from 1 to {MOST_MICRO_BATCHES}")


def stage_addr_arg(text: str) -> str:
    """--stage-addr: ws://host:port#secret; anything else failed after the model loaded, in
    the websockets library's words."""
    problem = address_problem(text, "a stage's address")
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text.strip()


def listen_arg(text: str) -> str:
    """--listen / --reply-listen: HOST:PORT (HOST may be empty: every address); a port out
    of range ended the command with a traceback from bind()."""
    if not text.strip():
        return ""   # not asked for
    host, sep, port = text.strip().rpartition(":")
    try:
        ok = bool(sep) and 0 <= int(port) <= 65535
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port from 0 to 65535 "
                                         "(e.g. 0.0.0.0:7870)")
    return text.strip()


# --memory-cap-mb (MiB, as it says), and seconds to wait: a negative one ran and said
# the machines had -3 MB to give
mb_arg = ranged_arg(float, 1, float("inf"), "a number of MiB from 1")
seconds_arg = ranged_arg(float, 0, float("inf"), "a number of seconds from 0")


def sampling_arg(name: str, parse):
    """An argparse type for one sampling setting, held to what a request may ask
    (SamplingParams.validate), so a bad one is said now, not at every message."""
    def arg(text: str):
        try:
            v = parse(text)
        except ValueError:   # Python's own words ("invalid literal for int() with base 10")
            kind = "a whole number" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        try:
            SamplingParams(**{name: v}).validate()
        except ValueError as exc:   # SamplingError is one; said with the flag's name (top-p)
            raise argparse.ArgumentTypeError(f"{text!r}: {str(exc).replace(name, name.replace('_', '-'))}") from None
        return v
    return arg


def relay_arg(text: str) -> str:
    """--relay: ws://host:port (or wss://); an http:// one went into the invite and failed
    at every registration, a library's words once a second."""
    text = text.strip()
    problem = text and address_problem(text, "a relay's address", relay=True)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def advertise_arg(text: str) -> str:
    """--advertise: what a friend dials to reach --listen, put in the invite as it is: an
    address or a name (the port --listen took is added), HOST:PORT (a router that forwards
    another outside port), or ws://host:port. Anything else went into the invite and every
    friend's join failed on it."""
    text = text.strip()
    if text.startswith(("ws://", "wss://")):
        problem = address_problem(text, "an address to advertise")
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    host, sep, port = text.rpartition(":")
    if sep and port.isdigit() and 1 <= int(port) <= 65535 and (_HOSTNAME.fullmatch(host) or host.startswith("[")):
        url = f"ws://{host}:{port}"
        if not address_problem(url):
            return url
    if _HOSTNAME.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not an address friends can reach: an IP address or a name "
                                     "(e.g. 203.0.113.7 or home.example.org), HOST:PORT, or ws://host:port")
