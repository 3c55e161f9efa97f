"""The wire format between stages, sans-I/O: bytes in, validated frames out.

Binary frame (little-endian):

    magic "PTLK" | version u8 | type u8 | flags u16 | micro_batch u32 | step u32
    | meta_len u32 | dtype u8 | ndim u8 | reserved u16 | dims u32 * ndim
    | meta (UTF-8 JSON, meta_len bytes) | tensor bytes (prod(dims) * itemsize)

Everything is checked before a byte of tensor memory is allocated: magic, version,
type, dtype code, rank, each dim, the exact total length, and the meta against a
strict schema. Nothing is unpickled or evaluated; the tensor is raw little-endian
values. Control messages are JSON text frames checked by `parse_control`.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.core.compression import Q8_BLOCK, Q8_ROW
from engine.core.profile import check_profile
from engine.core.sampling import MAX_CHOICES, MAX_TOP_LOGPROBS

MAGIC = b"PTLK"
VERSION = 1
HEADER = struct.Struct("<4sBBHIIIBBH")
MAX_NDIM = 4
MAX_META = 1 << 20
MAX_ROWS = 4096
DEFAULT_MAX_PAYLOAD = 1 << 30


class FrameError(ValueError):
    """A frame that must not be processed; the connection that sent it is closed."""


class FrameType(IntEnum):
    ACTIVATIONS = 1   # hidden states of a micro-batch step, stage -> next stage
    TOKENS = 2        # sampled token ids, last stage -> head
    CHUNK = 3         # a piece of an encoded volume (volumes.py), micro_batch = volume id


FLAG_Q8 = 1          # activations as blockwise int8 + one float32 scale per block (core/compression.py)

_DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16, 4: torch.int64, 5: torch.int8}
_CODES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {k: v.itemsize for k, v in _DTYPES.items()}


@dataclass
class Frame:
    type: FrameType
    micro_batch: int
    step: int
    meta: dict
    tensor: torch.Tensor | None = None
    quantized: bool = False       # arrived as int8 blocks; `tensor` is dequantized float32
    # a CHUNK frame's piece: a view of the bytes received, no tensor made (its volume's
    # frame makes one once complete, and a piece copied for nothing cost a copy per hop)
    payload: memoryview | None = None


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """[N, H] float -> [N, H/16 * 20] int8: per block, int8 codes then a float32 absmax/127."""
    n, h = x.shape
    blocks = x.detach().float().reshape(n, h // Q8_BLOCK, Q8_BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
    q = torch.round(blocks / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1).reshape(n, -1)


def dequantize_q8(packed: torch.Tensor) -> torch.Tensor:
    n, w = packed.shape
    blocks = packed.reshape(n, w // Q8_ROW, Q8_ROW)
    q = blocks[..., :Q8_BLOCK].float()
    scale = blocks[..., Q8_BLOCK:].contiguous().view(torch.float32)
    return (q * scale).reshape(n, -1)


def can_q8(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and tensor.is_floating_point() and tensor.shape[1] % Q8_BLOCK == 0


def encode(ftype: FrameType, micro_batch: int, step: int, meta: dict, tensor: torch.Tensor | None = None,
           q8: bool = False, to_host=None) -> bytes:
    """q8: send activations as blockwise int8 (31% of float32's bytes, 63% of bf16's),
    quantized where the tensor is. to_host: how a device tensor reaches host memory (a
    stage's model/device.py HostStaging; by default `.cpu()`)."""
    meta_b = json.dumps(meta, separators=(",", ":")).encode()
    flags = 0
    if tensor is None:
        dims, code, payload = (), 0, b""
    else:
        if q8 and can_q8(tensor):
            tensor, flags = quantize_q8(tensor), FLAG_Q8
        t = tensor.detach().contiguous().cpu() if to_host is None else to_host(tensor).contiguous()
        code = _CODES[t.dtype]
        dims = tuple(t.shape)
        # bf16 has no numpy dtype; its bytes travel as int16
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        payload = raw.numpy().tobytes()
    head = HEADER.pack(MAGIC, VERSION, int(ftype), flags, micro_batch, step, len(meta_b), code, len(dims), 0)
    return b"".join([head, struct.pack(f"<{len(dims)}I", *dims), meta_b, payload])


def decode(data: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD, width: int | None = None) -> Frame:
    """width: the hidden size the receiver computes on (None: any). An activation frame of
    another width is refused before its tensor is made: an int8 frame's dequantized copy
    is four times its bytes, so a 255 MiB frame of a width no stage has cost 2 GB."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FrameError("expected a binary frame")
    data = memoryview(data)
    if len(data) < HEADER.size:
        raise FrameError("frame shorter than its header")
    magic, version, ftype, flags, mb, step, meta_len, code, ndim, _ = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version}")
    try:
        ftype = FrameType(ftype)
    except ValueError:
        raise FrameError(f"unknown frame type {ftype}") from None
    if ndim > MAX_NDIM:
        raise FrameError(f"tensor rank {ndim} exceeds {MAX_NDIM}")
    if meta_len > MAX_META:
        raise FrameError("metadata too large")
    off = HEADER.size
    if len(data) < off + 4 * ndim:
        raise FrameError("frame truncated in its shape")
    dims = struct.unpack_from(f"<{ndim}I", data, off)
    off += 4 * ndim
    if 0 in dims:
        raise FrameError("tensor has an empty dimension")
    if ndim:
        if code not in _DTYPES:
            raise FrameError(f"unknown dtype code {code}")
        dtype = _DTYPES[code]
        nbytes = math.prod(dims) * _ITEMSIZE[code]
        if nbytes > max_payload:
            raise FrameError(f"tensor of {nbytes} bytes exceeds the limit of {max_payload}")
    elif code != 0:
        raise FrameError("dtype given without a tensor")
    else:
        nbytes = 0
    if len(data) != off + meta_len + nbytes:
        raise FrameError(f"frame length {len(data)} does not match its header ({off + meta_len + nbytes})")
    try:
        meta = json.loads(bytes(data[off : off + meta_len]).decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise FrameError("metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise FrameError("metadata must be an object")
    off += meta_len
    tensor = payload = None
    if ftype == FrameType.CHUNK:
        if ndim != 1 or code != _CODES[torch.int8]:
            raise FrameError("a chunk carries its piece as a flat int8 tensor")
        payload = data[off:]
    elif ndim:
        raw_dtype = torch.int16 if dtype == torch.bfloat16 else dtype
        tensor = torch.frombuffer(bytearray(data[off:]), dtype=raw_dtype).view(dims)
        if dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
    if flags & ~FLAG_Q8:
        raise FrameError(f"unknown frame flags {flags:#x}")
    quantized = bool(flags & FLAG_Q8)
    if quantized:
        if ftype != FrameType.ACTIVATIONS or tensor is None or tensor.dtype != torch.int8 or tensor.dim() != 2 \
                or tensor.shape[1] % Q8_ROW:
            raise FrameError(f"int8 activations must be [N, blocks*{Q8_ROW}] int8 on an activation frame")
    if width is not None and tensor is not None and ftype == FrameType.ACTIVATIONS and tensor.dim() == 2:
        got = tensor.shape[1] // Q8_ROW * Q8_BLOCK if quantized else tensor.shape[1]
        if got != width:
            raise FrameError(f"hidden size {got} != model's {width}")
    frame = Frame(ftype, mb, step, meta, tensor, quantized, payload)
    _check_meta(frame)
    if quantized:
        frame.tensor = dequantize_q8(tensor)
    return frame


def _is_uint(v, hi=2**53) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < hi


NEW_KEYS = {"sampling", "prompt", "forks", "replayed"}


def _is_logprob(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= 0


def _check_meta(f: Frame) -> None:
    m = f.meta
    if f.type == FrameType.ACTIVATIONS:
        allowed = {"rows", "new", "partial", "drafts", "rewind", "drop"}
        if set(m) - allowed or "rows" not in m:
            raise FrameError(f"activation metadata must have keys {sorted(allowed)}")
        if not isinstance(m.get("partial", False), bool):
            raise FrameError("partial must be true or false")
        rows = m["rows"]
        if not isinstance(rows, list) or not (0 < len(rows) <= MAX_ROWS):
            raise FrameError("rows must be a non-empty list")
        seen = set()
        total = 0
        for r in rows:
            if not (isinstance(r, list) and len(r) == 3 and all(_is_uint(x) for x in r) and r[2] >= 1):
                raise FrameError("each row must be [seq_id, start, n>=1]")
            if r[0] in seen:
                raise FrameError(f"sequence {r[0]} appears twice in one step")
            seen.add(r[0])
            total += r[2]
        if f.tensor is None or f.tensor.dim() != 2 or f.tensor.shape[0] != total:
            raise FrameError(f"activations must be [{total}, hidden] for these rows")
        new = m.get("new", {})
        if not isinstance(new, dict) or len(new) > MAX_ROWS:
            raise FrameError("new must be an object")
        # drafts: a verification row's drafted tokens (speculative decoding), n - 1 of them
        drafts = m.get("drafts", {})
        if not isinstance(drafts, dict) or (drafts and m.get("partial")):
            raise FrameError("drafts must be an object, and a prompt chunk has none")
        sizes = {r[0]: r[2] for r in rows}
        for k, d in drafts.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 16) or int(k) not in seen or k in new:
                raise FrameError(f"draft for {k!r}, which this step does not verify")
            if not (isinstance(d, list) and len(d) == sizes[int(k)] - 1 > 0 and all(_is_uint(t, 2**31) for t in d)):
                raise FrameError("a draft must list the row's n - 1 drafted token ids")
        # rewind: {seq_id: n}, a kept reply's sequence this step's row takes over, its KV
        # cut back to the n tokens the row starts after (engine/pipeline/kept_replies.py)
        rewind = m.get("rewind", {})
        if not isinstance(rewind, dict) or len(rewind) > MAX_ROWS:
            raise FrameError("rewind must be an object")
        starts = {r[0]: r[1] for r in rows}
        for k, n in rewind.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 16) or int(k) not in seen:
                raise FrameError(f"rewind for {k!r}, which is not in this step")
            if not (_is_uint(n) and n == starts[int(k)]):
                raise FrameError("a rewind keeps the tokens its row starts after")
        # drop: kept replies let go before this step (room for it); none of its rows
        drop = m.get("drop", [])
        if not (isinstance(drop, list) and len(drop) <= MAX_ROWS and all(_is_uint(d) and d not in seen for d in drop)):
            raise FrameError(f"drop must list at most {MAX_ROWS} sequences this step does not compute")
        forked = set()
        for k, v in new.items():
            # isascii: int() rejects some str.isdigit() characters ('²'); len: 2**53 has 16 digits
            if not (k.isascii() and k.isdigit() and len(k) <= 16) or int(k) not in seen:
                raise FrameError(f"new sequence {k!r} is not in this step")
            if not isinstance(v, dict) or not ({"sampling", "prompt"} <= set(v) <= NEW_KEYS):
                raise FrameError("new sequence entries need sampling and prompt (and may have forks, replayed)")
            if not isinstance(v["prompt"], list) or not all(_is_uint(t, 2**31) for t in v["prompt"]):
                raise FrameError("prompt must be a list of token ids")
            # replayed: how many of the prompt's last tokens were generated before a
            # rearrangement (a constrained reply's grammar goes on after them)
            if "replayed" in v and not (_is_uint(v["replayed"]) and v["replayed"] <= len(v["prompt"])):
                raise FrameError("replayed must count tokens of the prompt")
            # forks: [[seq_id, seed], ...], sequences that start as a copy of this one
            # after this step (a request's other choices, sampled as it is but for the
            # seed); each id new to the step
            forks = v.get("forks", [])
            if "forks" in v and not (isinstance(forks, list) and 0 < len(forks) < MAX_CHOICES):
                raise FrameError(f"forks must be a list of 1..{MAX_CHOICES - 1} entries")
            if forks and m.get("partial"):
                raise FrameError("a prompt chunk forks nothing")
            for e in forks:
                if not (isinstance(e, list) and len(e) == 2 and _is_uint(e[0])
                        and (e[1] is None or _is_uint(e[1], 2**63))):
                    raise FrameError("each fork must be [seq_id, seed or null]")
                if e[0] in seen or e[0] in forked:
                    raise FrameError(f"fork {e[0]} is not a new sequence")
                forked.add(e[0])
    elif f.type == FrameType.CHUNK:
        if set(m) != {"off", "total", "kind"}:
            raise FrameError("chunk metadata must have keys off, total, kind")
        if not (_is_uint(m["off"]) and _is_uint(m["total"])):
            raise FrameError("chunk off and total must be non-negative integers")
        if m["kind"] not in ("decode", "prefill"):
            raise FrameError("chunk kind must be decode or prefill")
    elif f.type == FrameType.TOKENS:
        if set(m) - {"tokens", "errors"}:
            raise FrameError("token metadata must have keys tokens, errors")
        toks = m.get("tokens", [])
        if not isinstance(toks, list) or len(toks) > MAX_ROWS:
            raise FrameError("tokens must be a list")
        for t in toks:
            if not (isinstance(t, list) and len(t) in (2, 4) and _is_uint(t[0]) and _is_uint(t[1], 2**31)):
                raise FrameError("each token entry must be [seq_id, token_id] or [seq_id, token_id, logprob, top]")
            if len(t) == 4:   # with logprobs: the token's, and [[token_id, logprob], ...] likeliest first
                top = t[3]
                if not (_is_logprob(t[2]) and isinstance(top, list) and len(top) <= MAX_TOP_LOGPROBS
                        and all(isinstance(e, list) and len(e) == 2 and _is_uint(e[0], 2**31) and _is_logprob(e[1])
                                for e in top)):
                    raise FrameError(f"logprobs must be a number <= 0 and at most {MAX_TOP_LOGPROBS} "
                                     "[token_id, logprob] pairs")
        errs = m.get("errors", [])
        if not isinstance(errs, list) or len(errs) > MAX_ROWS:
            raise FrameError("errors must be a list")
        for e in errs:
            if not (isinstance(e, list) and len(e) == 2 and _is_uint(e[0]) and isinstance(e[1], str)):
                raise FrameError("each error entry must be [seq_id, message]")
        if f.tensor is not None:
            raise FrameError("token frames carry no tensor")


# ---- control messages (JSON text frames) ------------------------------------

_STR, _INT, _OPT_STR, _OPT_INT, _LIST_INT, _NUM, _DICT = "str", "int", "str?", "int?", "[int]", "num", "dict"
_BOOL = "bool"
# the line test's (engine/core/line_check.py): a size the stage sends back, and what it sends
_TEST_SIZE, _FILL = "test_size", "fill"
_PROFILE = "profile"   # a stage's compute profile, checked point by point (profile.check_profile)
_OPT_PROFILE = "profile?"

CONTROL_SCHEMAS: dict[str, dict[str, str]] = {
    # stage -> anyone who connects, before anything else (engine/wire/stage_auth.py)
    "challenge": {"nonce": _STR},
    # head -> stage (and stage -> next stage, role data); auth: the proof of the share's
    # secret (control) or of the pipeline's route token (data)
    "hello": {"role": _STR, "version": _INT, "pipeline": _STR, "auth": _STR},
    # stage -> the peer whose hello proved its key: the handshake's answer; everything
    # after it, both ways, is sealed
    "accept": {"auth": _STR},
    "configure": {"model": _STR, "start": _INT, "end": _INT, "fingerprint": _OPT_STR, "next": _OPT_STR,
                  "dtype": _STR, "kv_budget_tokens": _OPT_INT, "threads": _OPT_INT,
                  "link": _OPT_STR, "compress": _OPT_STR, "compute": _OPT_STR, "acks": _BOOL,
                  "weights": _STR, "profile": _OPT_PROFILE, "route": _STR},
    # a machine being taken in loads its layers ahead while the pipeline serves without it
    # (the configure that follows keeps them): what configure names of the model and slice
    # (spare: layers held against a loss, for as long as this arrangement lasts, so they
    # must leave the cache's promised room free)
    "prepare": {"model": _STR, "start": _INT, "end": _INT, "fingerprint": _OPT_STR, "dtype": _STR, "weights": _STR,
                "spare": _BOOL},
    "free": {"seq_ids": _LIST_INT},
    "get_stats": {},
    # before a machine that dropped out is taken back: send `bytes` of filler (line_fill)
    "line_test": {"bytes": _TEST_SIZE},
    "shutdown": {},
    # stage -> head
    # a data link's hello was proven: the link may now carry activations (a data link's
    # peer sends nothing more before it, so no activation meets the pre-proof size limit)
    "ready": {},
    "welcome": {"version": _INT, "free_memory": _INT, "speed": _NUM, "device": _STR, "device_name": _STR,
                "quantized": _BOOL},
    "progress": {"done": _INT, "total": _INT, "what": _STR},
    "configured": {"fingerprint": _STR, "param_bytes": _INT, "kv_budget_tokens": _INT, "n_layers": _INT,
                   "profile": _PROFILE, "weights": _STR, "kept_layers": _INT},
    # how many layers were loaded ahead; why none were (they load during the rearrangement)
    "prepared": {"n_layers": _INT, "error": _OPT_STR},
    # the stage's profile as its steps in service time it (profile.StepLog)
    "profile": {"profile": _PROFILE},
    "error": {"message": _STR},
    "line_fill": {"fill": _FILL},
    "stats": {"seqs": _INT, "kv_tokens": _INT, "kv_bytes": _INT, "rejected": _INT, "cut_ins": _INT, "fixed_steps": _INT,
              "graph_replays": _INT, "graph_captures": _INT},
    # the stage's owner is taking it away (sharing off, a game, sleep): the head moves
    # its layers elsewhere now and lets it go; it goes anyway after `seconds`
    "leaving": {"reason": _STR, "seconds": _NUM},
    # receiver -> sender on a data link: a volume piece arrived
    "ack": {"v": _INT, "bytes": _INT},
}
MAX_CONTROL = 1 << 20
LINE_TEST_MAX = 64 * 1024      # engine/core/line_check.py's TEST_BYTES: all a head asks


def _type_ok(v, kind: str) -> bool:
    if kind.endswith("?"):
        if v is None:
            return True
        kind = kind[:-1]
    if kind == _STR:
        return isinstance(v, str) and len(v) <= 4096
    if kind == _INT:
        return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**53
    if kind == _BOOL:
        return isinstance(v, bool)
    if kind == _NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind == _LIST_INT:
        return isinstance(v, list) and len(v) <= MAX_ROWS and all(_is_uint(x) for x in v)
    if kind == _DICT:
        return isinstance(v, dict)
    if kind == _TEST_SIZE:
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= LINE_TEST_MAX
    if kind == _FILL:
        return isinstance(v, str) and len(v) <= LINE_TEST_MAX
    if kind == _PROFILE:
        try:
            check_profile(v)
        except ValueError:
            return False
        return True
    return False


def control(kind: str, **fields) -> str:
    msg = {"type": kind, **fields}
    parse_control(json.dumps(msg))  # never send what we would refuse to receive
    return json.dumps(msg)


def parse_control(text: str | bytes) -> dict:
    if isinstance(text, (bytes, bytearray)):
        raise FrameError("expected a text control message")
    if len(text) > MAX_CONTROL:
        raise FrameError("control message too large")
    try:
        msg = json.loads(text)
    except (ValueError, RecursionError):
        raise FrameError("control message is not valid JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise FrameError("control message needs a type")
    schema = CONTROL_SCHEMAS.get(msg["type"])
    if schema is None:
        raise FrameError(f"unknown control message type {msg['type']!r}")
    fields = {k: v for k, v in msg.items() if k != "type"}
    if set(fields) != set(schema):
        missing, extra = set(schema) - set(fields), set(fields) - set(schema)
        raise FrameError(f"{msg['type']}: missing {sorted(missing)} unexpected {sorted(extra)}")
    for k, kind in schema.items():
        if not _type_ok(fields[k], kind):
            raise FrameError(f"{msg['type']}.{k} has the wrong type")
    return msg
