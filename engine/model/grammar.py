"""Constrained decoding for `response_format` (JSON mode, JSON schemas): a token mask
applied by the last stage's sampler (engine/model/sampler.py), from llguidance.

The constraint travels to the last stage as data only: a JSON schema string in the
request's sampling parameters (engine/core/sampling.py), compiled here by llguidance's
JSON-schema compiler. Nothing in it is evaluated; a schema llguidance cannot compile is
refused (at the API with a 400, before anything is submitted).

Why llguidance (of llguidance, xgrammar, outlines-core): one abi3 wheel per platform
(manylinux x86_64 and win_amd64 for every CPython we ship) with no dependencies (xgrammar
pulls triton on Linux and pins against torch); it computes each token's mask lazily on
the CPU in tens of microseconds with no per-schema index to build first (outlines-core
compiles a whole automaton up front, seconds for a large schema); and it has the widest
JSON-schema coverage of the three (JSONSchemaBench).

A request that asks for nothing pays nothing: llguidance is imported, and the model's
tokenizer converted (about a second, once per process), only when the first constrained
request arrives.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

# What the compiler is told whatever the schema says (its "x-guidance" key comes before
# these): JSON on one line, with the usual separators. Flexible whitespace lets a small
# model fill the reply with newlines until max_tokens, valid but useless.
OVERRIDES = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT = '{"type": "object"}'   # response_format {"type": "json_object"}
CACHED_GRAMMARS = 32


class GrammarError(ValueError):
    """A schema that cannot be compiled, or a reply the constraint lost track of."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise GrammarError(f"structured output needs llguidance (pip install llguidance): {exc}") from None
    return llguidance


def compile_schema(schema: str) -> str:
    """The llguidance grammar for a JSON schema (JSON text); GrammarError if it cannot
    be compiled. Needs no tokenizer: the API checks schemas with it before submitting."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=OVERRIDES)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema is not valid: {exc}") from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the JSON schema cannot be used: {error}")
    # a schema no value satisfies ({"$ref": "#"}: itself, with nothing to end it) compiles,
    # and its reply would end at once, empty, "stop": said now. Its first byte, on a
    # tokenizer of bytes (no model's needed): nothing may start it
    start = llg.LLMatcher(llg.LLTokenizer("byte"), grammar, log_level=0)
    first = start.compute_bitmask()   # (where the matcher finds it has nowhere to go)
    if start.is_error() or not (start.is_accepting() or any(first)):
        raise GrammarError("the JSON schema admits no value (a $ref to itself with nothing to end it?)")
    return grammar


class Grammars:
    """One per last stage: the tokenizer in llguidance's form (built on first use) and
    the compiled grammars of recent schemas, each new sequence getting a fresh copy."""

    def __init__(self, load_tokenizer, vocab_size: int):
        self._load_tokenizer = load_tokenizer     # () -> the model's Hugging Face tokenizer
        self.vocab_size = vocab_size              # the LM head's rows (may exceed the tokenizer's)
        self._tok = None
        self.eos: int | None = None
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._tok is None:
            _llguidance()
            import llguidance.hf

            hf = self._load_tokenizer()
            self.eos = hf.eos_token_id
            self._tok = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
        return self._tok

    def constraint(self, schema: str) -> "Constraint":
        with self._lock:
            tok = self._tokenizer()
            template = self._templates.get(schema)
            if template is None:
                llg = _llguidance()
                template = llg.LLMatcher(tok, compile_schema(schema), log_level=0)
                if template.is_error():
                    raise GrammarError(f"the JSON schema cannot be used: {template.get_error()}")
                self._templates[schema] = template
                while len(self._templates) > CACHED_GRAMMARS:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(schema)
            return Constraint(template.deep_copy(), self.eos)


_BITS = torch.arange(8, dtype=torch.uint8)


class Constraint:
    """One sequence's place in its grammar: which tokens may come next."""

    def __init__(self, matcher, eos: int | None):
        self.matcher = matcher
        self.eos = eos

    def apply(self, row: torch.Tensor) -> None:
        """Disallowed tokens' logits to -inf, in place (row: [vocab] float, on the CPU)."""
        m = self.matcher
        if m.is_stopped() or m.is_error():
            # the reply is complete (or the constraint lost track): only end-of-sequence
            keep = self.eos if self.eos is not None and self.eos < row.shape[-1] else int(row.argmax())
            v = row[keep].clone()
            row.fill_(float("-inf"))
            row[keep] = v if torch.isfinite(v) else 0.0
            return
        # one bit per token, lowest first (llguidance.torch's own helper compiles a kernel
        # with torch.compile at first use: a C compiler and seconds this does not need)
        bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits.unsqueeze(1) >> _BITS) & 1).view(-1).bool()
        n = min(allowed.numel(), row.numel())
        row[:n].masked_fill_(~allowed[:n], float("-inf"))
        row[n:] = float("-inf")
        if not torch.isfinite(row).any():   # nothing allowed: end rather than draw from nothing
            row[self.eos if self.eos is not None else 0] = 0.0

    def consume(self, tokens: list[int]) -> None:
        # a token the mask did not allow (none should come) puts the matcher in its error
        # state: apply() then allows only end-of-sequence
        self.matcher.consume_tokens(tokens)


def schema_of(response_format) -> str | None:
    """The JSON schema (JSON text) an OpenAI `response_format` asks for, None for plain
    text; ValueError (its message for the client) for one this server cannot read."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError("'response_format' must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise ValueError("'response_format.type' must be text, json_object or json_schema")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("'response_format.json_schema' must be an object with the schema under 'schema'")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise ValueError("'response_format.json_schema.strict' must be true or false")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise ValueError("'response_format.json_schema.name' must be a string")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ValueError("'response_format.json_schema.schema' must be a JSON schema object")
    # strict or not, the reply is held to the schema: a constraint costs nothing extra
    return json.dumps(schema, separators=(",", ":"))
