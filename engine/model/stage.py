"""One stage's slice of a transformers causal LM: layers [start, end), nothing more.

We drive transformers' own model code rather than re-implementing each family, so
every architecture it ships behaves exactly as upstream. Three small interventions
make a slice of it run:

* the decoder-layer list is cut to [start, end) (layers keep their original
  `layer_idx`, and `config.layer_types` is cut to match);
* on a stage that is not first, base-level embeddings (or an embedding block around
  the token embedding) become stubs and a forward pre-hook on the first held layer
  substitutes the activations received from upstream; on a stage that is not last,
  the final norm becomes Identity;
* attention sees a `BatchCache` (engine/model/kv.py) and masks we build, so sequences of
  different lengths share a batch.

What a model derives from the whole batch is made per row, as each sequence alone
gets it: Falcon-RW's ALiBi bias (built here, since the model builds it from a 2-D
padding mask), and the rotary frequencies of LongRoPE and dynamic NTK, which the model
picks from the batch's longest row (engine/model/rope.py).

Weights: a stage reads only its own tensors (engine/model/checkpoint.py: the shard
files that hold them, or its layers' tensors of a memory-mapped GGUF), and pushes
them through transformers' own weight conversions (MoE expert fusion etc.) and,
for 8/4-bit weights, its bitsandbytes quantizer (engine/model/quant.py): the cut and
the reading are engine/model/stage_load.py.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from engine.core.product_choice import ProductChoice
from engine.model.cpu_linear import use_small_batch_linear
from engine.model.cuda_graphs import capturing
from engine.model.fused_norms import fuse_rms_norms
from engine.model.fused_rotary import fuse_rotary
from engine.model.fused_products import fuse_products
from engine.model.gqa_attention import use_packed_gqa
from engine.model.product_attention import EVERY_ROW, set_products
from engine.model.int4 import int4_bytes
from engine.model.kv import BatchCache, KVStore, build_masks, position_ids
from engine.core.step_gate import StepGate
from engine.core.partition import validate_range
from engine.model.device import QuietTrim, attention_kernels, pick_device, to_device
from engine.model.handover import HeldLayers, keeping_layers, parts_of
from engine.model.quant import weights_of
from engine.model.rope import plain_rotary, per_row_rotary
from engine.model.static_decode import decode_path
from engine.model.step_clock import StepClock
from engine.model.build_lock import BUILD_LOCK
from engine.model.sources import ModelSource
from engine.model.stage_load import StageLoading

@dataclass
class StageBatch:
    """One step for a set of sequences: row r extends seq_ids[r] by ns[r] tokens from starts[r].

    keep: per row, how many of its last positions the last stage returns logits for (None:
    one each). A row with keep > 1 is a verification step (speculative decoding, issue
    34): its last token and a draft, whose keep - 1 drafted tokens stay tentative in the
    KV cache until the sequence's next step says where it goes on (model/kv.py reserve)."""

    seq_ids: list[int]
    starts: list[int]
    ns: list[int]
    keep: list[int] | None = None

    @property
    def n_tokens(self) -> int:
        return sum(self.ns)

    @property
    def kept(self) -> list[int]:
        return self.keep if self.keep is not None else [1] * len(self.ns)

    def sub(self, idx: list[int]) -> "StageBatch":
        """The rows idx, in that order."""
        return StageBatch([self.seq_ids[i] for i in idx], [self.starts[i] for i in idx], [self.ns[i] for i in idx],
                          None if self.keep is None else [self.keep[i] for i in idx])


def _weak(method):
    """A hook for the stage's own model that does not hold the stage. A bound method would:
    the model is the stage's, so every dropped stage was a reference cycle, freed only by
    the garbage collector's rare full pass -- minutes, with hundreds of MB of weights and
    cache held meanwhile (found by the chaos run's memory samples after rearrangements)."""
    ref = weakref.WeakMethod(method)

    def hook(*args, **kwargs):
        m = ref()
        return None if m is None else m(*args, **kwargs)

    return hook


def import_model_code() -> None:
    """Import what building any family's slice needs (transformers' model base, about
    1.6 s on a small CPU), so that a stage process waiting for its first configure pays
    for it while idle, not after the head has asked for the layers. Call it on the thread
    that builds the models: the import of one module on two threads at once can hand
    one of them a half-initialized module."""
    from accelerate import init_empty_weights  # noqa: F401
    from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel  # noqa: F401


def _timed_as(batch: StageBatch, cut_into: bool) -> tuple[str, int] | None:
    """What a step counts as in the stage's profile: a decode step of its rows, a prompt
    step of its tokens, or nothing (a mixed step, a prompt step a decode step cut into)."""
    if all(n == 1 for n in batch.ns):
        return "decode", len(batch.ns)
    if batch.keep is not None and batch.ns == batch.keep:
        # a verification step (speculation, issue 34): each row's last token and its
        # draft, every position kept -- timed as a decode step of that many rows (the
        # weights stream once for all of them, as for that many sequences)
        return "decode", batch.n_tokens
    if len(batch.ns) == 1 and not cut_into and batch.keep is None:
        return "prefill", batch.ns[0]
    return None


class StageModel(StageLoading):
    def __init__(self, source: ModelSource, start: int, end: int, dtype: torch.dtype = torch.float32,
                 device: str = "auto", kv_budget_tokens: int = 1 << 16, progress=None, cores=None,
                 weights: str = "auto", reuse: HeldLayers | None = None, products: ProductChoice | None = None,
                 serving: bool = True):
        """products: how a CPU stage picks its decode steps' matrix products (default: by
        timing both on this machine, engine/core/product_choice.py). serving=False: built
        only to hand its layers over (engine/pipeline/load_ahead.py, beside a stage that
        serves), so it takes no decode path: capturing CUDA graphs on that thread while the
        serving stage's steps ran broke the serving stage's steps (the second H200 window)."""
        self.source = source
        cfg = copy.deepcopy(source.config())
        self.n_layers_total = cfg.num_hidden_layers
        validate_range(start, end, self.n_layers_total)
        self.start, self.end = start, end
        self.first = start == 0
        self.last = end == self.n_layers_total
        self.dtype = dtype
        self.weights = weights
        self.device = torch.device(pick_device(device))
        # a CoreLease (engine/model/cores.py): how many threads a CPU step may run on
        self.cores = cores if self.device.type == "cpu" else None
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self._progress = progress or (lambda done, total, what: None)
        # the hooks this stage hangs on its layers: taken off if it hands them over
        self._hooks = []
        self.handed_over = False
        self._asked_weights = weights
        # a rearrangement's old stage on this machine: the layers both hold are kept
        kept, parts = reuse.take(self._built(), start, end) if reuse is not None else ({}, {})
        self.kept_layers = len(kept)
        self.kept_parts: list[str] = []   # those of `parts` that fit this stage (_cut)
        with BUILD_LOCK:   # (engine/model/build_lock.py: init_empty_weights patches process-wide)
            self.model = self._load(cfg, kept, parts, reuse.config if reuse is not None else None)
        self.weights = weights_of(self.model)  # 'auto' on a pre-quantized checkpoint: what it holds
        self.model.train(False)  # inference mode for dropout and friends
        self.kv = KVStore(kv_budget_tokens, dtype, self.device)
        # a GPU stage keeps its storage (captured graphs); a CPU one gives it back when quiet
        kv = self.kv   # not self: nothing the stage holds may hold the stage (see _weak)
        self.quiet_trim = QuietTrim(lambda: not kv.seqs) if self.device.type == "cpu" else None
        # the hidden states a step hands its first layer: per thread, as a decode step
        # may run while a prompt step waits at one of its layers (step_gate.py)
        self._injected = threading.local()
        self._hooks.append(self._layers[0].register_forward_pre_hook(_weak(self._inject_hook), with_kwargs=True))
        self.gate = StepGate()
        # a profile.StepLog once profiled (load_and_measure): every step it times
        # keeps this stage's profile true to the machine as it runs
        self.step_log = None
        # on a GPU its steps are timed by events, read once they have passed (step_clock.py)
        self._clock = StepClock() if self.device.type == "cuda" else None
        for layer in self._layers[1:]:  # a decode step may cut in before any later layer
            self._hooks.append(layer.register_forward_pre_hook(_weak(self._gate_hook)))
        # decode steps' few rows on a CPU: x @ W^T or W @ x^T, whichever this machine
        # runs faster (engine/model/cpu_linear.py: either can halve a decode step)
        self.products = use_small_batch_linear(self.model, products) if self.device.type == "cpu" else None
        # and on a GPU each RMSNorm that is F.rms_norm as one kernel, not six or seven
        # (engine/model/fused_norms.py); POTLUCK_FUSED_NORMS=0 keeps transformers' own
        self.fused_norms = 0
        if self.device.type == "cuda" and os.environ.get("POTLUCK_FUSED_NORMS", "1") != "0":
            self.fused_norms = fuse_rms_norms(self.model)
        # and rotary embeddings as three kernels a layer, not ten (engine/model/fused_rotary.py);
        # POTLUCK_FUSED_ROTARY=0 keeps transformers' own
        self.fused_rotary = 0
        if self.device.type == "cuda" and os.environ.get("POTLUCK_FUSED_ROTARY", "1") != "0":
            self.fused_rotary = fuse_rotary(self.model)
        # a few new tokens a row (a verification step, a short prompt) attend over grouped keys
        # without a copy of them per query head (engine/model/gqa_attention.py);
        # POTLUCK_PACKED_GQA=0 keeps transformers' SDPA path as it is
        self.packed_gqa = os.environ.get("POTLUCK_PACKED_GQA", "1") != "0" and use_packed_gqa(self.model)
        if self.packed_gqa and self.device.type == "cpu" and os.environ.get("POTLUCK_PRODUCT_ATTENTION", "1") != "0":
            # a decode step's bits the same on any number of threads (product_attention.py)
            set_products(self.model, {EVERY_ROW: 1})
        # and the projections that read one input as one product: q/k/v, gate/up
        # (engine/model/fused_products.py); POTLUCK_FUSED_PRODUCTS=0 keeps them apart
        self.fused_products = 0
        if self.device.type == "cuda" and os.environ.get("POTLUCK_FUSED_PRODUCTS", "1") != "0":
            self.fused_products = fuse_products(self.model)
        if self.cores is not None:
            for layer in self._layers:  # a borrowed core goes back between layers
                self._hooks.append(layer.register_forward_pre_hook(lambda *_: cores.checkpoint()))
        self._plan_masks()
        self._plan_alibi()
        # LongRoPE, dynamic NTK: each row's own frequencies (rope.py)
        self.per_row_rotary = per_row_rotary(self.model)
        # decode steps over fixed buffers, replayed as CUDA graphs on a GPU (issue 42)
        self.static = None
        if serving:
            decode_path(self)

    # ---- construction -------------------------------------------------------
    def _built(self) -> tuple:
        """What a kept layer must agree on between two stages of this machine."""
        if not keeping_layers():
            return ()
        return (self.source.fingerprint(), self.dtype, self._asked_weights, str(self.device))

    def hand_over(self) -> HeldLayers:
        """Give this stage's decoder layers to the next stage built here (a rearrangement:
        engine/model/handover.py). This stage runs no step after."""
        self.handed_over = True
        self.static = None   # its captured graphs replay these layers
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        layers = {}
        for i, layer in enumerate(self._layers):
            for m in layer.modules():
                plain_rotary(m)
            layers[self.start + i] = layer
        parts = parts_of(self.model, self._base, self._layers)
        emb_in = self.model.get_input_embeddings() if self.first else None   # a later stage's is a stub
        first = {n: m for n, m in parts.items() if isinstance(m, nn.Embedding) or any(x is emb_in for x in m.modules())}
        last = {n: m for n, m in parts.items() if n not in first}
        setattr(self._base, self._layers_name, nn.ModuleList())
        self._layers = getattr(self._base, self._layers_name)
        return HeldLayers(layers, self._built(), self.model.config, self.n_layers_total,
                          first if self.first else {}, last if self.last else {})

    def _plan_masks(self) -> None:
        """Which masks the model's forward takes: a dict per attention type, or one tensor."""
        base = self._base
        src = inspect.getsource(type(base).forward)
        cfg = self.model.config
        window = getattr(cfg, "sliding_window", None)
        if ", dict)" in src and self._layer_types:
            types = set(self._layer_types) | {"full_attention"}
            self._mask_windows = {t: (window if t == "sliding_attention" else None) for t in types}
            self._mask_dict = True
        else:
            uses_sliding = "create_sliding_window_causal_mask" in src and window
            self._mask_windows = {"full_attention": window if uses_sliding else None}
            self._mask_dict = False
        # Llama 4's chunked attention: each position sees only its own chunk of keys
        chunk = getattr(cfg, "attention_chunk_size", None)
        self._mask_chunks = {"chunked_attention": chunk} if chunk and "chunked_attention" in self._mask_windows else {}
        # Llama 4 scales NoPE layers' queries by position, taken as the cache length plus
        # the column: one position for the whole batch, so rows must agree on it (below)
        self._temperature_floor = getattr(cfg, "floor_scale", None) if getattr(cfg, "attn_temperature_tuning", False) else None

    def _plan_alibi(self) -> None:
        """Falcon-RW's ALiBi bias, built here instead of by the model.

        The model builds it from a 2-D padding mask, which left-padded rows at different
        positions do not have (they get the 4-D mask build_masks makes), and adds it to the
        causal mask it builds itself. So the stage turns the model's own ALiBi off, adds the
        bias to its mask as the model would, and hands every layer the bias (_layer_alibi),
        which also tells a layer not to rotate its queries and keys.
        """
        base = self._base
        self._alibi = None
        if not getattr(base, "use_alibi", False):
            return
        build = inspect.getmodule(type(base)).build_alibi_tensor  # transformers' own, to the bit
        self._alibi = (build, base.num_heads, math.sqrt(self.model.config.hidden_size // base.num_heads))
        base.use_alibi = False
        for layer in self._layers:
            self._hooks.append(layer.register_forward_pre_hook(_weak(self._layer_alibi), with_kwargs=True))

    def _with_alibi(self, mask: torch.Tensor) -> torch.Tensor:
        """The model's mask-plus-bias for the 4-D mask `mask` [B, 1, T, K]: each key gets
        slope * its absolute position (the model's bias for one sequence without padding),
        scaled as the model scales it; masked keys stay masked."""
        build, heads, scale = self._alibi
        B, K = mask.shape[0], mask.shape[-1]
        alibi = build(torch.ones((B, K), dtype=torch.long, device=mask.device), heads, self.dtype)
        alibi = alibi.reshape(B, heads, 1, K)
        self._injected.alibi = alibi
        return torch.masked_fill(alibi / scale, mask < -1, torch.finfo(mask.dtype).min)

    def _layer_alibi(self, module, args, kwargs):
        alibi = getattr(self._injected, "alibi", None)
        if alibi is None:
            return None
        return args, {**kwargs, "alibi": alibi}

    def _gate_hook(self, *_):
        if capturing():   # a graph's warm-up or capture holds the one capture lock: no parking
            return
        if self.gate.checkpoint() and self.cores is not None:
            self.cores.sync_threads()  # the decode step may have handed back a borrowed core

    def _inject_hook(self, module, args, kwargs):
        h = getattr(self._injected, "h", None)
        if h is None:
            return None
        if args:
            return (h,) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = h
        return args, kwargs

    # ---- running ------------------------------------------------------------
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + int4_bytes(self.model)

    def held_bytes(self) -> int:
        """Its weights and cache: memory the machine has for whatever replaces this stage."""
        return self.param_bytes() + self.kv.allocated_bytes()

    @torch.inference_mode()
    def forward(self, batch: StageBatch, inputs: torch.Tensor) -> torch.Tensor:
        """Run this stage's layers for one step.

        inputs: token ids [N] (first stage) or hidden states [N, hidden] (others),
        packed row after row. Returns packed hidden states [N, hidden], or on the last
        stage the logits of each row's last token [B, vocab].

        Rows are left-padded to the longest row, so a step that mixes decode rows
        (1 token) with a prefill (hundreds) runs them as two sub-batches instead of
        padding every decode row to the prompt's length.
        """
        if self.handed_over:
            raise RuntimeError("this stage's layers went to the stage that replaced it")
        if inputs.shape[0] != batch.n_tokens or len(batch.ns) != len(batch.seq_ids):
            raise ValueError(f"{inputs.shape[0]} inputs for {batch.n_tokens} tokens in the rows")
        if batch.keep is not None and (len(batch.keep) != len(batch.ns)
                                       or not all(1 <= k <= n for k, n in zip(batch.keep, batch.ns))):
            raise ValueError("each row keeps 1 to n positions")
        log = self.step_log
        if log is None:
            with attention_kernels(self.device):
                return self._held_step(batch, inputs)
        clock = self._clock
        if clock is not None:
            # the step's time, not its launch's, without waiting for it: its events are
            # read at a later step (whatever reads its output waits for it anyway)
            for kind, n, seconds in clock.passed():
                log.observe(kind, n, seconds)
            start = clock.start()
        cut_ins, t0 = self.gate.cut_ins, time.perf_counter()
        with attention_kernels(self.device):
            out = self._held_step(batch, inputs)
        timed = _timed_as(batch, cut_into=self.gate.cut_ins != cut_ins)
        if timed is not None:
            if clock is not None:
                clock.stop(start, *timed)
            else:
                log.observe(*timed, time.perf_counter() - t0)
        return out

    def _held_step(self, batch: StageBatch, inputs: torch.Tensor) -> torch.Tensor:
        if self.cores is None:
            return self._step(batch, inputs)
        if self.gate.cut_in_here():
            # the parked step holds this process's cores: compute on them as they are
            self.cores.sync_threads()
            return self._step(batch, inputs)
        with self.cores.hold(batch.n_tokens):
            return self._step(batch, inputs)

    def _step(self, batch: StageBatch, inputs: torch.Tensor) -> torch.Tensor:
        self.kv.reserve(list(zip(batch.seq_ids, batch.starts, batch.ns)))
        decode = [i for i, n in enumerate(batch.ns) if n == 1]
        if not decode or len(decode) == len(batch.ns):
            return self._forward(batch, inputs)
        prefill = [i for i, n in enumerate(batch.ns) if n > 1]
        offsets = [0]
        for n in batch.ns:
            offsets.append(offsets[-1] + n)
        # rows per output: the last stage returns kept[i] logits per row, the others n hidden states
        per = batch.kept if self.last else batch.ns
        parts = {}
        for idx in (decode, prefill):
            sub = batch.sub(idx)
            x = torch.cat([inputs[offsets[i]: offsets[i + 1]] for i in idx])
            out = self._forward(sub, x)
            o = 0
            for i in idx:
                parts[i] = out[o: o + per[i]]
                o += per[i]
        return torch.cat([parts[i] for i in range(len(batch.ns))])

    def _forward(self, batch: StageBatch, inputs: torch.Tensor) -> torch.Tensor:
        if self.static is not None:
            out = self.static.try_step(batch, inputs)
            if out is not None:
                return out
        kv = self.kv
        rows = list(zip(batch.seq_ids, batch.starts, batch.ns))
        fs = self._temperature_floor
        if fs and len(rows) > 1:
            # the model takes row r's position at column c as max(starts) + c: right when every
            # row ends at the same place, or (decoding) when all sit in one temperature bucket
            top, T = max(batch.starts), max(batch.ns)
            if not (all(s + n - T == top for s, n in zip(batch.starts, batch.ns))
                    or (T == 1 and len({(s + 1) // fs for s in batch.starts}) == 1)):
                outs, o = [], 0
                for r, (seq_id, start, n) in enumerate(rows):
                    outs.append(self._forward(batch.sub([r]), inputs[o: o + n]))
                    o += n
                return torch.cat(outs)
        for seq_id, start, _ in rows:
            kv.open(seq_id)
        B, T = len(rows), max(batch.ns)
        # left-pad packed tokens into [B, T]
        if T == 1:
            padded = inputs.view(B, 1, *inputs.shape[1:])
            gather = None
        else:
            gather = torch.cat([torch.arange(T - n, T) + r * T for r, n in enumerate(batch.ns)])
            if inputs.device.type != "cpu":      # indexing a GPU tensor by a host one waits for the GPU
                gather = to_device(gather, torch.long, inputs.device)
            padded = inputs.new_zeros((B * T, *inputs.shape[1:]))
            padded[gather] = inputs
            padded = padded.view(B, T, *inputs.shape[1:])
        slots = [kv.seqs[s].slot for s in batch.seq_ids]
        cache = BatchCache(kv, slots, batch.starts, batch.ns, T)
        masks = build_masks(batch.starts, batch.ns, T, cache.kv_len, self.dtype, self.device, self._mask_windows,
                            self._mask_chunks)
        mask = masks if self._mask_dict else masks["full_attention"]
        if self._alibi is not None:
            mask = self._with_alibi(mask)
        pos = position_ids(batch.starts, batch.ns, T, self.device)
        kwargs = dict(attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        # from the host through pinned memory, queued behind the GPU's work: a plain copy
        # waits for all of it first
        if self.first:
            kwargs["input_ids"] = to_device(padded, padded.dtype, self.device)
        else:
            h = to_device(padded, self.dtype, self.device)
            self._injected.h = h
            # a copy: the model may scale its embeddings in place (CTRL: inputs_embeds *= ...),
            # which must not reach the activations its first layer is handed
            kwargs["inputs_embeds"] = h.clone()
        try:
            if self.last and batch.keep is None:
                out = self.model(**kwargs, logits_to_keep=1).logits[:, -1, :]
            elif self.last:
                # a verification row's logits at each of its last keep positions, packed
                keep = batch.keep
                logits = self.model(**kwargs, logits_to_keep=max(keep)).logits
                K = logits.shape[1]
                out = torch.cat([logits[r, K - k:] for r, k in enumerate(keep)])
            else:
                out = self._base(**kwargs).last_hidden_state
        finally:
            self._injected.h = self._injected.alibi = None
        for (seq_id, _, n), k in zip(rows, batch.kept):
            s = kv.seqs[seq_id]
            s.length += n
            s.tentative = k - 1   # a verification row's drafted tokens, until the next step
        if self.last:
            return out.float()
        out = out.reshape(B * T, -1)
        return out if gather is None else out[to_device(gather, torch.long, out.device)]

    def free(self, seq_id: int) -> bool:
        freed = self.kv.free(seq_id)
        if freed and not self.kv.seqs and self.quiet_trim is not None:
            self.quiet_trim.quiet()
        return freed

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as a copy of `parent`'s cached tokens (engine/model/kv.py)."""
        self.kv.fork(parent, child)
