"""Sampling parameters: what each request asks of the last stage's sampler
(engine/model/sampler.py), validated here because they come off the wire too."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

MAX_STOP_SEQUENCES = 8
MAX_STOP_LENGTH = 256
# OpenAI's own bound on top_logprobs; it also bounds what a token frame may carry per token
MAX_TOP_LOGPROBS = 20
# choices per request (n): each holds a copy of the prompt's KV on every stage, so a
# request's n is bounded well below what a stage's KV budget would refuse anyway
MAX_CHOICES = 16
# a response_format's JSON schema, as JSON text: it rides in every new sequence's frame
# meta (bounded by the wire's MAX_META), so it is held well below that
MAX_SCHEMA_CHARS = 16 << 10


class SamplingError(ValueError):
    """param: the request field at fault, where one is (the API's 400 names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# What a request that names no sampling field gets when the model's generation_config
# says nothing either: chosen for chat. Greedy decoding (and sampling without a
# repetition penalty) falls into loops on small models -- the default model repeats one
# line of a haiku for all 256 tokens -- while 0.7 / 0.9 / 1.1 reads well. SmolLM2's
# authors show 0.2 / 0.9 without the penalty: that loops in four open replies of ten, and
# 0.2 with the penalty answered short questions no more often than 0.7 by more than the
# noise while looping now and then (bench/sampling_defaults.py).
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1}
TUNABLE = tuple(CHAT_DEFAULTS)
# the API's fields whose naming gives a request exactly what it names, its other fields
# neutral (OpenAI's way: temperature 0 is plain greedy decoding); min_p, like the
# presence and frequency penalties, changes nothing else when named
SWITCHING = ("temperature", "top_p", "top_k", "repetition_penalty")
# OpenAI's presence and frequency penalties: 0 (off) unless a request names them, whatever
# else it names or leaves to the defaults (engine/model/sampler.py applies them)
PENALTIES = ("presence_penalty", "frequency_penalty")
PENALTY_RANGE = (-2.0, 2.0)


def sampling_defaults(generation_config: dict | None) -> dict:
    """The sampling fields a request leaves out: the model's own (its
    generation_config.json) where it sets them, chat-friendly ones otherwise."""
    out = dict(CHAT_DEFAULTS)
    gen = generation_config or {}
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0  # the model's authors ask for greedy decoding
    for k in TUNABLE:
        v = gen.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = int(v) if k == "top_k" else float(v)
    try:
        SamplingParams(**out).validate()
    except SamplingError:
        return dict(CHAT_DEFAULTS)  # a generation_config we cannot use
    return out


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0              # 0: off
    top_p: float = 1.0
    # min-p (llama.cpp's, transformers' MinPLogitsWarper): after temperature, tokens less
    # likely than min_p times the likeliest are left out; 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: logits[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty,
    # count[j] the times token j was generated so far in this choice (not in the prompt)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    greedy: bool = False        # temperature 0 means greedy too
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    # the sampled token's log-probability (and the top_logprobs likeliest tokens'),
    # computed on the last stage only for the rows that ask (engine/model/sampler.py)
    logprobs: bool = False
    top_logprobs: int = 0
    # response_format: the reply is held to this JSON schema (JSON text) by a token mask
    # on the last stage (engine/model/grammar.py); data, never code
    json_schema: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0 or self.top_p == 0.0

    @property
    def penalized(self) -> bool:
        """Whether presence or frequency penalties shape this request's logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Strict: unknown keys and wrong types are errors (this may come off the wire)."""
        if not isinstance(d, dict):
            raise SamplingError("sampling parameters must be an object")
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise SamplingError(f"unknown sampling parameter(s): {', '.join(sorted(extra))}", sorted(extra)[0])
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        def num(name, lo, hi, integer=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
                raise SamplingError(f"{name} must be a {'whole ' if integer else ''}number", name)
            if not (lo <= v <= hi):
                raise SamplingError(f"{name} must be between {lo} and {hi}, got {v}", name)

        num("temperature", 0.0, 100.0)
        num("top_k", 0, 1 << 20, integer=True)
        num("top_p", 0.0, 1.0)   # 0 keeps only the likeliest token (OpenAI takes it; clients send it for greedy)
        num("min_p", 0.0, 1.0)
        num("repetition_penalty", 0.01, 100.0)
        for name in PENALTIES:
            num(name, *PENALTY_RANGE)
        num("max_tokens", 1, 1 << 20, integer=True)
        if self.seed is not None:
            num("seed", 0, 2**63 - 1, integer=True)
        if not isinstance(self.greedy, bool):
            raise SamplingError("greedy must be true or false", "greedy")
        if not isinstance(self.logprobs, bool):
            raise SamplingError("logprobs must be true or false", "logprobs")
        num("top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
        if self.top_logprobs and not self.logprobs:
            raise SamplingError("top_logprobs needs logprobs", "top_logprobs")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str) or len(self.json_schema) > MAX_SCHEMA_CHARS:
                raise SamplingError(f"json_schema must be JSON text of at most {MAX_SCHEMA_CHARS} characters")
            try:
                schema = json.loads(self.json_schema)
            except (ValueError, RecursionError):
                raise SamplingError("json_schema is not valid JSON") from None
            if not isinstance(schema, dict):
                raise SamplingError("json_schema must be a JSON object")
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_SEQUENCES:
            raise SamplingError(f"stop must be a list of at most {MAX_STOP_SEQUENCES} strings", "stop")
        for s in self.stop:
            if not isinstance(s, str) or not (0 < len(s) <= MAX_STOP_LENGTH):
                raise SamplingError(f"each stop sequence must be a string of 1..{MAX_STOP_LENGTH} characters", "stop")


def choice_seed(seed: int, index: int) -> int:
    """The seed of a request's choice `index` (n > 1): choice 0 keeps the request's seed,
    so n=1 and the first of n draw alike; the others draw unrelated but reproducible
    numbers (one seed for all would give n copies of one text)."""
    if index == 0:
        return seed
    z = (seed ^ (index * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 31)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 29)) & 0x7FFFFFFFFFFFFFFF
