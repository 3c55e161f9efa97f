"""How a stage reads its slice of a model: what it cuts away, what stands in for it,
and which tensors it reads (engine/model/stage.py builds a StageModel with this).

The decoder-layer list is cut to [start, end) (placeholders keep the original indices
while the checkpoint's names are matched), embeddings a later stage never uses become
stubs, and a stage that is not last drops the final norm and LM head. Only the slice's
tensors are read (engine/model/checkpoint.py), through transformers' own weight
conversions and, for 8/4-bit weights, its bitsandbytes quantizer (engine/model/quant.py),
or a layer at a time for int4 (engine/model/int4.py). A rearrangement's old stage on this
machine hands over the layers and parts both hold (engine/model/handover.py): those are
adopted, not read again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading

import torch
from torch import nn

from engine.core.precision import INT4
from engine.model.checkpoint import GgufCheckpoint, SafetensorsCheckpoint
from engine.model.handover import adopt, parts_of, put, same_part
from engine.model.int4 import place as place_int4
from engine.model.int4 import quantize_layers
from engine.model.quant import make_quantizer, misshapen
from engine.model.sources import ModelError

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


class StageLoading:
    """StageModel's loading half. What it sets on the stage: _base (the decoder), its
    _layers_name and _layers, the embeddings' names, whether the head is tied (_tied),
    _kept_idx and kept_parts (what a rearrangement handed over), _layer_types,
    files_opened. What it reads: source, start, end, first, last, n_layers_total, dtype,
    weights, device, hidden_size, _progress."""

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
