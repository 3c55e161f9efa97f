"""`potluck` command line: chat, serve (OpenAI API), stage; host, join, invites, relay (engine/homes.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from .models import DEFAULT_MODEL, ModelError
from .step_gate import COMPUTE_ORDERS


class ProgressBar:
    """One line per stage on stderr, redrawn in place: model loading takes a while."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.last = 0.0
        self.open = False
        self.open_stage = None

    def finish(self):
        """End a line left open by a bar that never reached its total."""
        if self.open:
            self.stream.write("\n")
            self.open = False

    def __call__(self, stage: int, done: int, total: int, what: str):
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = int(width * done / max(total, 1))
        bar = "#" * filled + "-" * (width - filled)
        if self.open and stage != self.open_stage:
            self.stream.write("\n")
        self.stream.write(f"\r  stage {stage}: {what:<18} [{bar}] {done}/{total}   ")
        self.open, self.open_stage = done < total, stage
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def _prompt_chunk(text: str):
    """--prompt-chunk: 'auto' or a positive number of tokens."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a positive number of tokens")
    return n


def _add_pipeline_args(p):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face id, a local folder or a .gguf file")
    p.add_argument("--stages", type=int, default=2, help="stage processes on this machine, head included (default 2)")
    p.add_argument("--stage-addr", action="append", default=[],
                   help="ws://host:port of a remote stage (repeat, in pipeline order); replaces --stages")
    p.add_argument("--layers", default=None, help="override the layer split: '0:10,10:30' or '10,20'")
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches in flight (default: stages)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads per stage process")
    p.add_argument("--kv-budget-tokens", type=int, default=None, help="KV cache tokens per stage (default: from memory)")
    p.add_argument("--link", default="jit", choices=["jit", "fixed", "fifo"],
                   help="how links send: decode-first with just-in-time prefill chunks (default), fixed chunks, or FIFO")
    p.add_argument("--prompt-chunk", default="auto", type=_prompt_chunk,
                   help="tokens of a long prompt computed per step before it goes on: auto (default) = "
                        "sized to the measured link, 16-64, smaller over a slow one; or a fixed number")
    p.add_argument("--compress", default="off", choices=["off", "auto", "prefill", "all"],
                   help="int8 activations on links: auto = prefill volumes while the link is the bottleneck")
    p.add_argument("--compute", default="in-order", choices=COMPUTE_ORDERS,
                   help="stages compute steps in arrival order (default), or decode steps cut into prompt "
                        "steps between layers: lower time per token, later first tokens")


async def build_head(args, progress=None):
    """Start local stage processes (or reach remote ones) and a head over them."""
    from .head import Head
    from .local import LocalStages
    from .models import resolve
    from .partition import parse_layers

    source = resolve(args.model)
    # a bad --layers is reported before any stage process starts
    layers = parse_layers(args.layers, source.config().num_hidden_layers) if args.layers else None
    local = None
    addrs = list(args.stage_addr)
    threads = args.threads
    cores = None
    if not addrs and args.stages > 1:
        # Stage processes on one machine split its cores: OpenMP threads that outnumber
        # cores stall each other at every barrier (measured: 400x slower small ops).
        # Unless --threads fixes it, each process owns its share and borrows idle
        # cores for big steps (engine/cores.py).
        local = LocalStages(args.stages - 1, threads=threads, share_cores=not threads)
        addrs = await local.start()
        cores = local.head_cores
        threads = threads or max(1, (os.cpu_count() or 1) // args.stages)
    if threads:
        import torch

        torch.set_num_threads(threads)
    head = Head(source, addrs, layers=layers, micro_batches=args.micro_batches, dtype=args.dtype,
                kv_budget_tokens=args.kv_budget_tokens, progress=progress,
                link_mode=getattr(args, "link", "jit"), compress=getattr(args, "compress", "off"),
                prefill_chunk=getattr(args, "prompt_chunk", "auto"),
                compute=getattr(args, "compute", "in-order"),
                pipeline=getattr(args, "pipeline", "local"),
                cores=cores, cpu_shares=local.cpu_shares if cores else None)
    head.next_addresses = getattr(args, "next_addresses", None)
    try:
        await head.start()
    except BaseException:
        await head.close()  # its connections to the stages and its compute thread
        if local:
            await local.stop()
        raise
    head.local_stages = local
    return head


async def close_head(head):
    await head.close()
    if getattr(head, "local_stages", None):
        await head.local_stages.stop()


def _describe(head) -> str:
    parts = [f"{s['address']}: layers {s['layers'][0]}-{s['layers'][1] - 1}" for s in head.info()["stages"]]
    return f"{head.source.name}, {len(parts)} stage(s) — " + "; ".join(parts)


async def _chat(args) -> int:
    from .api import serve_api
    from .head import Delta
    from .sampling import SamplingParams

    print(f"Loading {args.model} on {args.stages if not args.stage_addr else len(args.stage_addr) + 1} stage(s)...",
          file=sys.stderr)
    bar = ProgressBar()
    head = await build_head(args, bar)
    bar.finish()
    runner = None
    try:
        print(f"Ready: {_describe(head)}", file=sys.stderr)
        if args.api_port:
            runner = await serve_api(head, "127.0.0.1", args.api_port)
            print(f"OpenAI-compatible API: http://127.0.0.1:{args.api_port}/v1", file=sys.stderr)
        print("Type a message and press Enter. /reset clears the conversation, /quit leaves.\n", file=sys.stderr)
        messages: list[dict] = []
        loop = asyncio.get_running_loop()
        prompts = list(args.prompt or [])
        while True:
            if prompts:
                line = prompts.pop(0)
                print(f"you> {line}")
            elif args.prompt:
                break
            else:
                try:
                    line = await loop.run_in_executor(None, lambda: input("you> "))
                except EOFError:
                    break
            line = line.strip()
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            if line == "/reset":
                messages.clear()
                print("(conversation cleared)")
                continue
            messages.append({"role": "user", "content": line})
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                    greedy=args.temperature == 0)
            try:
                handle = head.submit(head.chat_prompt(messages), params)
            except ValueError as exc:
                print(f"(cannot send: {exc})")
                messages.pop()
                continue
            sys.stdout.write("bot> ")
            parts = []
            async for ev in handle:
                if isinstance(ev, Delta):
                    parts.append(ev.text)
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                else:
                    done = ev
            rate = done.completion_tokens / max(done.seconds - (done.ttft or 0), 1e-6)
            print(f"\n     [{done.completion_tokens} tokens, first after {done.ttft or 0:.2f}s, "
                  f"{rate:.1f} tok/s{', ' + done.error if done.error else ''}]")
            messages.append({"role": "assistant", "content": "".join(parts)})
    finally:
        if runner is not None:
            await runner.cleanup()
        await close_head(head)
    return 0


async def _serve(args) -> int:
    from .api import serve_api

    head = await build_head(args, ProgressBar())
    runner = await serve_api(head, args.host, args.port)
    print(f"Ready: {_describe(head)}", file=sys.stderr)
    print(f"OpenAI-compatible API on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await close_head(head)
    return 0


async def _stage(args) -> int:
    from .local import ANNOUNCE
    from .stage_server import StageServer

    cores = None
    if args.core_lease:
        from .cores import CoreLease

        cores = CoreLease.from_spec(args.core_lease)
    server = await StageServer(args.host, args.port, pipeline=args.pipeline, device=args.device,
                               threads=args.threads, cores=cores).start()
    if args.announce:
        print(f"{ANNOUNCE}{server.port}", flush=True)
        # our parent holds our stdin: when it goes, we go
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        watcher = asyncio.ensure_future(reader.read())
        closed = asyncio.ensure_future(server.wait_closed())
        await asyncio.wait([watcher, closed], return_when=asyncio.FIRST_COMPLETED)
    else:
        print(f"Stage listening on ws://{args.host}:{server.port}", file=sys.stderr, flush=True)
        await server.wait_closed()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["app"]:  # the GUI process must not import transformers or torch
        from app.main import main as app_main

        return app_main(argv[1:])
    # before torch is imported: this process and the stage processes it may start take
    # turns on the CPU's cores, and OpenMP's idle threads must not spin on them (cores.py)
    from .cores import apply_openmp_env

    apply_openmp_env(os.environ)
    parser = argparse.ArgumentParser(prog="potluck", description="Pool GPUs with friends to run one LLM.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("chat", help="terminal chat with a pipeline on this machine")
    _add_pipeline_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--api-port", type=int, default=0, help="also serve the OpenAI API on this port")
    p.add_argument("--prompt", action="append", help="send this message instead of reading stdin (repeatable)")

    p = sub.add_parser("serve", help="run the head with an OpenAI-compatible API")
    _add_pipeline_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)

    p = sub.add_parser("stage", help="run one stage server; the head tells it which layers to load")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--pipeline", default="local")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--core-lease", default=None, help=argparse.SUPPRESS)  # engine/cores.py

    sub.add_parser("prepare", help="convert the embedded default model for split loading (make setup runs it)")

    from . import homes

    homes.add_args(sub, _add_pipeline_args)

    from .node import add_node_args

    p = sub.add_parser("node", help="this machine's engine process, driven by the app over a local control API")
    add_node_args(p)

    sub.add_parser("app", help="the desktop app (tray icon, chat window); see `potluck-app --help`", add_help=False)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.cmd == "prepare":
        from .models import prepare_default

        try:
            print(f"Default model ready at {prepare_default(log=lambda m: print(m, file=sys.stderr))}")
        except ModelError as exc:
            print(f"potluck: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "node":
        from .node import run_node

        fn = run_node
    elif args.cmd == "invites":
        return homes.invites(args)
    else:
        fn = {"chat": _chat, "serve": _serve, "stage": _stage, "host": homes.host, "join": homes.join,
              "relay": homes.relay}[args.cmd]
    try:
        return asyncio.run(fn(args))
    except KeyboardInterrupt:
        return 130
    except ModelError as exc:
        print(f"potluck: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a clear line for the user; details with -v
        from .head import PipelineError

        if isinstance(exc, (PipelineError, OSError)):
            print(f"potluck: {exc}", file=sys.stderr)
            if args.verbose:
                raise
            return 1
        raise
