"""Per-sequence KV cache for the layers one stage holds.

Storage is one rectangle per layer, [slots, kv_heads, capacity, head_dim], that grows
by doubling. Each live sequence owns a slot. A batch step gathers the rows it needs
(a free view when its slots are contiguous, which the allocator favours) so sequences
of different lengths decode together; the attention mask hides everything past each
row's own length.

`BatchCache` is the object transformers' attention layers see as `past_key_values`:
they call `update(k, v, layer_idx)` and attend over what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the step's few host numbers reach a GPU queued behind its work, not after a wait for it
from engine.model.device import to_device


class KVCapacityError(RuntimeError):
    """A sequence needs more KV memory than this stage's budget allows."""


@dataclass
class SeqKV:
    slot: int
    length: int = 0   # tokens stored
    # of those, the last ones a verification step stored (a speculative draft, issue 34):
    # the sequence's next step may start before them, rolling them back (reserve)
    tentative: int = 0


class KVStore:
    def __init__(self, budget_tokens: int, dtype: torch.dtype, device: torch.device | str | None = None):
        self.budget_tokens = int(budget_tokens)
        self.dtype = dtype
        self.device = torch.device(device or "cpu")   # the stage's device (StageModel passes it)
        self.seqs: dict[int, SeqKV] = {}
        self._free_slots: list[int] = []
        self._n_slots = 0
        self._capacity = 0
        # layer_idx -> (keys, values); allocated at the first update of that layer
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        # counts reallocations: a captured CUDA graph holds the storage's addresses, so one
        # captured under another generation must not replay (engine/model/cuda_graphs.py)
        self.generation = 0
        # keep the storage when the last sequence ends: a stage replaying graphs would
        # otherwise capture them all again for the next reply
        self.keep_storage = False
        self._scratch: int | None = None

    # ---- bookkeeping --------------------------------------------------------
    @property
    def used_tokens(self) -> int:
        return sum(s.length for s in self.seqs.values())

    def has(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def length(self, seq_id: int) -> int:
        s = self.seqs.get(seq_id)
        return 0 if s is None else s.length

    def open(self, seq_id: int) -> SeqKV:
        if seq_id in self.seqs:
            return self.seqs[seq_id]
        if self._free_slots:
            self._free_slots.sort()
            slot = self._free_slots.pop(0)  # lowest first keeps live slots contiguous
        else:
            slot = self._n_slots
            self._n_slots += 1
        s = self.seqs[seq_id] = SeqKV(slot)
        return s

    def scratch_slot(self) -> int:
        """A slot no sequence is given: where the padding rows of a fixed-size step
        (engine/model/static_decode.py) write what nobody reads."""
        if self._scratch is None:
            self._scratch = self._n_slots
            self._n_slots += 1
        return self._scratch

    def free(self, seq_id: int) -> bool:
        s = self.seqs.pop(seq_id, None)
        if s is None:
            return False
        self._free_slots.append(s.slot)
        if not self.seqs and not self.keep_storage:  # nothing live: give the memory back
            self.generation += 1
            self._k.clear()
            self._v.clear()
            self._free_slots.clear()
            self._n_slots = 0
            self._scratch = None
            self._capacity = 0
        return True

    def fork(self, parent: int, child: int) -> None:
        """A new sequence `child` starting with a copy of `parent`'s cached tokens (a
        request's other choices, n > 1, after its prompt's step). A copy, not a shared
        prefix: each slot is a row of the layer rectangles, and the choices write their
        own tokens after the prompt at once."""
        p = self.seqs.get(parent)
        if p is None:
            raise ValueError(f"sequence {parent} to fork from is not cached here")
        if child in self.seqs:
            raise ValueError(f"sequence {child} already exists")
        if self.used_tokens + p.length > self.budget_tokens:
            raise KVCapacityError(f"KV budget exceeded: forking {p.length} tokens, "
                                  f"{self.used_tokens} in use, budget {self.budget_tokens}")
        c = self.open(child)
        # storage made in the stages' inference mode is written to in it too
        with torch.inference_mode(any(k.is_inference() for k in self._k.values())):
            for layer_idx in list(self._k):
                k, v = self._k[layer_idx], self._v[layer_idx]
                self._ensure(layer_idx, (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), c.slot + 1, p.length)
                K, V = self._k[layer_idx], self._v[layer_idx]
                K[c.slot, :, :p.length] = K[p.slot, :, :p.length]
                V[c.slot, :, :p.length] = V[p.slot, :, :p.length]
        c.length = p.length

    def truncate(self, seq_id: int, length: int) -> None:
        """Drop a sequence's cached tokens from `length` on (the rejected tail of a
        speculative draft). The storage keeps the old values; the mask never lets a step
        see past a row's own length, and the next step overwrites them by position."""
        s = self.seqs.get(seq_id)
        if s is None or not (0 <= length <= s.length):
            raise ValueError(f"sequence {seq_id}: cannot truncate {self.length(seq_id)} cached tokens to {length}")
        s.tentative = max(0, s.tentative - (s.length - length))
        s.length = length

    def reserve(self, rows: list[tuple[int, int, int]]) -> None:
        """Check a step's rows (seq_id, start, n) against lengths and the budget. A row
        may start inside its sequence's tentative tail (what the last verification step
        stored of a draft): the rejected tokens from `start` on are rolled back first."""
        extra = 0
        for seq_id, start, n in rows:
            have = self.length(seq_id)
            if start != have:
                s = self.seqs.get(seq_id)
                if s is None or not (have - s.tentative <= start < have):
                    raise ValueError(f"sequence {seq_id}: step starts at {start} but {have} tokens are cached")
            extra += n - (have - start)
        if self.used_tokens + extra > self.budget_tokens:
            raise KVCapacityError(
                f"KV budget exceeded: {self.used_tokens + extra} tokens needed, budget {self.budget_tokens}"
            )
        for seq_id, start, _ in rows:
            if start < self.length(seq_id):
                self.truncate(seq_id, start)

    # ---- storage ------------------------------------------------------------
    def _ensure(self, layer_idx: int, kshape, vshape, need_slots: int, need_cap: int) -> None:
        k = self._k.get(layer_idx)
        if k is not None and k.shape[0] >= need_slots and k.shape[2] >= need_cap:
            return
        slots = max(need_slots, self._n_slots, 1 if k is None else k.shape[0])
        cap = max(need_cap, self._capacity, 16)
        # doubling keeps the copies few, but not past the budget: the storage is a
        # rectangle, slots x capacity tokens whatever the sequences hold, and doubling a
        # 3k-token rectangle on a GPU sized for 4k would ask for memory that is not there
        room = max(self.budget_tokens, 1)
        if k is not None:
            if k.shape[2] < need_cap:
                cap = max(cap, min(2 * k.shape[2], room // slots))
            if k.shape[0] < need_slots:
                slots = max(slots, min(2 * k.shape[0], room // cap))
        self._capacity = max(self._capacity, cap)
        self.generation += 1
        newk = torch.zeros((slots, kshape[0], cap, kshape[1]), dtype=self.dtype, device=self.device)
        newv = torch.zeros((slots, vshape[0], cap, vshape[1]), dtype=self.dtype, device=self.device)
        if k is not None:
            v = self._v[layer_idx]
            newk[: k.shape[0], :, : k.shape[2]] = k
            newv[: v.shape[0], :, : v.shape[2]] = v
        self._k[layer_idx], self._v[layer_idx] = newk, newv

    def covers(self, slots: int, capacity: int) -> bool:
        """Whether every layer's storage holds `slots` slots of `capacity` tokens."""
        return all(k.shape[0] >= slots and k.shape[2] >= capacity for k in self._k.values())

    def grow(self, slots: int, capacity: int) -> None:
        """Every layer's storage to at least `slots` x `capacity` (what a step replayed as
        a graph needs made before it: engine/model/static_decode.py)."""
        for layer_idx, k in list(self._k.items()):
            v = self._v[layer_idx]
            self._ensure(layer_idx, (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), slots, capacity)

    def allocated_bytes(self) -> int:
        """Bytes the cache holds now (it grows as replies need it, up to the budget)."""
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))

    def bytes_per_token(self) -> int:
        total = 0
        for layer_idx, k in self._k.items():
            v = self._v[layer_idx]
            total += (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.element_size()
        return total


class BatchCache:
    """The cache transformers sees for one forward over a batch of rows.

    Rows are left-padded to `q_len` columns: row r's n_r new tokens sit in the last
    n_r columns and start at absolute position start_r.
    """

    is_compileable = False

    def __init__(self, store: KVStore, slots: list[int], starts: list[int], ns: list[int], q_len: int):
        self.store = store
        self.slots = slots
        self.starts = starts
        self.ns = ns
        self.q_len = q_len
        dev = store.device
        self._slot_idx = to_device(slots, torch.long, dev)
        self._contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self.kv_len = max(s + n for s, n in zip(starts, ns))
        self._decode = q_len == 1
        # a decode step whose rows sit in adjacent slots at one position (one request,
        # or a burst that started together) writes with a plain slice: advanced-index
        # writes cost ~10 us each, twice per layer per step
        self._slice_pos = starts[0] if self._decode and self._contiguous and len(set(starts)) == 1 else None
        if self._decode and self._slice_pos is None:
            self._pos_idx = to_device(starts, torch.long, dev)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        store = self.store
        store._ensure(
            layer_idx,
            (key_states.shape[1], key_states.shape[3]),
            (value_states.shape[1], value_states.shape[3]),
            max(self.slots) + 1,
            self.kv_len,
        )
        K, V = store._k[layer_idx], store._v[layer_idx]
        key_states = key_states.to(store.dtype)
        value_states = value_states.to(store.dtype)
        if self._slice_pos is not None:
            lo, p = self.slots[0], self._slice_pos
            K[lo : lo + len(self.slots), :, p] = key_states[:, :, 0]
            V[lo : lo + len(self.slots), :, p] = value_states[:, :, 0]
        elif self._decode:
            K[self._slot_idx, :, self._pos_idx] = key_states[:, :, 0]
            V[self._slot_idx, :, self._pos_idx] = value_states[:, :, 0]
        else:
            T = self.q_len
            for r, (slot, start, n) in enumerate(zip(self.slots, self.starts, self.ns)):
                K[slot, :, start : start + n] = key_states[r, :, T - n :]
                V[slot, :, start : start + n] = value_states[r, :, T - n :]
        L = self.kv_len
        if self._contiguous:
            lo = self.slots[0]
            return K[lo : lo + len(self.slots), :, :L], V[lo : lo + len(self.slots), :, :L]
        return K[:, :, :L].index_select(0, self._slot_idx), V[:, :, :L].index_select(0, self._slot_idx)

    # transformers calls these only on paths we bypass (we always pass positions and
    # a prepared mask); answer sensibly anyway.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.starts)

    def get_mask_sizes(self, *args, **kwargs):
        return self.kv_len, 0

    @property
    def is_sliding(self):
        return []

    def __len__(self):
        return 0


def build_masks(starts, ns, q_len, kv_len, dtype, device, windows: dict[str, int | None],
                chunks: dict[str, int] | None = None):
    """Additive 4D masks [B, 1, q_len, kv_len], one per attention type.

    Row r's query column c holds absolute position p = start_r + c - (q_len - n_r);
    it may see keys j <= p (and j > p - window for sliding layers; and only keys of
    its own chunk, j // size == p // size, for the types `chunks` names: Llama 4's
    chunked attention). Padding columns see key 0 only, so softmax never meets an
    all-masked row.
    """
    chunks = chunks or {}
    B = len(starts)
    starts_t = to_device(starts, torch.long, device).view(B, 1, 1)
    ns_t = to_device(ns, torch.long, device).view(B, 1, 1)
    col = torch.arange(q_len, device=device).view(1, q_len, 1)
    key = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    pad = col < (q_len - ns_t)
    pos = starts_t + col - (q_len - ns_t)
    neg = torch.finfo(dtype).min
    masks = {}
    for name, window in windows.items():
        allowed = key <= pos
        if window:
            allowed = allowed & (key > pos - window)
        size = chunks.get(name)
        if size:
            allowed = allowed & (key // size == pos.clamp_min(0) // size)
        allowed = torch.where(pad, key == 0, allowed)
        m = torch.zeros((B, 1, q_len, kv_len), dtype=dtype, device=device)
        m.masked_fill_(~allowed.unsqueeze(1), neg)
        masks[name] = m
    return masks


def position_ids(starts, ns, q_len, device):
    B = len(starts)
    starts_t = to_device(starts, torch.long, device).view(B, 1)
    ns_t = to_device(ns, torch.long, device).view(B, 1)
    col = torch.arange(q_len, device=device).view(1, q_len)
    pos = starts_t + col - (q_len - ns_t)
    return pos.clamp_min(0)
