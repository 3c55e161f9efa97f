"""Which model can we run together, and who else do we need? One model's answer for a
group: this computer's memory and what the friends in the ring give, against what the
model's weights need at each precision, said the way a person asks it.

    fit = group_fit({"bf16": 16e9, "int8": 8.7e9, "nf4": 5e9}, here=12e9, friends=[("Ana", 8e9)])
    fit["words"]   # 'fits with your friends as int8: needs 15 GB, this computer gives 12 GB, Ana 8 GB'

Memory is a computer's free memory (GPU memory, or RAM on a CPU): a stage fills
precision.USABLE of it with weights and keeps the rest for the conversations' cache, so
a model "needs" its weights / USABLE.
"""

from __future__ import annotations

import math

from engine.core.precision import FULL, QUANTIZED, USABLE
from engine.core.sizes import size_words


def group_fit(sizes: dict[str, int], here: int, friends: list[tuple[str, int]] = (), waiting: int = 0,
              quantized_ok: bool = True) -> dict:
    """sizes: the weights' bytes per precision; here: this computer's free memory;
    friends: (name, free memory) of those in the ring; waiting: friends invited who have
    not joined yet. Returns weights (the highest precision that fits, None if none),
    fits_here, fits, need/have/missing bytes and `words`."""
    order = [w for w in (FULL,) + QUANTIZED if w in sizes and (quantized_ok or w == FULL)]
    have = here + sum(m for _, m in friends)
    need = {w: int(sizes[w] / USABLE) for w in order}
    # the highest precision the group holds (friends make a better one fit, not only a bigger model)
    w = next((w for w in order if need[w] <= have), None)
    here_fits = w is not None and need[w] <= here
    label = {FULL: "full precision", "int8": "int8", "nf4": "nf4"}
    later = f" ({waiting} friend{'s' if waiting != 1 else ''} still to join)" if waiting else ""
    if here_fits:
        words = f"fits on this computer{'' if w == FULL else ' as ' + label[w]}: needs {size_words(need[w], up=True)}"
    elif w is not None:
        givers = ", ".join([f"this computer gives {size_words(here)}"] + [f"{n} {size_words(m)}" for n, m in friends])
        words = (f"fits with your friends{'' if w == FULL else ' as ' + label[w]}: needs {size_words(need[w], up=True)}, "
                 f"{givers}")
    else:
        w = None
        smallest = order[-1]
        missing = need[smallest] - have
        more = math.ceil(missing / 1e9)
        words = (f"needs {size_words(need[smallest], up=True)}{'' if smallest == FULL else ' even as ' + label[smallest]} — "
                 f"your group has {size_words(have)}: invite one more friend with a {more} GB GPU" if more <= 80 else
                 f"needs {size_words(need[smallest], up=True)} — your group has {size_words(have)}: invite friends with {more} GB "
                 f"more GPU memory between them")
    out = {"weights": w, "fits_here": here_fits, "fits": w is not None, "have_bytes": have,
           "here_bytes": here, "friends": [{"name": n, "bytes": m} for n, m in friends], "waiting": waiting,
           "need_bytes": need.get(w or (order[-1] if order else FULL)),
           "missing_bytes": 0 if w is not None else need[order[-1]] - have, "words": words + later}
    return out
