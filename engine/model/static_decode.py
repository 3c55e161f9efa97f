"""A stage's decode step over fixed buffers: what a CUDA graph captures (issue 42).

The eager step (engine/model/stage.py `_forward`) builds its masks, positions and cache
view from Python lists each step and attends over exactly the keys it needs. A captured
graph cannot: it replays the same kernels, with the same sizes and scalars, over the same
memory. So this step reads everything that changes from device tensors it owns -- the
inputs, each row's slot and first position -- and derives the rest on the device:
positions, the masks (causal, sliding windows, chunks), the KV writes (by slot and
position, `index_put_`), the keys each row attends over (a slice of the store from the
bucket's first slot, or a gather). Its sizes come from the bucket (engine/core/
graph_plan.py), never from the step. The same code runs eagerly on any device; on a GPU
engine/model/cuda_graphs.py captures it once per bucket and replays it.

Token-identical to the eager step (tests/model/test_static_decode.py: every family,
batched, after a rolled-back draft): the extra keys of the bucket are masked to the
dtype's minimum, which softmax turns into exact zeros. And data-independent: two steps of
one bucket at other positions, slots and inputs run the same operators with the same
sizes and scalars (the same test, under a dispatch mode that records them).

What it does not run (`unsupported` says why, and the stage keeps its eager step):
Falcon-RW's ALiBi bias and Llama 4's attention temperature, both built from host-side
positions; the rotary scalings that pick frequencies by the batch's length; the few
families whose step reads values back to the host (HOST_BOUND); and int8 weights, whose
LLM.int8 product does the same.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from engine.core.graph_plan import GraphBook, GraphPlan, StepShape, ahead_keys, row_floors, timed_floors
from engine.core.kept_prefixes import MOST as KEPT_MOST
from engine.model.device import attention_kernels, kv_bytes_per_token
from engine.model.device import to_device

log = logging.getLogger("potluck.static_decode")

# the context a slot's storage is made for at once on a GPU (more grows it, and every
# captured graph is captured again once)
RESERVE_CAP = 2048


def decode_path(stage) -> None:
    """Give a stage its fixed-buffer decode step where it pays: on a CUDA device, replayed
    as graphs (unless POTLUCK_CUDA_GRAPHS=0), with its usual buckets captured now; on the
    CPU only when POTLUCK_STATIC_DECODE=1 (eagerly: the tests' way to run this path
    through whole pipelines; the CPU's own step is faster there)."""
    import os

    on_gpu = stage.device.type == "cuda"
    # on by default since the H200 ran them sound (bench/RESULTS.md, 2026-12-04: a 1-user
    # decode 6.5x transformers' generate); POTLUCK_CUDA_GRAPHS=0 keeps every step eager
    if on_gpu and os.environ.get("POTLUCK_CUDA_GRAPHS", "1") == "0":
        return
    if not on_gpu and os.environ.get("POTLUCK_STATIC_DECODE") != "1":
        return
    why = unsupported(stage)
    if why:
        log.info("decode steps run eagerly: %s", why)
        return
    if not on_gpu:
        stage.static = StaticDecoder(stage)
        return
    use_graphs(stage)


def use_graphs(stage, cuda=None) -> "StaticDecoder":
    """Give a stage decode steps replayed as CUDA graphs, its usual buckets captured now.
    `cuda`: torch.cuda, or the tests' stand-in (testkit/graph_tape.py) on the CPU."""
    from engine.model.cuda_graphs import GraphRunner

    book = GraphBook()
    static = StaticDecoder(stage, runner=GraphRunner(stage, book, cuda=cuda or torch.cuda), book=book)
    stage.kv.keep_storage = True
    rows = 16
    cap = static.plan.min_kv
    # at most half the budget at once: the rest is the store's to grow into as it would
    while cap * 2 * rows <= stage.kv.budget_tokens // 2 and cap * 2 <= RESERVE_CAP \
            and (static.plan.max_kv is None or cap * 2 <= static.plan.max_kv):
        cap *= 2
    static.reserve = (0, 0)
    if cap * rows <= stage.kv.budget_tokens // 2:
        # slots for the largest bucket's rows, for the replies kept for their follow-ups
        # beside them (each holds a slot on every stage), and for the padding rows' scratch
        # slot, where they fit: a store grown past its reserve captures every graph in use
        # again, in the middle of replies
        slots = rows + KEPT_MOST + 1
        static.reserve = (slots if cap * slots <= stage.kv.budget_tokens // 2 else rows, cap)
    if static.reserve[1]:
        static.plan = replace(static.plan, floors=_floors(stage, static.reserve[1], static.plan.min_kv))
    if stage.device.type == "cuda":
        floors, static.key_costs = _time_keys(stage, static.plan.floors, static.plan)
        static.plan = replace(static.plan, floors=floors,
                              ahead=ahead_keys(static.plan.floors, floors, static.plan.min_kv))
    stage.static = static
    t0 = time.perf_counter()
    # in the inference mode the stage's steps (and any later capture) run in: with autograd
    # on, bitsandbytes' 4-bit product takes its dequantize-then-multiply path, so the graphs
    # captured here would replay a kernel no served step uses, and the KV store and the
    # captured outputs would carry autograd history
    with torch.inference_mode():
        static.warm(sorted(static.plan.warm_shapes(rows), key=lambda s: -s.rows), stage._progress)
    log.info("captured %d decode graphs in %.1f s (%.0f MiB); fewest keys by rows %s", book.captures,
             time.perf_counter() - t0, book.capture_bytes / 2**20, dict(static.plan.floors) or static.plan.min_kv)
    return static


def _floors(stage, cap: int, min_kv: int) -> tuple[tuple[int, int], ...]:
    """Few rows' graphs attend over up to the store's whole reserve where their keys cost
    little beside the weights (graph_plan.row_floors): a chat then captures nothing in
    the middle of a reply until its context is that long."""
    try:
        per_token = kv_bytes_per_token(stage.source.config(), (stage.start, stage.end), stage.kv.dtype)
        return row_floors(step_read_bytes(stage), per_token, cap, min_kv=min_kv)
    except Exception as exc:  # noqa: BLE001 -- a rounding rule never stops a load
        # (a config whose layers differ in heads, Gemma 4's, has no one size a token)
        log.info("decode graphs attend over %d keys at fewest for every row count: %s", min_kv, exc)
        return ()


def _time_keys(stage, floors, plan: GraphPlan, clock=None) -> tuple[tuple[tuple[int, int], ...], dict]:
    """This device's decode attention timed both ways (engine/model/key_clock.py): the
    two products taken where faster (set on the model: product_attention.set_products),
    and the byte rule's floors lowered where the keys cost more time than their bytes
    say (graph_plan.timed_floors). Returns the floors and what was timed."""
    from engine.model.key_clock import KeyClock
    from engine.model.product_attention import set_products

    costs = {"by_bytes": dict(floors)}
    try:
        clock = clock or KeyClock(stage)
        # the products run inside our attention function: a model on transformers' own
        # (POTLUCK_PACKED_GQA=0, a family that asks for SDPA by name) keeps SDPA
        # (POTLUCK_PRODUCT_ATTENTION=0 keeps SDPA and still weighs the floors)
        table = {}
        if os.environ.get("POTLUCK_PRODUCT_ATTENTION", "1") == "0":
            clock.unused = "switched off (POTLUCK_PRODUCT_ATTENTION=0)"
        elif stage.packed_gqa:
            table = clock.choose(plan.row_buckets, plan.min_kv)
        set_products(stage.model, table)
        weights = step_read_bytes(stage) * clock.seconds_per_byte_read()
        out = timed_floors(floors, clock.attention, weights, stage.end - stage.start, min_kv=plan.min_kv)
    except Exception as exc:  # noqa: BLE001 -- a rounding rule never stops a load
        set_products(stage.model, None)
        log.info("decode attention untimed (SDPA; fewest keys weighed in bytes only): %s", exc)
        return floors, {**costs, "untimed": f"{type(exc).__name__}: {exc}"[:200]}
    finally:
        if stage.device.type == "cuda":
            from engine.model.cuda_graphs import release_cached_memory

            release_cached_memory()   # the timings' inputs: the graphs' pool cannot reuse them
    costs["products_from"] = dict(table) if clock.unused is None else clock.unused
    costs["weights_ms"] = round(weights * 1e3, 3)
    costs["attention_us"] = {f"{r}x{k}": [round(t * 1e6, 1) if t is not None else None for t in ts]
                             for (r, k), ts in sorted(clock.timed.items())}
    log.info("decode attention: two products from %s keys by rows (else SDPA); fewest keys by rows %s (by bytes "
             "%s); a layer's attention (rows x keys: SDPA, products) %s us; the weights %.2f ms",
             table or "no", dict(out) or plan.min_kv, costs["by_bytes"], costs["attention_us"], weights * 1e3)
    return out, costs


def step_read_bytes(stage) -> int:
    """The weight bytes a decode step reads: all of them but the token embedding table, of
    which a step reads only its tokens' rows -- unless this stage's LM head is that same
    table (tied), which it reads whole. (An 8B model's table is 1 GB of its 16.)"""
    total = stage.param_bytes()
    if stage.first and not (stage.last and stage._tied):
        emb = stage.model.get_input_embeddings()
        total -= sum(p.numel() * p.element_size() for p in emb.parameters())
    return total


# families whose step reads device values back to the host or makes host tensors as it
# runs, which a graph cannot replay (tests/model/test_static_decode.py finds them)
HOST_BOUND = {
    "jetmoe": "its experts' row counts are read back to the host each step",
    "dbrx": "its experts are picked with nonzero, sized by the data",
    "falcon": "it indexes with lists made on the host each step",
}


def decode_counts(stage) -> dict[str, int]:
    """For a stage's stats: decode steps run over fixed buffers, replayed graphs, and
    graphs captured (at load, and any since: a capture in service stalls a reply)."""
    static = getattr(stage, "static", None)
    if static is None:
        return {"fixed_steps": 0, "graph_replays": 0, "graph_captures": 0}
    return {"fixed_steps": static.steps, "graph_replays": static.book.replays, "graph_captures": static.book.captures}


def unsupported(stage) -> str | None:
    """Why a stage's decode step cannot run over fixed buffers, or None."""
    if stage._alibi is not None:
        return "ALiBi attention bias (Falcon-RW)"
    why = HOST_BOUND.get(getattr(stage.model.config, "model_type", None))
    if why:
        return why
    if stage._temperature_floor:
        return "attention temperature by position (Llama 4)"
    if stage.per_row_rotary:
        return "rotary frequencies that follow the context length"
    if any(type(m).__name__ == "Linear8bitLt" and getattr(getattr(m, "state", None), "threshold", 0) > 0
           for m in stage.model.modules()):
        # LLM.int8 splits out the input's outlier columns, found and counted on the host each step
        return "int8 weights (bitsandbytes picks each step's outlier columns by their values)"
    return None


class StaticCache:
    """The cache transformers sees for a fixed-buffer step: writes each row's new keys at
    its slot and positions, and hands attention the bucket's keys of each row."""

    is_compileable = False

    def __init__(self, store, shape: StepShape, slot: torch.Tensor, pos: torch.Tensor, need_slots: int,
                 seq_length: int, need_cap: int = 0):
        self.store, self.shape = store, shape
        self.need_cap = max(need_cap, shape.kv_len)
        self.slot, self.pos = slot, pos                      # [R], [R, T] on the device
        self.need_slots = need_slots                         # host: storage to have (eager only)
        self._seq_length = seq_length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        store, shape = self.store, self.shape
        store._ensure(layer_idx, (key_states.shape[1], key_states.shape[3]),
                      (value_states.shape[1], value_states.shape[3]), self.need_slots, self.need_cap)
        K, V = store._k[layer_idx], store._v[layer_idx]
        rows = self.slot[:, None]                            # [R, 1] with pos [R, T] -> [R, T, heads, dim]
        K[rows, :, self.pos] = key_states.to(store.dtype).transpose(1, 2)
        V[rows, :, self.pos] = value_states.to(store.dtype).transpose(1, 2)
        L = shape.kv_len
        if shape.lo is not None:
            lo = shape.lo
            return K[lo: lo + shape.rows, :, :L], V[lo: lo + shape.rows, :, :L]
        return K[:, :, :L].index_select(0, self.slot), V[:, :, :L].index_select(0, self.slot)

    # transformers asks these on paths the stage bypasses (it passes positions and masks);
    # the length is a host value only ever read there, never in a kernel (the static
    # path's trace test would see it)
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_length

    def get_mask_sizes(self, *args, **kwargs):
        return self.shape.kv_len, 0

    @property
    def is_sliding(self):
        return []

    def __len__(self):
        return 0


@dataclass
class Buffers:
    """One bucket's inputs on the device: what a replay reads."""

    x: torch.Tensor       # token ids [R*T] (first stage) or hidden states [R*T, hidden]
    slot: torch.Tensor    # [R] long
    start: torch.Tensor   # [R] long: each row's first new position

    @classmethod
    def make(cls, stage, shape: StepShape) -> "Buffers":
        n, dev = shape.rows * shape.tokens, stage.device
        x = (torch.zeros(n, dtype=torch.long, device=dev) if stage.first
             else torch.zeros(n, stage.hidden_size, dtype=stage.dtype, device=dev))
        return cls(x, torch.zeros(shape.rows, dtype=torch.long, device=dev),
                   torch.zeros(shape.rows, dtype=torch.long, device=dev))

    def fill(self, inputs: torch.Tensor, slots: list[int], starts: list[int], tokens: int,
             scratch: int | None = None) -> None:
        """The step's rows, then padding rows: the last row's inputs and position, written
        to the scratch slot (a real slot may be another sequence's, not in this step)."""
        B, R = len(slots), self.slot.shape[0]
        pad = R - B
        self.x[: B * tokens].copy_(inputs.reshape(self.x[: B * tokens].shape), non_blocking=True)
        host = torch.tensor([slots + [scratch] * pad, starts + [starts[-1]] * pad], dtype=torch.long)
        if self.slot.is_cuda:
            # from pageable memory a copy may wait for the queue to drain first, and with a
            # step launched ahead (engine/core/ahead.py) the queue holds a whole step
            host = host.pin_memory()
        if pad:
            last = self.x[(B - 1) * tokens: B * tokens]
            self.x[B * tokens:].view(pad, *last.shape).copy_(last.expand(pad, *last.shape))
        self.slot.copy_(host[0], non_blocking=True)
        self.start.copy_(host[1], non_blocking=True)


class StaticDecoder:
    """A stage's decode and verification steps in buckets over fixed buffers. With a
    `runner` (cuda_graphs.GraphRunner) each bucket's step is captured and replayed;
    without one it runs eagerly (the CPU, and every test here)."""

    def __init__(self, stage, plan: GraphPlan | None = None, runner=None, book: GraphBook | None = None,
                 check: bool = True):
        why = unsupported(stage) if check else None
        if why:
            raise ValueError(f"this stage's decode step cannot run over fixed buffers: {why}")
        self.stage = stage
        cfg = stage.model.config
        self.plan = plan or GraphPlan(max_kv=getattr(cfg, "max_position_embeddings", None) or None)
        self.book = book or GraphBook()
        self.runner = runner
        self.buffers: dict[StepShape, Buffers] = {}
        self.steps = 0        # steps this path ran (the rest ran eagerly)
        # storage the KV store takes at once, (slots, tokens a slot): with graphs, every
        # growth of the store is a recapture of every bucket used since
        self.reserve = (0, 0)
        # what a GPU stage timed of its attention at load (_time_keys): shown by bench/gpu.py
        self.key_costs: dict = {}

    def try_step(self, batch, inputs: torch.Tensor) -> torch.Tensor | None:
        """The step's output as the eager step returns it, or None: not a step for a
        bucket (the book says why) and the eager step takes it."""
        stage, kv = self.stage, self.stage.kv
        for seq_id in batch.seq_ids:
            kv.open(seq_id)
        slots = [kv.seqs[s].slot for s in batch.seq_ids]
        shape = self.plan.shape_for(batch.ns, batch.starts, slots, batch.keep)
        if isinstance(shape, str):
            self.book.ran_eagerly(shape)
            return None
        if self.runner is not None and not self.runner.will_replay(shape):
            self.book.ran_eagerly("capture failed before")
            return None
        bufs = self.buffers.get(shape)
        if bufs is None:
            bufs = self.buffers[shape] = Buffers.make(stage, shape)
        scratch = kv.scratch_slot() if shape.rows > len(slots) else None
        dtype = inputs.dtype if stage.first else stage.dtype
        x = (inputs.to(stage.device, dtype) if inputs.device.type == stage.device.type
             else to_device(inputs, dtype, stage.device))
        n = batch.ns[0]
        if shape.tokens > n:
            # a verification step padded to its bucket: each row's last input (a token or a
            # hidden state) again
            rows = x.reshape(len(slots), n, *x.shape[1:])
            x = torch.cat([rows, rows[:, -1:].expand(-1, shape.tokens - n, *x.shape[1:])], 1).flatten(0, 1)
        bufs.fill(x, slots, batch.starts, shape.tokens, scratch)
        need_slots = max(slots + [scratch or 0]) + 1
        if shape.lo is not None:
            need_slots = max(need_slots, shape.lo + shape.rows)
        need_slots = max(need_slots, self.reserve[0])
        need_cap = max(self.reserve[1], shape.kv_len)
        if self.runner is not None and not kv.covers(need_slots, need_cap):
            # a replay runs no Python, so nothing in it can grow the store: a slot or
            # position past what it held at capture is an index out of bounds on the
            # device (the first H200 run: the padding rows' scratch slot). Grown here,
            # the store moves, and the runner captures this bucket again over it.
            kv.grow(need_slots, need_cap)
        seq_length = max(batch.starts)

        def run() -> torch.Tensor:
            return self._run(shape, bufs, need_slots, seq_length)

        with attention_kernels(stage.device):
            out = run() if self.runner is None else self.runner.run(shape, run)
        B, T = len(batch.ns), shape.tokens
        kept = T if stage.last and batch.keep is not None else (1 if stage.last else T)
        if kept > n:      # the padding positions' outputs go
            out = out[: B * kept].reshape(B, kept, -1)[:, :n].flatten(0, 1)
        else:
            out = out[: B * kept]
        out = out.clone()                   # a replay overwrites its output buffer next step
        for seq_id, k in zip(batch.seq_ids, batch.kept):
            s = kv.seqs[seq_id]
            s.length += n                   # what a padding position wrote lies past it
            s.tentative = k - 1
        self.steps += 1
        return out

    def warm(self, shapes: list[StepShape], progress=None) -> None:
        """Capture these buckets before the first request (a chat's first reply then
        replays at once). Runs each through the runner on scratch sequences that hold no
        one's tokens; their slots and lengths are freed again."""
        if self.runner is None:
            return
        kv = self.stage.kv
        for i, shape in enumerate(shapes):
            if progress is not None:
                progress(i, len(shapes), "getting the GPU ready")
            # ids below zero, which no request has (an id counted from the scratch slot
            # below could be a live sequence's, and would be freed with the scratch ones)
            ids = list(range(-1, -1 - shape.rows, -1))
            try:
                for s in ids:
                    kv.open(s)
                slots = [kv.seqs[s].slot for s in ids]
                if shape.lo is not None and slots != list(range(shape.lo, shape.lo + shape.rows)):
                    continue
                # the padding rows' slot, past the largest bucket's (warmed first): made now,
                # the store these graphs are captured over holds it
                scratch = kv.scratch_slot()
                bufs = self.buffers.get(shape) or self.buffers.setdefault(shape, Buffers.make(self.stage, shape))
                zeros = bufs.x.new_zeros(bufs.x.shape)
                bufs.fill(zeros, slots, [0] * shape.rows, shape.tokens)
                need = max(max(slots) + 1, scratch + 1, self.reserve[0])

                def run(shape=shape, bufs=bufs, need=need) -> torch.Tensor:
                    return self._run(shape, bufs, need, 0)

                with attention_kernels(self.stage.device):
                    self.runner.run(shape, run)
            finally:
                for s in ids:
                    kv.free(s)
        if progress is not None:
            progress(len(shapes), len(shapes), "getting the GPU ready")

    # ---- the step itself: sizes from the bucket, values from the buffers ---------------
    def _run(self, shape: StepShape, bufs: Buffers, need_slots: int, seq_length: int) -> torch.Tensor:
        stage = self.stage
        R, T, L, dev = shape.rows, shape.tokens, shape.kv_len, stage.device
        pos = bufs.start[:, None] + torch.arange(T, device=dev)          # [R, T]
        masks = _masks(pos, L, stage.dtype, stage._mask_windows, stage._mask_chunks)
        mask = masks if stage._mask_dict else masks["full_attention"]
        cache = StaticCache(stage.kv, shape, bufs.slot, pos, need_slots, seq_length, self.reserve[1])
        kwargs = dict(attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        if stage.first:
            kwargs["input_ids"] = bufs.x.view(R, T)
        else:
            h = bufs.x.view(R, T, -1)
            stage._injected.h = h
            kwargs["inputs_embeds"] = h.clone()   # the model may scale it in place (stage.py)
        try:
            if stage.last:
                out = stage.model(**kwargs, logits_to_keep=T).logits
                return out.reshape(R * T, -1).float() if T > 1 else out[:, -1, :].float()
            return stage._base(**kwargs).last_hidden_state.reshape(R * T, -1)
        finally:
            stage._injected.h = stage._injected.alibi = None


def _masks(pos: torch.Tensor, kv_len: int, dtype, windows: dict, chunks: dict) -> dict[str, torch.Tensor]:
    """Additive masks [R, 1, T, kv_len] per attention type, from device positions: what
    engine/model/kv.py build_masks gives rows without padding."""
    key = torch.arange(kv_len, device=pos.device).view(1, 1, kv_len)
    p = pos[:, :, None]                                                  # [R, T, 1]
    neg = torch.finfo(dtype).min
    out = {}
    for name, window in windows.items():
        allowed = key <= p
        if window:
            allowed = allowed & (key > p - window)
        size = chunks.get(name)
        if size:
            allowed = allowed & (key // size == p // size)
        m = torch.zeros((*allowed.shape[:1], 1, *allowed.shape[1:]), dtype=dtype, device=pos.device)
        out[name] = m.masked_fill_(~allowed.unsqueeze(1), neg)
    return out
