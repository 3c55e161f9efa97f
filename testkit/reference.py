"""The whole model, loaded by transformers alone: what the stage engine is checked against.

Loaded the way a transformers user would (a GGUF through transformers' own GGUF
loader, a folder through from_pretrained), so a parity check also checks our own
slice readers (engine/model/checkpoint.py).
"""

from __future__ import annotations


def full_model(source, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    if source.gguf_path is not None:
        g = source.gguf_path
        model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.root), dtype=dtype)
    return model.eval()
