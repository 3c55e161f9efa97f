"""A checkpoint's tensors, read one by one: safetensors shards or a single GGUF file.

A stage needs only its own layers (plus the embeddings on the first stage and the LM
head on the last). Both readers list the tensors by their transformers name first, so
the stage can choose before anything is read; then they hand over just those:

* safetensors: lazy slices from the shard files that hold them (transformers' loader
  materialises each on the target device, quantizing it there when asked);
* GGUF: the file is memory-mapped and each chosen tensor is dequantized on its own,
  so a stage of a 40 GB GGUF touches its third of the file, not all of it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize

from engine.core.errors import ModelError

class SafetensorsCheckpoint:
    def __init__(self, source):
        self.source = source
        self.files_opened: list[str] = []

    def names(self) -> dict[str, str]:
        """transformers name -> where it lives (the shard file)."""
        return self.source.weight_map()

    @contextlib.contextmanager
    def reader(self, wanted: dict[str, str]):
        """get(name) for the wanted names; the shard files stay open until the block ends."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for name, fname in wanted.items():
            by_file.setdefault(fname, []).append(name)
        self.files_opened = sorted(by_file)
        with contextlib.ExitStack() as stack:
            handles = {f: stack.enter_context(safe_open(str(self.source.fetch(f)), framework="pt"))
                       for f in by_file}
            yield lambda name: handles[wanted[name]].get_slice(name)


def gguf_header(path: Path):
    """The GGUF file's header, its tensor table checked against the file's size: a file cut
    short (a download stopped part way) is named so, with what to do, before anything else
    reads it and fails deep inside a parser."""
    from transformers.integrations.gguf.reader import GgufHeader

    path = Path(path)
    try:
        header = GgufHeader.from_file(str(path))
    except Exception as exc:  # a corrupt table reads as any of IndexError, struct.error, ValueError...
        raise ModelError(f"{path.name} is not a GGUF file Potluck can read ({type(exc).__name__}: {exc}); "
                         "it may be truncated or corrupted: download it again") from None
    size = path.stat().st_size
    for t in header.tensors:
        if header.data_start + t.offset + t.nbytes > size:
            raise ModelError(f"{path.name} is truncated: tensor {t.name} ends past the end of the "
                             f"file ({size} bytes); download it again")
    return header


class GgufCheckpoint:
    """A GGUF file's tensors under their transformers names (llama.cpp's naming undone)."""

    def __init__(self, path: Path, model, cfg):
        """model: the whole (meta-device) model, before any layer is cut: the name map
        is worked out from its parameter names, as transformers' GGUF loader does."""
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = Path(path)
        self.files_opened = [self.path.name]
        self.header = gguf_header(self.path)
        arch = self.header.architecture
        if arch in _MERGED_EXPERTS:
            # their GGUF stores experts merged, and transformers' processor hands them back
            # through the whole-file state dict, not tensor by tensor as a slice is read
            raise ModelError(f"{self.path.name}: GGUF files of the '{arch}' mixture-of-experts architecture "
                             "are not read by slice yet; use the model's safetensors release")
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg.to_dict())
        to_hf = _gguf_to_hf_names(model, self.processor, self.path.name)
        self._infos = {t.name: t for t in self.header.tensors}
        self._names: dict[str, str] = {}
        for gguf_name in self._infos:
            hf = to_hf.get(gguf_name)
            if hf is not None:
                self._names[hf] = gguf_name

    def names(self) -> dict[str, str]:
        """transformers name -> GGUF name."""
        return dict(self._names)

    @contextlib.contextmanager
    def reader(self, wanted: dict[str, str]):
        blob = np.memmap(self.path, mode="r", dtype=np.uint8)
        try:
            # read when transformers' loader materialises it (`t[...]`, as a safetensors
            # slice): one tensor's float copy at a time, not the whole slice's
            yield lambda name: _Deferred(lambda: self._tensor(blob, wanted[name]))
        finally:
            del blob

    def _tensor(self, blob, gguf_name: str) -> torch.Tensor:
        info = self._infos[gguf_name]
        start = self.header.data_start + info.offset
        raw = blob[start: start + info.nbytes]
        qtype = GGMLQuantizationType(info.ggml_type)
        if qtype in _FLOAT_TYPES:
            arr = np.frombuffer(raw, dtype=_FLOAT_TYPES[qtype]).reshape(info.shape)
            out = torch.from_numpy(arr.copy())
            out = out.view(torch.bfloat16) if qtype == GGMLQuantizationType.BF16 else out
        else:
            rows = raw.reshape(*info.shape[:-1], -1)
            out = torch.from_numpy(dequantize(rows, qtype).reshape(info.shape))
        weights = self.processor.process(weights=out.float().numpy(), name=gguf_name, tensor_key_mapping={},
                                         parsed_parameters={"tensors": {}}).weights
        return torch.from_numpy(np.ascontiguousarray(weights))


_MERGED_EXPERTS = {"qwen2moe", "qwen3moe", "gpt-oss", "gpt_oss", "minimax-m2"}

# model_type -> the architecture name llama.cpp's gguf-py files it under, where they differ
_GGUF_ARCH = {"cohere": "command-r", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3",
              "gemma4_text": "gemma4", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss"}


def _gguf_to_hf_names(model, processor, file_name: str) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name.

    As transformers' get_gguf_hf_weights_map does, but building gguf-py's name table
    once instead of once per submodule (which costs seconds per stage on a 30-layer
    model): a parameter that the table does not know by its full name is tried
    under its submodules' shorter names, as that function's recursion does.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    cfg = model.config
    wanted = _GGUF_ARCH.get(cfg.model_type, cfg.model_type)
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == wanted), None)
    if arch is None:
        raise ModelError(f"{file_name}: gguf-py does not know the '{cfg.model_type}' architecture's tensor names")
    table = get_tensor_name_map(arch, cfg.num_hidden_layers)
    out: dict[str, str] = {}
    for full in model.state_dict():
        full = processor.preprocess_name(full)
        name, suffix = full, ""
        if full.endswith((".weight", ".bias")):
            name, suffix = full.rsplit(".", 1)
            suffix = "." + suffix
        parts = name.split(".")
        for i in range(len(parts)):
            gguf_name = table.get_name(".".join(parts[i:]))
            if gguf_name is not None:
                out.setdefault(gguf_name + suffix, full)
                break
        else:
            processor.perform_fallback_tensor_mapping(out, suffix, "", full)
    return out


class _Deferred:
    def __init__(self, read):
        self._read = read

    def __getitem__(self, _):
        return self._read()


# BF16 is read as raw 16-bit words and reinterpreted
_FLOAT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.BF16: np.uint16}
