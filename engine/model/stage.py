"""One stage's slice of a transformers causal LM: layers [start, end), nothing more.

We drive transformers' own model code rather than re-implementing each family, so
every architecture it ships behaves exactly as upstream. Three small interventions
make a slice of it run:

* the decoder-layer list is cut to [start, end) (layers keep their original
  `layer_idx`, and `config.layer_types` is cut to match);
* on a stage that is not first, base-level embeddings become zero stubs and a
  forward pre-hook on the first held layer substitutes the activations received
  from upstream; on a stage that is not last, the final norm becomes Identity;
* attention sees a `BatchCache` (engine/model/kv.py) and masks we build, so sequences of
  different lengths share a batch.

Weights: safetensors checkpoints are read tensor by tensor, only from the shard
files that hold this stage's tensors, and pushed through transformers' own weight
conversions (MoE expert fusion etc.). GGUF files are single files that transformers
dequantizes whole; we keep our slice and drop the rest.
"""

from __future__ import annotations

import copy
import inspect
import re
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.cpu_linear import use_small_batch_linear
from engine.model.kv import BatchCache, KVStore, build_masks, position_ids
from engine.core.step_gate import StepGate
from engine.core.partition import validate_range
from engine.model.device import pick_device
from engine.model.sources import ModelError, ModelSource

# accelerate's init_empty_weights patches torch's module constructors process-wide, so
# two stages built at once in one process (tests, an in-process head) would see each
# other's patch: building is serialised.
_BUILD_LOCK = threading.Lock()

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


class ZeroEmbedding(nn.Module):
    """Stands in for an embedding on stages that never see token ids."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim = dim
        self.dtype = dtype

    def forward(self, ids):
        return torch.zeros((*ids.shape, self.dim), dtype=self.dtype, device=ids.device)


@dataclass
class StageBatch:
    """One step for a set of sequences: row r extends seq_ids[r] by ns[r] tokens from starts[r]."""

    seq_ids: list[int]
    starts: list[int]
    ns: list[int]

    @property
    def n_tokens(self) -> int:
        return sum(self.ns)


class StageModel:
    def __init__(self, source: ModelSource, start: int, end: int, dtype: torch.dtype = torch.float32,
                 device: str = "auto", kv_budget_tokens: int = 1 << 16, progress=None, cores=None):
        self.source = source
        # a CoreLease (engine/model/cores.py) when stage processes share this machine's CPU
        self.cores = cores
        cfg = copy.deepcopy(source.config())
        self.n_layers_total = cfg.num_hidden_layers
        validate_range(start, end, self.n_layers_total)
        self.start, self.end = start, end
        self.first = start == 0
        self.last = end == self.n_layers_total
        self.dtype = dtype
        self.device = torch.device(pick_device(device))
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self._progress = progress or (lambda done, total, what: None)
        with _BUILD_LOCK:
            self.model = self._load(cfg)
        self.model.train(False)  # inference mode for dropout and friends
        self.kv = KVStore(kv_budget_tokens, dtype, self.device)
        # the hidden states a step hands its first layer: per thread, as a decode step
        # may run while a prompt step waits at one of its layers (step_gate.py)
        self._injected = threading.local()
        self._layers[0].register_forward_pre_hook(self._inject_hook, with_kwargs=True)
        self.gate = StepGate()
        # a profile.StepLog once profiled (load_and_measure): every step it times
        # keeps this stage's profile true to the machine as it runs
        self.step_log = None
        for layer in self._layers[1:]:  # a decode step may cut in before any later layer
            layer.register_forward_pre_hook(self._gate_hook)
        if self.device.type == "cpu":
            # decode steps' few rows: W @ x^T streams each weight matrix instead of
            # packing it per call (engine/model/cpu_linear.py: a decode step over a tenth faster)
            use_small_batch_linear(self.model)
        if cores is not None:
            for layer in self._layers:  # a borrowed core goes back between layers
                layer.register_forward_pre_hook(lambda *_: cores.checkpoint())
        self._plan_masks()

    # ---- construction -------------------------------------------------------
    def _load(self, cfg) -> nn.Module:
        from transformers import AutoModelForCausalLM

        if self.source.gguf_path is not None:
            self._progress(0, 1, "reading GGUF")
            g = self.source.gguf_path
            model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=self.dtype)
            self._cut(model, placeholders=False)
            self._progress(1, 1, "reading GGUF")
        else:
            from accelerate import init_empty_weights

            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype)
            names = self._cut(model, placeholders=True)
            self._load_safetensors(model, names)
            self._finish_cut(model)
        model.to(self.device)
        return model

    def _cut(self, model, placeholders: bool):
        """Remove what this stage does not hold. Returns the checkpoint names it keeps."""
        base = model.base_model
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
            if not (self.start <= i < self.end):
                layers[i] = nn.Module()  # placeholder keeps the original indices during loading
        for name, child in list(base.named_children()):
            if name == layers_name or not any(True for _ in child.parameters()):
                continue
            if isinstance(child, nn.Embedding):
                if not self.first:
                    setattr(base, name, ZeroEmbedding(child.embedding_dim, self.dtype))
            elif not self.last:  # final norm and friends
                setattr(base, name, nn.Identity())
        if emb_out is not None and not self.last:
            model.set_output_embeddings(nn.Identity()) if hasattr(model, "set_output_embeddings") else None
        if not placeholders:
            self._finish_cut(model)
        return set(n for n, _ in model.named_parameters())

    def _finish_cut(self, model):
        base = model.base_model
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

    def _load_safetensors(self, model, param_names: set[str]) -> None:
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        wmap = self.source.weight_map()
        wanted: dict[str, str] = {}
        for key, fname in wmap.items():
            m = _LAYER_KEY.search(key)
            if m is not None and key.split(".")[0] not in ("lm_head",):
                if self.start <= int(m.group(1)) < self.end:
                    wanted[key] = fname
                continue
            wanted[key] = fname  # non-layer tensors: filtered below by what the model keeps
        base_prefix = model.base_model_prefix

        def kept(key: str) -> bool:
            if _LAYER_KEY.search(key):
                return True
            return key in param_names or f"{base_prefix}.{key}" in param_names

        state: dict[str, torch.Tensor] = {}
        emb_key = None
        by_file: dict[str, list[str]] = {}
        for key, fname in wanted.items():
            if self._emb_in_name and key.endswith(self._emb_in_name.split(".", 1)[-1] + ".weight"):
                emb_key = key
            if kept(key):
                by_file.setdefault(fname, []).append(key)
        # Tied LM head: checkpoints usually store its weight only under the embedding's
        # name. A last stage that is not first reads it from there; a single stage that
        # holds both ties the two modules after loading, as transformers would.
        need_tied = self.last and self._tied and f"{self._emb_out_name}.weight" not in wmap
        if need_tied and not self.first and emb_key is not None:
            by_file.setdefault(wanted[emb_key], []).append(emb_key)
        self.files_opened = sorted(by_file)
        total = sum(len(v) for v in by_file.values())
        done = 0
        for fname, keys in by_file.items():
            path = self.source.fetch(fname)
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    t = f.get_tensor(key)
                    if need_tied and key == emb_key:
                        state[f"{self._emb_out_name}.weight"] = t
                        if not kept(key):
                            done += 1
                            continue
                    state[key] = t
                    done += 1
                    if done % 16 == 0 or done == total:
                        self._progress(done, total, "loading weights")
        load_config = LoadStateDictConfig(
            weight_mapping=get_model_conversion_mapping(model), dtype=self.dtype, device_map={"": "cpu"}
        )
        convert_and_load_state_dict_in_model(model, state, load_config)
        if need_tied and self.first:
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ModelError(f"checkpoint lacks tensors this stage needs, e.g. {missing[:3]}")

    def _plan_masks(self) -> None:
        """Which masks the model's forward takes: a dict per attention type, or one tensor."""
        base = self.model.base_model
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

    def _gate_hook(self, *_):
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
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

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
        if inputs.shape[0] != batch.n_tokens or len(batch.ns) != len(batch.seq_ids):
            raise ValueError(f"{inputs.shape[0]} inputs for {batch.n_tokens} tokens in the rows")
        log = self.step_log
        if log is None:
            return self._held_step(batch, inputs)
        cut_ins, t0 = self.gate.cut_ins, time.perf_counter()
        out = self._held_step(batch, inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time, not its launch's
        seconds = time.perf_counter() - t0
        if all(n == 1 for n in batch.ns):
            log.observe("decode", len(batch.ns), seconds)
        elif len(batch.ns) == 1 and self.gate.cut_ins == cut_ins:  # a prompt step nothing cut into
            log.observe("prefill", batch.ns[0], seconds)
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
        parts = {}
        for idx in (decode, prefill):
            sub = StageBatch([batch.seq_ids[i] for i in idx], [batch.starts[i] for i in idx],
                             [batch.ns[i] for i in idx])
            x = torch.cat([inputs[offsets[i]: offsets[i + 1]] for i in idx])
            out = self._forward(sub, x)
            if self.last:
                for j, i in enumerate(idx):
                    parts[i] = out[j: j + 1]
            else:
                o = 0
                for i in idx:
                    parts[i] = out[o: o + batch.ns[i]]
                    o += batch.ns[i]
        return torch.cat([parts[i] for i in range(len(batch.ns))])

    def _forward(self, batch: StageBatch, inputs: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        rows = list(zip(batch.seq_ids, batch.starts, batch.ns))
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
        masks = build_masks(batch.starts, batch.ns, T, cache.kv_len, self.dtype, self.device, self._mask_windows)
        mask = masks if self._mask_dict else masks["full_attention"]
        pos = position_ids(batch.starts, batch.ns, T, self.device)
        kwargs = dict(attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        if self.first:
            kwargs["input_ids"] = padded.to(self.device)
        else:
            h = padded.to(self.device, self.dtype)
            self._injected.h = h
            kwargs["inputs_embeds"] = h
        try:
            if self.last:
                out = self.model(**kwargs, logits_to_keep=1).logits[:, -1, :]
            else:
                out = self.model.base_model(**kwargs).last_hidden_state
        finally:
            self._injected.h = None
        for seq_id, _, n in rows:
            kv.seqs[seq_id].length += n
        if self.last:
            return out.float()
        out = out.reshape(B * T, -1)
        return out if gather is None else out[gather]

    def free(self, seq_id: int) -> bool:
        return self.kv.free(seq_id)
