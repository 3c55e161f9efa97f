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
for 8/4-bit weights, its bitsandbytes quantizer (engine/model/quant.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from engine.core.precision import INT4
from engine.core.product_choice import ProductChoice
from engine.model.cpu_linear import use_small_batch_linear
from engine.model.cuda_graphs import capturing
from engine.model.fused_norms import fuse_rms_norms
from engine.model.fused_rotary import fuse_rotary
from engine.model.fused_products import fuse_products
from engine.model.gqa_attention import use_packed_gqa
from engine.model.int4 import int4_bytes, quantize_layers
from engine.model.int4 import place as place_int4
from engine.model.kv import BatchCache, KVStore, build_masks, position_ids
from engine.core.step_gate import StepGate
from engine.core.partition import validate_range
from engine.model.checkpoint import GgufCheckpoint, SafetensorsCheckpoint
from engine.model.device import QuietTrim, attention_kernels, pick_device
from engine.model.handover import HeldLayers, adopt, keeping_layers, parts_of, put, same_part
from engine.model.quant import make_quantizer, misshapen, weights_of
from engine.model.rope import plain_rotary, per_row_rotary
from engine.model.static_decode import decode_path
from engine.model.step_clock import StepClock
from engine.model.build_lock import BUILD_LOCK
from engine.model.sources import ModelError, ModelSource


_LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def _head_tied(model, emb_in, emb_out, emb_in_name, emb_out_name) -> bool:
    """Whether the LM head shares the input embedding's weight.

    Built on the meta device (init_empty_weights) the two are not yet the same
    tensor, so ask transformers' tying table, which already honours the config.
    """
    if emb_out is None or emb_in is None:
        return False
    if emb_out.weight is emb_in.weight:
        return True
    try:
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    except Exception:  # older transformers: no table, only the config flag
        return bool(getattr(model.config, "tie_word_embeddings", False))
    return tied.get(f"{emb_out_name}.weight") == f"{emb_in_name}.weight"


@contextlib.contextmanager
def _quiet(logger: str, words: str, when) -> None:
    """The logger's records that contain `words` dropped, `when` it is true."""
    def drop(record):
        return words not in record.getMessage()

    target = logging.getLogger(logger)
    if when:
        target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)


def _by_layer(state: dict, split: bool):
    """(layer index or None, tensors): the whole state at once, or -- split -- what is
    outside the decoder layers first, then each layer's tensors in order (a layer's tensors
    stay together: transformers fuses a layer's experts in one conversion)."""
    if not split:
        yield None, state
        return
    parts: dict = {}
    for key, tensor in state.items():
        m = _LAYER_KEY.search(key)
        layer = int(m.group(1)) if m is not None and key.split(".")[0] != "lm_head" else None
        parts.setdefault(layer, {})[key] = tensor
    if None in parts:
        yield None, parts.pop(None)
    for layer in sorted(parts):
        yield layer, parts[layer]


class _Counted:
    """A checkpoint tensor not read yet, that says when transformers' loader reads it
    (`t[...]`): the progress a user sees is the reading, which is most of the wait."""

    def __init__(self, lazy, tick):
        self._lazy, self._tick = lazy, tick

    def __getitem__(self, index):
        out = self._lazy[index]
        self._tick()
        return out

    def get_dtype(self):  # what the quantizer asks of a pre-quantized checkpoint's slices
        return self._lazy.get_dtype()


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding on stages that never see token ids."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim = dim
        self.dtype = dtype

    def forward(self, ids):
        return torch.zeros((*ids.shape, self.dim), dtype=self.dtype, device=ids.device)


class EmbeddingBlockStub(nn.Module):
    """Stands in for an embedding block (token embedding and more) on stages that never
    see token ids: what the stage passes as `inputs_embeds` goes through untouched."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.zero = ZeroEmbedding(dim, dtype)

    def forward(self, input_ids=None, inputs_embeds=None, *args, **kwargs):
        return inputs_embeds if inputs_embeds is not None else self.zero(input_ids)


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


class StageModel:
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

    def _load(self, cfg, kept: dict[int, nn.Module], parts: dict[str, nn.Module], kept_config) -> nn.Module:
        """The model of this stage's slice; `kept` layers and `parts` (a rearrangement's old
        stage on this machine, built from `kept_config`) go in instead of being read."""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        quantizer = make_quantizer(self.weights, cfg, self.dtype)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype)
        if self.source.gguf_path is not None:
            # the GGUF's names map onto the whole model's, so read them before the cut
            checkpoint = GgufCheckpoint(self.source.gguf_path, model, cfg)
        else:
            checkpoint = SafetensorsCheckpoint(self.source)
        self._kept_idx = set(kept)
        names = self._cut(model, placeholders=True, kept=kept, parts=parts, kept_config=kept_config)
        if quantizer is not None:
            # swaps the held layers' Linear modules for bitsandbytes ones (still empty); with
            # every layer kept there are none, which is no news to the user
            with _quiet("transformers.integrations.bitsandbytes", "no linear modules were found", kept):
                quantizer.preprocess_model(model=model, dtype=self.dtype, device_map={"": str(self.device)},
                                           checkpoint_files=None)
        layers = getattr(self._base, self._layers_name)
        # int4: each layer is quantized as soon as it is read, on the device it was read to, so
        # a stage holds one layer at full precision at a time: a slice that fits its GPU only
        # in 4 bits must not pass through it whole at 16
        # (q/k/v and gate/up joined, as engine/model/fused_products.py joins a GPU's full
        # weights; POTLUCK_FUSED_PRODUCTS=0 keeps them apart here too)
        joined = os.environ.get("POTLUCK_FUSED_PRODUCTS", "1") != "0"
        quantize_each = (lambda i: quantize_layers(layers[i], joined=joined)) if self.weights == INT4 else None
        self.source.on_download = self._progress  # hub shards: bytes per file as they arrive
        try:
            self._load_weights(model, checkpoint, names, quantizer, quantize_each)
        finally:
            self.source.on_download = None
        if quantizer is not None:
            quantizer.postprocess_model(model)
        for i, layer in kept.items():   # in after the quantizer, which would wrap them again
            layers[i] = adopt(layer, kept_config, model.config)
        self.files_opened = checkpoint.files_opened
        self._finish_cut(model)
        model.to(self.device)
        place_int4(model, self.device)
        # a stage only serves: no step, in inference mode or not, should record autograd
        model.requires_grad_(False)
        return model

    def _cut(self, model, placeholders: bool, kept=(), parts=None, kept_config=None):
        """Remove what this stage does not hold. Returns the checkpoint names it keeps."""
        base = model.base_model
        if not any(isinstance(c, nn.ModuleList) and len(c) == self.n_layers_total for c in base.children()):
            # a causal LM whose base_model_prefix names no attribute of it (Llama-4 text's
            # "language_model"): base_model is the LM itself, its decoder is `.model`
            base = getattr(model, "model", base)
        self._base = base
        emb_in = model.get_input_embeddings()
        emb_out = model.get_output_embeddings()
        layers_name = None
        for name, child in base.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == self.n_layers_total:
                layers_name = name
        if layers_name is None:
            raise ModelError(f"{type(model).__name__}: cannot find its list of decoder layers")
        self._layers_name = layers_name
        prefix = {id(m): n for n, m in model.named_modules()}
        self._emb_in_name = prefix.get(id(emb_in))
        self._emb_out_name = prefix.get(id(emb_out)) if emb_out is not None else None
        self._tied = _head_tied(model, emb_in, emb_out, self._emb_in_name, self._emb_out_name)

        layers = getattr(base, layers_name)
        for i in range(self.n_layers_total):
            if not (self.start <= i < self.end) or i in kept:
                layers[i] = nn.Module()  # placeholder keeps the original indices during loading
        for name, child in list(base.named_children()):
            # a final norm may have no parameters (OLMo's non-parametric LayerNorm)
            is_norm = "norm" in name.lower() or "norm" in type(child).__name__.lower()
            if name == layers_name or not (is_norm or any(True for _ in child.parameters())):
                continue
            if isinstance(child, nn.Embedding):
                if not self.first:
                    setattr(base, name, ZeroEmbedding(child.embedding_dim, self.dtype))
            elif emb_in is not None and any(m is emb_in for m in child.modules()):
                # an embedding block around the token embedding (ModernBERT-decoder's embedding
                # and norm): the first stage's; later stages are handed the activations
                if not self.first:
                    setattr(base, name, EmbeddingBlockStub(self.hidden_size, self.dtype))
            elif not self.last:  # final norm and friends
                setattr(base, name, nn.Identity())
        if emb_out is not None and not self.last:
            model.set_output_embeddings(nn.Identity()) if hasattr(model, "set_output_embeddings") else None
        # the old stage's embedding, final norm, LM head where this one holds them too (a
        # rearrangement): kept, not read again -- but a head tied to a kept embedding is
        # tied again after loading, not kept as a second copy
        mine = parts_of(model, base, layers) if parts else {}
        for name, part in (parts or {}).items():
            if name in mine and same_part(mine[name], part) and not (self._tied and self.first and mine[name] is emb_out):
                put(model, name, adopt(part, kept_config, model.config))
                self.kept_parts.append(name)
        self.kept_parts.sort()
        if not placeholders:
            self._finish_cut(model)
        names = set(n for n, _ in model.named_parameters() if not any(n.startswith(k + ".") for k in self.kept_parts))
        # and the names the checkpoint stores them under, where transformers renames on
        # loading (GPT-NeoX's LM head is `embed_out` on disk, `lm_head` in the model)
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        for t in get_model_conversion_mapping(model):
            if isinstance(t, WeightRenaming):
                try:
                    rev = t.reverse_transform()
                    names |= {rev.rename_source_key(n)[0] for n in list(names)}
                except Exception:  # a renaming that cannot be reversed names nothing we hold
                    pass
        return names

    def _finish_cut(self, model):
        base = self._base
        layers = getattr(base, self._layers_name)
        setattr(base, self._layers_name, nn.ModuleList(list(layers)[self.start : self.end]))
        self._layers = getattr(base, self._layers_name)
        cfg = model.config
        cfg.num_hidden_layers = self.end - self.start
        if getattr(cfg, "layer_types", None):
            self._layer_types = list(cfg.layer_types)[self.start : self.end]
            cfg.layer_types = self._layer_types
        else:
            self._layer_types = None

    def _load_weights(self, model, checkpoint, param_names: set[str], quantizer, after_layer=None) -> None:
        """Read this stage's tensors, and only those, through transformers' own weight
        conversions (MoE expert fusion etc.) and quantizer, onto the stage's device.
        after_layer(i): the layers are read one at a time, and it is called after each."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        names = checkpoint.names()
        base_prefix = model.base_model_prefix

        def kept(key: str) -> bool:
            m = _LAYER_KEY.search(key)
            if m is not None and key.split(".")[0] != "lm_head":
                return self.start <= int(m.group(1)) < self.end and int(m.group(1)) not in self._kept_idx
            return key in param_names or f"{base_prefix}.{key}" in param_names

        wanted = {key: where for key, where in names.items() if kept(key)}
        # Tied LM head: checkpoints usually store its weight only under the embedding's
        # name. A last stage that is not first reads it from there; a single stage that
        # holds both ties the two modules after loading, as transformers would.
        head_key = f"{self._emb_out_name}.weight"
        head = model.get_output_embeddings()
        need_tied = self.last and self._tied and head_key not in names and head.weight.is_meta  # not kept
        emb_key = None
        if need_tied and self._emb_in_name:
            suffix = self._emb_in_name.split(".", 1)[-1] + ".weight"
            emb_key = next((k for k in names if k.endswith(suffix) and not _LAYER_KEY.search(k)), None)
        if need_tied and not self.first and emb_key is not None:
            wanted[emb_key] = names[emb_key]
        what = "loading weights" if quantizer is None and after_layer is None else f"loading weights as {self.weights}"
        total = len(wanted) + (need_tied and not self.first and kept(emb_key or ""))
        done = 0
        lock = threading.Lock()

        def tick():  # transformers' loader reads tensors from a thread pool
            nonlocal done
            with lock:
                done += 1
                if done % 16 == 0 or done == total:
                    self._progress(done, total, what)

        self._progress(0, total, what)
        with checkpoint.reader(wanted) as get:
            state = {}
            for key in sorted(wanted):
                tensor = _Counted(get(key), tick)
                if need_tied and key == emb_key and not self.first:
                    state[head_key] = tensor
                    if not kept(key):
                        continue
                    tensor = _Counted(get(key), tick)
                state[key] = tensor
            load_config = LoadStateDictConfig(
                weight_mapping=get_model_conversion_mapping(model, None, quantizer), dtype=self.dtype,
                device_map={"": str(self.device)}, hf_quantizer=quantizer)
            errors, mismatched = {}, []
            for layer, part in _by_layer(state, after_layer is not None):
                info, _ = convert_and_load_state_dict_in_model(model, part, load_config)
                # transformers records a failed conversion (a shape that does not fit, a quantizer
                # that refused a tensor) and carries on: a stage must not serve half-loaded layers
                errors.update(getattr(info, "conversion_errors", {}) or {})
                mismatched += getattr(info, "mismatched_keys", None) or []
                if errors or mismatched:
                    break      # said below; the layers after it would load unquantized
                if layer is not None:
                    after_layer(layer)
        if errors:
            key, why = next(iter(errors.items()))
            raise ModelError(f"could not load {len(errors)} weight(s) of this stage, e.g. {key}: {why}")
        mismatched = sorted(mismatched) or misshapen(model)
        if mismatched:
            raise ModelError(f"checkpoint tensors do not match the model's shapes, e.g. {mismatched[:3]}")
        if need_tied and self.first:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ModelError(f"checkpoint lacks tensors this stage needs, e.g. {missing[:3]}")

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
        if self.first:
            kwargs["input_ids"] = padded.to(self.device)
        else:
            h = padded.to(self.device, self.dtype)
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
        return out if gather is None else out[gather]

    def free(self, seq_id: int) -> bool:
        freed = self.kv.free(seq_id)
        if freed and not self.kv.seqs and self.quiet_trim is not None:
            self.quiet_trim.quiet()
        return freed

    def fork(self, parent: int, child: int) -> None:
        """`child` starts as a copy of `parent`'s cached tokens (engine/model/kv.py)."""
        self.kv.fork(parent, child)
