"""Which attention a GPU stage's decode steps take, by rows and keys, from timing both
at load (issue 42).

SDPA's kernel spreads a decode step's attention over its rows and key/value heads only,
so with few rows its time grows with the context far faster than its bytes; two batched
products (engine/model/product_attention.py) spread over the keys but cost more
launches. Which is faster depends on the GPU, the model's heads and the context, so the
stage times both (engine/model/key_clock.py) and this decides. Pure: fed timings.
"""

from __future__ import annotations

# the products must take at most this share of SDPA's time to be taken: a timing's noise
# does not switch a kernel for nothing
MARGIN = 0.9


def products_from(timed: dict[tuple[int, int], tuple[float, float]], margin: float = MARGIN) -> dict[int, int]:
    """{rows: fewest keys from which a step of that many rows takes the products}, from
    `timed` {(rows, keys): (SDPA seconds, products seconds)}: the smallest key count timed
    from which the products took at most `margin` of SDPA's time there and at every
    longer count timed for those rows. Rows for which that holds nowhere are left out."""
    out = {}
    for rows in sorted({r for r, _ in timed}):
        keys = sorted(k for r, k in timed if r == rows)
        least = None
        for k in reversed(keys):
            sdpa, products = timed[(rows, k)]
            if products > margin * sdpa:
                break
            least = k
        if least is not None:
            out[rows] = least
    return out


def chosen_seconds(timed: dict[tuple[int, int], tuple[float, float]], table: dict[int, int], rows: int,
                   keys: int) -> float:
    """What a step of `rows` rows over `keys` keys takes with the choice made."""
    sdpa, products = timed[(rows, keys)]
    least = table.get(rows)
    return products if least is not None and keys >= least else sdpa
