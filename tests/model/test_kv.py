"""The per-sequence KV store, the batch cache transformers sees, and the masks/positions."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.model.kv import BatchCache, KVCapacityError, KVStore, build_masks, position_ids  # noqa: E402

H, D = 2, 4  # kv heads, head dim


# ---- masks and positions --------------------------------------------------------

MASK_CASES = [
    # starts, ns, q_len
    ([0], [5], 5),
    ([0, 3, 10], [4, 1, 2], 4),
    ([7, 0], [1, 1], 1),
    ([2, 0, 5], [3, 6, 1], 6),
]


@pytest.mark.parametrize("starts, ns, q_len", MASK_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_allow_exactly_the_causal_window(starts, ns, q_len, dtype):
    kv_len = max(s + n for s, n in zip(starts, ns))
    windows = {"full_attention": None, "sliding_attention": 3, "zero_window": 0}
    masks = build_masks(starts, ns, q_len, kv_len, dtype, "cpu", windows)
    assert set(masks) == set(windows)
    neg = torch.finfo(dtype).min
    for name, window in windows.items():
        m = masks[name]
        assert m.shape == (len(starts), 1, q_len, kv_len) and m.dtype == dtype
        assert set(m.unique().tolist()) <= {0.0, neg}
        for b, (s, n) in enumerate(zip(starts, ns)):
            for c in range(q_len):
                pad = c < q_len - n
                p = s + c - (q_len - n)
                for j in range(kv_len):
                    if pad:
                        want = j == 0
                    else:
                        want = j <= p and (not window or j > p - window)
                    assert (m[b, 0, c, j] == 0).item() == want, (name, b, c, j)
                assert (m[b, 0, c] == 0).any(), "no row may be fully masked"


def test_sliding_window_example():
    # one row, positions 0..5, window 2: position 5 sees keys 4 and 5 only
    m = build_masks([0], [6], 6, 6, torch.float32, "cpu", {"s": 2})["s"]
    allowed = (m[0, 0] == 0).int()
    assert allowed[5].tolist() == [0, 0, 0, 0, 1, 1]
    assert allowed[0].tolist() == [1, 0, 0, 0, 0, 0]


def test_position_ids():
    # real columns (the last n of each row) count on from start; padding is never negative
    pos = position_ids([0, 3, 10, 0], [4, 1, 2, 1], 4, "cpu")
    assert pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [8, 9, 10, 11], [0, 0, 0, 0]]
    assert position_ids([7, 0], [1, 1], 1, "cpu").tolist() == [[7], [0]]


# ---- a tiny driver that does what StageModel._forward does with the cache ------------

class Driver:
    """Runs steps against a KVStore and keeps a plain reference copy of every sequence's KV."""

    def __init__(self, store: KVStore, n_layers: int = 2):
        self.store = store
        self.n_layers = n_layers
        self.ref: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # seq -> per layer (k, v) [H, L, D]
        self.counter = 0

    def _fresh(self, n):
        t = torch.arange(self.counter, self.counter + H * n * D, dtype=torch.float32).view(H, n, D)
        self.counter += H * n * D
        return t

    def step(self, seq_ids, ns):
        store = self.store
        starts = [store.length(s) for s in seq_ids]
        store.reserve(list(zip(seq_ids, starts, ns)))
        for s in seq_ids:
            store.open(s)
        T = max(ns)
        slots = [store.seqs[s].slot for s in seq_ids]
        cache = BatchCache(store, slots, starts, ns, T)
        outs = []
        for layer in range(self.n_layers):
            k = torch.full((len(seq_ids), H, T, D), float("nan"))  # padding columns: must never be stored
            v = torch.full((len(seq_ids), H, T, D), float("nan"))
            for r, (s, n) in enumerate(zip(seq_ids, ns)):
                nk, nv = self._fresh(n), -self._fresh(n)
                k[r, :, T - n:] = nk
                v[r, :, T - n:] = nv
                per = self.ref.setdefault(s, [(torch.zeros(H, 0, D), torch.zeros(H, 0, D))] * self.n_layers)
                ok, ov = per[layer]
                per[layer] = (torch.cat([ok, nk], 1), torch.cat([ov, nv], 1))
            outs.append(cache.update(k, v, layer))
        for s, n in zip(seq_ids, ns):
            store.seqs[s].length += n
        # what attention sees holds each row's full history in its first start+n columns
        for layer, (K, V) in enumerate(outs):
            assert K.shape == (len(seq_ids), H, cache.kv_len, D)
            for r, s in enumerate(seq_ids):
                L = store.length(s)
                want_k, want_v = self.ref[s][layer]
                assert torch.equal(K[r, :, :L], want_k), (s, layer)
                assert torch.equal(V[r, :, :L], want_v), (s, layer)
        return cache, outs

    def check_store(self):
        """Every live sequence's KV, read straight from storage, equals the reference."""
        for s, seq in self.store.seqs.items():
            for layer in range(self.n_layers):
                want_k, want_v = self.ref[s][layer]
                L = seq.length
                assert torch.equal(self.store._k[layer][seq.slot, :, :L], want_k)
                assert torch.equal(self.store._v[layer][seq.slot, :, :L], want_v)


def test_store_grows_slots_and_capacity_preserving_contents():
    store = KVStore(10_000, torch.float32)
    d = Driver(store)
    d.step([0], [5])
    assert store._k[0].shape == (1, H, 16, D)
    d.step([1, 2], [3, 7])                       # more slots
    assert store._k[0].shape[0] >= 3 and store._k[0].shape[2] == 16
    d.check_store()
    d.step([0, 1, 2], [1, 1, 1])                 # decode path
    d.step([0], [20])                            # 26 tokens: capacity doubles past 16
    assert store._k[0].shape[2] >= 26 and store._k[1].shape[2] >= 26
    d.check_store()
    d.step([3, 4, 5, 6, 0], [2, 1, 4, 1, 1])     # more slots again, mixed lengths
    d.check_store()
    for _ in range(40):                          # long decode: several capacity doublings
        d.step([0, 2, 5], [1, 1, 1])
    assert store._k[0].shape[2] >= store.length(0) == 67
    d.check_store()
    assert store.used_tokens == sum(store.length(s) for s in range(7))


def test_growth_doubles_instead_of_creeping():
    store = KVStore(10_000, torch.float32)
    d = Driver(store, n_layers=1)
    d.step([0], [16])
    caps = []
    for _ in range(50):
        d.step([0], [1])
        caps.append(store._k[0].shape[2])
    assert sorted(set(caps)) == [32, 64, 128]  # a handful of reallocations, not one per token


def test_growth_stops_doubling_at_the_budget():
    """The store is a rectangle of slots x capacity: doubling it past the budget would
    ask a GPU for memory its plan never gave the cache. It still grows to what a step
    needs."""
    store = KVStore(1000, torch.float32)
    d = Driver(store, n_layers=1)
    d.step([0], [300])
    d.step([0], [1])
    assert store._k[0].shape[2] == 600      # 301 needed: doubled, 600 fits the budget
    d.step([0], [300])
    assert store._k[0].shape[2] == 1000     # 601 needed: the budget's 1000, not 1200
    d.check_store()
    wide = KVStore(64, torch.float32)
    d = Driver(wide, n_layers=1)
    d.step([0, 1, 2], [16, 16, 16])
    d.step([3], [1])                        # a 4th slot: 4 x 16 fits the budget, 6 x 16 would not
    assert wide._k[0].shape[:3:2] == (4, 16)
    d.check_store()


def test_decode_writes_only_its_position():
    store = KVStore(1000, torch.float32)
    d = Driver(store, n_layers=1)
    d.step([0, 1], [4, 2])
    before = store._k[0].clone()
    d.step([1], [1])
    after = store._k[0]
    changed = (before != after).any(-1).any(1)  # [slots, positions] that changed
    slot1 = store.seqs[1].slot
    assert changed.nonzero().tolist() == [[slot1, 2]]


def test_free_releases_and_reuses_slots():
    store = KVStore(1000, torch.float32)
    d = Driver(store, n_layers=1)
    d.step([10, 11, 12, 14], [2, 2, 2, 2])
    assert [store.seqs[s].slot for s in (10, 11, 12, 14)] == [0, 1, 2, 3]
    assert store.free(12) and store.free(11) and not store.has(11)
    assert not store.free(11) and not store.free(99)
    assert store._k, "storage stays while sequences are live"
    d.check_store()
    store.open(13)
    assert store.seqs[13].slot == 1  # the lowest free slot is reused, keeping live slots contiguous
    assert store.length(13) == 0
    assert store.open(13).slot == 1  # opening twice is idempotent
    assert store.open(15).slot == 2
    assert store.open(16).slot == 4  # no free slot left: a new one
    for s in (13, 15, 16, 10):
        store.free(s)
    assert store._k
    store.free(14)
    assert store._k == {} and store._v == {}
    assert store._n_slots == 0 and store._capacity == 0 and store.seqs == {}
    assert store.open(20).slot == 0  # a fresh start


def test_reserve_checks_start_and_budget():
    store = KVStore(10, torch.float32)
    store.reserve([(0, 0, 10)])  # exactly the budget is fine
    d = Driver(store, n_layers=1)
    d.step([0], [6])
    with pytest.raises(ValueError, match="step starts at 0 but 6 tokens are cached") as ei:
        store.reserve([(0, 0, 1)])
    assert not isinstance(ei.value, KVCapacityError)
    with pytest.raises(ValueError, match="sequence 1: step starts at 3 but 0"):
        store.reserve([(1, 3, 1)])
    store.reserve([(0, 6, 2), (1, 0, 2)])
    with pytest.raises(KVCapacityError, match="11 tokens needed, budget 10"):
        store.reserve([(0, 6, 2), (1, 0, 3)])
    with pytest.raises(KVCapacityError):
        store.reserve([(1, 0, 5)])
    assert store.used_tokens == 6 and not store.has(1)  # a refused reserve changes nothing


def test_a_step_may_start_inside_the_tentative_tail_and_rolls_it_back():
    """Speculative decoding (issue 34): a verification step's drafted tokens stay
    tentative; the sequence's next step starts where the accepted ones end, and the
    rejected ones are dropped then -- never earlier than the tail, never on a refusal."""
    store = KVStore(12, torch.float32)
    d = Driver(store, n_layers=1)
    d.step([0], [6])
    s = store.seqs[0]
    store.reserve([(0, 6, 5)])
    s.length, s.tentative = 11, 4       # what StageModel records after a 5-token verification row
    with pytest.raises(ValueError, match="step starts at 6 but 11"):
        store.reserve([(0, 6, 1)])      # before the tail: the last token itself was no guess
    with pytest.raises(KVCapacityError):
        store.reserve([(0, 8, 5)])      # rolling back 3 frees 3: 8 + 5 > 12
    assert store.length(0) == 11 and s.tentative == 4   # a refused reserve changes nothing
    store.reserve([(0, 9, 1)])          # two of four drafted tokens stood
    assert store.length(0) == 9 and s.tentative == 2 and store.used_tokens == 9
    store.truncate(0, 9)
    with pytest.raises(ValueError):
        store.truncate(0, 10)
    store.free(0)


def test_contiguous_slots_return_views():
    store = KVStore(1000, torch.float32)
    d = Driver(store, n_layers=1)
    d.step([0, 1, 2], [3, 3, 3])
    cache, [(K, V)] = d.step([1, 2], [1, 1])  # slots 1, 2: contiguous
    assert cache._contiguous
    sk, sv = store._k[0], store._v[0]
    assert K.untyped_storage().data_ptr() == sk.untyped_storage().data_ptr()
    assert V.untyped_storage().data_ptr() == sv.untyped_storage().data_ptr()
    assert K.data_ptr() == sk[1].data_ptr()
    K[0, 0, 0, 0] = 12345.0  # a view: the write shows up in the store
    assert sk[1, 0, 0, 0] == 12345.0


def test_non_contiguous_slots_gather_the_right_rows():
    store = KVStore(1000, torch.float32)
    d = Driver(store, n_layers=2)
    d.step([0, 1, 2, 3], [3, 5, 2, 4])
    cache, outs = d.step([3, 0, 2], [2, 1, 3])  # slots 3, 0, 2: the driver checks each row's contents
    assert not cache._contiguous
    K, V = outs[1]
    assert K.untyped_storage().data_ptr() != store._k[1].untyped_storage().data_ptr()
    L = cache.kv_len
    assert torch.equal(K, store._k[1][[3, 0, 2], :, :L])
    assert torch.equal(V, store._v[1][[3, 0, 2], :, :L])


def test_bytes_per_token_and_dtype():
    store = KVStore(1000, torch.bfloat16)
    assert store.bytes_per_token() == 0
    d = Driver(store, n_layers=3)
    d.step([0], [2])
    assert store._k[0].dtype == torch.bfloat16
    assert store.bytes_per_token() == 3 * 2 * H * D * 2


def test_batched_attention_matches_each_sequence_alone():
    """Masks + cache together: a mixed batch attends exactly as each sequence would alone."""
    g = torch.Generator().manual_seed(0)
    store = KVStore(1000, torch.float32)
    hist: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(seq_ids, ns):
        starts = [store.length(s) for s in seq_ids]
        for s in seq_ids:
            store.open(s)
        T = max(ns)
        cache = BatchCache(store, [store.seqs[s].slot for s in seq_ids], starts, ns, T)
        q = torch.randn(len(seq_ids), H, T, D, generator=g)
        k = torch.randn(len(seq_ids), H, T, D, generator=g)
        v = torch.randn(len(seq_ids), H, T, D, generator=g)
        K, V = cache.update(k, v, 0)
        mask = build_masks(starts, ns, T, cache.kv_len, torch.float32, "cpu", {"f": None})["f"]
        out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
        for r, (s, n) in enumerate(zip(seq_ids, ns)):
            hk, hv = hist.get(s, (torch.zeros(H, 0, D), torch.zeros(H, 0, D)))
            hk, hv = torch.cat([hk, k[r, :, T - n:]], 1), torch.cat([hv, v[r, :, T - n:]], 1)
            hist[s] = (hk, hv)
            # alone: n queries over its own history, causal from its start
            ql = q[r:r + 1, :, T - n:]
            m = torch.ones(n, hk.shape[1], dtype=torch.bool).tril(diagonal=hk.shape[1] - n)
            alone = F.scaled_dot_product_attention(ql, hk[None], hv[None], attn_mask=m)
            torch.testing.assert_close(out[r:r + 1, :, T - n:], alone, rtol=1e-5, atol=1e-5)
            store.seqs[s].length += n

    step([0, 1], [5, 2])
    step([1, 0, 2], [3, 1, 4])
    step([2, 1], [1, 1])
    store.free(0)
    step([3, 2], [2, 6])  # slot of a freed sequence reused: stale keys must stay hidden


def test_chunked_attention_sees_only_its_own_chunk():
    # Llama 4's chunked layers: chunks of 4; position 5 sees keys 4 and 5, position 3 sees 0..3.
    # Row 1 is left-padded (2 new tokens at positions 6, 7).
    masks = build_masks([0, 6], [8, 2], 8, 8, torch.float32, "cpu", {"full_attention": None, "chunked_attention": None},
                        {"chunked_attention": 4})
    assert (masks["full_attention"][0, 0, 5] == 0).int().tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    allowed = (masks["chunked_attention"][0, 0] == 0).int()
    assert allowed[5].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert allowed[3].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    row1 = (masks["chunked_attention"][1, 0] == 0).int()
    assert row1[7].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # position 7
    assert row1[0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]  # a padding column sees key 0 only


def test_fork_copies_the_parents_cache_and_then_diverges():
    """A request's other choices (n > 1) start as a copy of the prompt's KV."""
    store = KVStore(10_000, torch.float32)
    d = Driver(store)
    d.step([0, 1], [5, 3])
    store.fork(0, 7)                      # a new slot, past the grown storage
    d.ref[7] = list(d.ref[0])
    assert store.length(7) == 5 and store.seqs[7].slot not in (store.seqs[0].slot, store.seqs[1].slot)
    d.check_store()
    d.step([0, 7, 1], [1, 1, 1])          # each writes its own token after the prompt
    d.check_store()
    assert not torch.equal(store._k[0][store.seqs[7].slot, :, 5], store._k[0][store.seqs[0].slot, :, 5])
    store.free(0)
    d.check_store()                       # the fork outlives its parent
    with pytest.raises(ValueError):
        store.fork(0, 8)                  # no such parent
    with pytest.raises(ValueError):
        store.fork(7, 1)                  # the child exists


def test_fork_respects_the_budget():
    store = KVStore(12, torch.float32)
    d = Driver(store, n_layers=1)
    d.step([0], [5])
    store.fork(0, 1)
    with pytest.raises(KVCapacityError):
        store.fork(0, 2)                  # 10 in use, 5 more would exceed 12
    assert not store.has(2)
