"""`potluck`'s command line as argparse reads it: every command, its options and their
types (engine/core/cli_args.py holds each to its range). engine/cli/__init__.py runs what it reads."""

from __future__ import annotations

import argparse
import os

from engine.core.cli_args import (MOST_LOCAL_STAGES, advertise_arg, count_arg, hours_arg, listen_arg, mb_arg,
                                  micro_batches_arg, penalty_arg, port_arg,
                                  prompt_chunk_arg, ranged_arg, relay_arg, sampling_arg, seconds_arg, stage_addr_arg,
                                  stages_arg)
from engine.core.precision import CHOICES as WEIGHT_CHOICES
from engine.core.step_gate import COMPUTE_ORDERS
from engine.model.sources import DEFAULT_MODEL


def add_pipeline_args(p):
    # the everyday options first; the rest adapt to the machine and its links by themselves
    g = p.add_argument_group("the model and this machine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face id, a local folder or a .gguf file")
    g.add_argument("--stages", type=stages_arg, default=None,
                   help="pieces the model is split into on this machine, this process included, 1 to "
                        f"{MOST_LOCAL_STAGES} (default: 1, as a token passes the pieces in turn and more "
                        "would add a hop each; with --layers, one per range)")
    g.add_argument("--stage-addr", type=stage_addr_arg, action="append", default=[], metavar="ADDRESS",
                   help="ws://host:port#secret of another computer's stage, as `potluck stage` printed it "
                        "(repeat, in pipeline order); replaces --stages")
    g.add_argument("--device", default="auto",
                   help="where this machine computes: auto (default: the GPU when torch sees one, else the "
                        "CPU), cpu, cuda or cuda:N")
    g.add_argument("--weights", default="auto", choices=list(WEIGHT_CHOICES),
                   help="how finely the weights are stored: auto (default: the finest the machines' memory "
                        "holds), bf16 (unquantized, as published; a CPU computes them as float32), int8 or "
                        "nf4 (about 1/2 and 1/4 the memory, with the bitsandbytes package), int4 (about 1/4, "
                        "torch's own kernels)")
    g.add_argument("--memory-cap-mb", type=mb_arg, default=None,
                   help="the most memory (MiB) this machine's own stage may use (default: what is free)")
    t = p.add_argument_group("tuning (the defaults adapt to the machine and its links; most people leave these)")
    t.add_argument("--layers", default=None, help="the layer split instead of the automatic one: '0:10,10:30' "
                                                  "or '10,20'")
    t.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the number format of the computation (default auto: bfloat16 on a GPU, float32 on the CPU)")
    t.add_argument("--threads", type=count_arg, default=None,
                   help="CPU threads per stage process (default: the cores are shared out among the stages, "
                        "leaving those your other programs use)")
    t.add_argument("--micro-batches", type=micro_batches_arg, default=None,
                   help="groups of requests in flight along the pipeline at once (default: picked from the "
                        "measured compute and links; 1 for stages sharing this machine's CPU)")
    t.add_argument("--wait-timeout", type=seconds_arg, default=300.0,
                   help="seconds requests wait for a machine to join when the ones left after a friend "
                        "leaves cannot hold the model (default 300)")
    t.add_argument("--kv-budget-tokens", type=count_arg, default=None,
                   help="tokens of conversation each stage keeps in memory (default: what its memory holds)")
    t.add_argument("--link", default="jit", choices=["jit", "fixed", "fifo"],
                   help="how links between computers send: replies' next tokens first, long prompts in pieces "
                        "sized to the link (jit, default), in fixed pieces, or in arrival order (fifo)")
    t.add_argument("--prompt-chunk", default="auto", type=prompt_chunk_arg,
                   help="tokens of a long prompt computed per step before it goes on: auto (default) = "
                        "sized to the measured link, 16-64, smaller over a slow one; or a fixed number")
    t.add_argument("--compress", default="off", choices=["off", "auto", "prefill", "all"],
                   help="send what passes between computers at 8 bits (slightly less exact): off (default), "
                        "auto = long prompts' while the link is the bottleneck, prefill = long prompts' always, "
                        "all = every step's, replies' too")
    t.add_argument("--compute", default="in-order", choices=COMPUTE_ORDERS,
                   help="stages compute steps in arrival order (default), or let replies' next tokens cut "
                        "into a long prompt's step: sooner tokens for those replying, a later start for the prompt")
    t.add_argument("--speculate", default=None, choices=["auto", "off"],
                   help="speculative decoding: auto (default; or POTLUCK_SPECULATE) guesses the next tokens "
                        "from the conversation (prompt lookup, or --draft's model) and checks them in one trip "
                        "round the pipeline where that pays (slow links, a quoting reply): replies are the same "
                        "token for token; off decodes one token per trip")
    t.add_argument("--draft", default=None, metavar="MODEL[@WEIGHTS]",
                   help="a draft model of the same tokenizer, on this machine beside the first stage, that "
                        "guesses the next tokens for speculation instead of prompt lookup: 'default', a Hugging "
                        "Face id, a folder or a .gguf, optionally @bf16 (default), @int8, @nf4 or @int4 (e.g. "
                        "meta-llama/Llama-3.2-1B-Instruct for a Llama-3.1-70B; on a CPU-only machine "
                        "'default@int8' stands in); auto: the catalog's pairing for --model. Not with --speculate off")


def _add_api_args(p) -> None:
    p.add_argument("--api-key", default=os.environ.get("POTLUCK_API_KEY"),
                   help="key clients must send (Authorization: Bearer KEY); required beyond loopback "
                        "(default: $POTLUCK_API_KEY)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve the API over HTTPS with this certificate (chain), PEM; with --tls-key")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key, PEM")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page's origin (e.g. http://localhost:3000) whose scripts may call the API from a "
                        "browser (repeatable; '*' for any, with --api-key only; default none)")


def _add_homes_args(sub):
    p = sub.add_parser("host", help="host a pipeline: print an invite code, wait for friends, serve the API")
    add_pipeline_args(p)
    p.add_argument("--relay", type=relay_arg, default="", help="ws://relay:port that both homes can reach")
    p.add_argument("--listen", type=listen_arg, default="", help="HOST:PORT to accept friends directly (e.g. 0.0.0.0:7870)")
    p.add_argument("--advertise", type=advertise_arg, action="append", default=[],
                   help="address to put in the code for --listen: an IP address or name (the --listen port is "
                        "added), HOST:PORT where the router forwards another port, or ws://host:port "
                        "(default: this machine's addresses)")
    p.add_argument("--peers", type=ranged_arg(int, 0, 1 << 10, "a whole number from 0"), default=1,
                   help="friends to wait for, in pipeline order (default 1; 0: serve on this machine at once, "
                        "friends taking their share of the layers as they join)")
    p.add_argument("--uses", type=count_arg, default=None,
                   help="how many machines the code admits (default --peers, at least 1)")
    p.add_argument("--expires", type=hours_arg, default=24.0, help="hours until the code expires (default 24)")
    p.add_argument("--host", default="127.0.0.1", help="API bind address (default loopback only)")
    _add_api_args(p)
    p.add_argument("--port", type=port_arg, default=8000, help="API port (default 8000)")
    p.add_argument("--config", default=None, help="config folder (default ~/.config/potluck or $POTLUCK_HOME)")
    p.add_argument("--prompt", action="append", help="send this message once ready, print the answer, exit")
    p.add_argument("--max-tokens", type=sampling_arg("max_tokens", int), default=256,
                   help="with --prompt: the longest answer, in tokens (default 256, as `potluck chat`'s)")
    p.add_argument("--short", action="store_true",
                   help="also print a short code to read out (one use, 10 minutes; needs --relay)")

    p = sub.add_parser("join", help="contribute this machine to a friend's pipeline with their invite code")
    p.add_argument("code", help="the invite code (or its potluck://join/… link), or a short code (4821-917305) "
                                "with --relay")
    p.add_argument("--relay", type=relay_arg, default="", help="the host's relay, for a short code")
    p.add_argument("--name", default=None, help="how the host sees this machine (default: hostname)")
    p.add_argument("--prefer", default="auto", choices=["auto", "direct", "relay"],
                   help="auto (default): a direct address from the code first, then the relay; direct: "
                        "only the direct addresses; relay: only the relay")
    p.add_argument("--reply-listen", type=listen_arg, default="0.0.0.0:7871", metavar="HOST:PORT",
                   help="when nothing in the code reaches the host: listen here (asking this router for a "
                        "mapping) and show a reply code for the host to paste (default %(default)s)")
    p.add_argument("--no-reply", action="store_true", help="fail instead of offering a reply code")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=count_arg, default=None, help="CPU threads for this machine's stage "
                                                                   "(default: the cores your programs leave free)")
    p.add_argument("--config", default=None, help="config folder (default ~/.config/potluck or $POTLUCK_HOME)")
    p.add_argument("--accept-model", action="append", default=[], metavar="MODEL",
                   help="a model a friend's head may have this machine load, beyond the default and "
                        "Potluck's model list (a hub id or a folder/GGUF path here; repeatable)")

    p = sub.add_parser("invites", help="list this host's invites and members; make or revoke one")
    p.add_argument("--revoke", metavar="ID", help="an invite id or a member's node id")
    p.add_argument("--new", action="store_true", help="make a new code (with the host's last relay/addresses)")
    p.add_argument("--reply", metavar="CODE", help="a friend's reply code: the running host connects to them")
    p.add_argument("--uses", type=count_arg, default=1, help="with --new: how many machines the code admits "
                                                             "(default 1)")
    p.add_argument("--expires", type=hours_arg, default=24.0, help="hours until the code expires (default 24)")
    p.add_argument("--config", default=None, help="config folder (default ~/.config/potluck or $POTLUCK_HOME)")

    p = sub.add_parser("relay", help="run a relay that pairs homes by pipeline id and forwards ciphertext")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every address)")
    p.add_argument("--port", type=port_arg, default=8765, help="port to listen on (default 8765)")
    p.add_argument("--max-frame", type=ranged_arg(int, 4096, 16 << 20, "a number of bytes from 4096 to 16 MiB"),
                   default=128 << 10, help="bytes per frame (default %(default)s)")
    p.add_argument("--max-channels", type=count_arg, default=8,
                   help="joiner connections per pipeline (default %(default)s)")
    p.add_argument("--idle", type=ranged_arg(float, 1, float("inf"), "a number of seconds from 1"), default=120.0,
                   help="seconds a channel may stay silent (default %(default)s)")
    p.add_argument("--rate", type=ranged_arg(float, 0.01, float("inf"), "a number of MB/s above 0"), default=20.0,
                   help="MB/s per pipeline (default %(default)s)")
    p.add_argument("--per-address", type=ranged_arg(int, 0, 1 << 20, "a number from 0"), default=8,
                   help="hosts listed and short codes waiting from one address at once (default %(default)s; "
                        "0: no limit, for a relay behind a proxy, where every client has the proxy's address)")
    p.add_argument("--dump", default=None, help=argparse.SUPPRESS)  # tests: forwarded bytes


def _add_node_args(p):
    p.add_argument("--port", type=port_arg, default=0, help="control API port on 127.0.0.1 (default: a free one)")
    p.add_argument("--token-stdin", action="store_true",
                   help="read the API token from the first line of stdin and exit when stdin closes")
    p.add_argument("--token-file", default=None, help="where to write the API token (mode 0600)")
    p.add_argument("--share-host", default="0.0.0.0", help="address friends' heads reach this GPU on")
    p.add_argument("--share-port", type=port_arg, default=7860, help="port friends' heads reach this GPU on "
                                                                     "(default 7860)")
    p.add_argument("--accept-model", action="append", default=[], metavar="MODEL",
                   help="a model a friend's head may have this machine load, beyond the default and "
                        "Potluck's model list (a hub id or a folder/GGUF path here; repeatable)")
    p.add_argument("--api-port", type=port_arg, default=0,
                   help="OpenAI API port on 127.0.0.1, a free one if it is taken (default: a free one)")
    p.add_argument("--pipeline", default="potluck", help="pipeline name a shared stage accepts")
    p.add_argument("--threads", type=count_arg, default=None,
                   help="CPU threads for this machine's stages (default: the cores your programs leave free)")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--limits", default=None, help="the sharing limits as JSON (the app passes its settings), e.g. "
                        '\'{"vram_cap_mb": 8000, "temp_pause_c": 83, "only_when_idle": true}\'')
    p.add_argument("--poll", type=float, default=2.0, help="seconds between GPU/limit checks")
    p.add_argument("--host-model", default=None, help="start hosting this model right away")
    p.add_argument("--stages", type=stages_arg, default=None,
                   help=f"local stages when hosting, 1 to {MOST_LOCAL_STAGES} (head included; default: 1)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("potluck")
    except PackageNotFoundError:  # run from a checkout that was never installed: no second copy to drift
        return "(not installed)"


class Parser(argparse.ArgumentParser):
    """argparse with errors a person reads: the command's own (`potluck chat --bogus` was
    said with the top-level usage), in two lines (chat's usage ran to twenty before the
    one that said what was wrong), and a word where a flag was meant pointed at --prompt."""

    def error(self, message):
        self.exit(2, f"usage: {self.prog} [options]   (`{self.prog} --help` lists them)\n"
                     f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(ns, "command_parser", self)
            hint = ""
            if command.prog.split()[-1] in ("chat", "host") and not extras[0].startswith("-"):
                hint = f" (a message to send is given as --prompt \"{extras[0]}\")"
            command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="potluck", description="Pool GPUs with friends to run one LLM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens, for a bug report")
    parser.add_argument("--version", action="version", version=f"potluck {_version()}")
    # metavar: a missing command is said as "required: command", not the internal "cmd"
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="command")

    p = sub.add_parser("chat", help="terminal chat with a pipeline on this machine")
    add_pipeline_args(p)
    p.add_argument("--max-tokens", type=sampling_arg("max_tokens", int), default=256,
                   help="the longest reply, in tokens (default 256)")
    p.add_argument("--temperature", type=sampling_arg("temperature", float), default=None,
                   help="0 = greedy (default: the model's own, else 0.7; /set temperature X while chatting)")
    p.add_argument("--top-p", type=sampling_arg("top_p", float), default=None, help="default: the model's own, else 0.9")
    p.add_argument("--top-k", type=sampling_arg("top_k", int), default=None, help="default: the model's own, else off (0)")
    p.add_argument("--min-p", type=sampling_arg("min_p", float), default=None,
                   help="leave out tokens less likely than this times the likeliest, 0..1 (default: the "
                        "model's own, else off)")
    p.add_argument("--repetition-penalty", type=sampling_arg("repetition_penalty", float), default=None,
                   help="default: the model's own, else 1.1")
    p.add_argument("--presence-penalty", type=penalty_arg, default=None,
                   help="OpenAI's, -2..2: lowers the odds of every token the reply already holds (default 0)")
    p.add_argument("--frequency-penalty", type=penalty_arg, default=None,
                   help="OpenAI's, -2..2: lowers each token's odds by how often the reply holds it (default 0)")
    p.add_argument("--seed", type=sampling_arg("seed", int), default=None, help="make sampled replies reproducible")
    p.add_argument("--api-port", type=port_arg, default=0, help="also serve the OpenAI API on this port")
    p.add_argument("--prompt", "--once", action="append",
                   help="send this message instead of reading stdin, print the reply and exit (repeatable)")

    p = sub.add_parser("serve", help="run the head with an OpenAI-compatible API")
    add_pipeline_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    _add_api_args(p)
    p.add_argument("--port", type=port_arg, default=8000, help="API port (default 8000)")

    p = sub.add_parser("stage", help="run one stage server; the head tells it which layers to load")
    p.add_argument("--host", default="127.0.0.1", help="address heads reach it on (default loopback only; "
                                                       "0.0.0.0 for the LAN, with a secret)")
    p.add_argument("--port", type=port_arg, default=7860, help="port (default 7860)")
    p.add_argument("--pipeline", default="local", help="the pipeline's name a head must give (default local)")
    p.add_argument("--secret", default=None,
                   help="what a head must prove to drive this stage (default: $POTLUCK_STAGE_SECRET; "
                        "beyond loopback a new one is made and printed in the address to give the head)")
    p.add_argument("--device", default="auto", help="auto (default: the GPU when torch sees one, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=count_arg, default=None, help="CPU threads (default: the cores your "
                                                                   "programs leave free)")
    p.add_argument("--memory-cap-mb", type=mb_arg, default=None,
                   help="the most memory (MiB) this stage may give a head's layers and cache (default: what is free)")
    p.add_argument("--accept-model", action="append", default=[], metavar="MODEL",
                   help="a model (hub id or path) a head may have this stage load beyond the default and "
                        "Potluck's list (repeatable)")
    p.add_argument("--announce", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--core-lease", default=None, help=argparse.SUPPRESS)  # engine/model/cores.py

    sub.add_parser("prepare", help="read the embedded default model's settings and tokenizer once, so that "
                                   "later starts are quick (make setup runs it)")
    p = sub.add_parser("doctor", help="can this machine compute on its GPU, can friends in other homes reach it? "
                                      "if not, what to do")
    p.add_argument("--no-network", action="store_true", help="skip the network checks (router mapping, NAT)")
    p = sub.add_parser("gpu", help="use this computer's NVIDIA GPU: install or remove the CUDA build of torch, "
                                   "or check which build runs")
    what = p.add_mutually_exclusive_group()
    # --enable / --disable are handled by the `potluck` command before the engine starts
    # (app/launcher.py -> app/gpu_enable.py): listed here so that --help shows them
    what.add_argument("--enable", action="store_true", help="download the CUDA build (~2.5 GB) and switch to it")
    what.add_argument("--disable", action="store_true", help="switch back to the CPU build and delete the CUDA one")
    what.add_argument("--check", action="store_true", help="print one JSON line: torch version, CUDA, device")
    p.add_argument("--index", action="append", metavar="URL", help="with --enable: a package index to use")
    _add_homes_args(sub)
    p = sub.add_parser("node", help="this machine's engine process, driven by the app over a local control API")
    _add_node_args(p)
    sub.add_parser("app", help="the desktop app (tray icon, chat window); see `potluck-app --help`", add_help=False)
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, command in sub.choices.items():
        if command.description is None and helps.get(name):   # `potluck chat --help` says what it is
            command.description = helps[name][0].upper() + helps[name][1:] + "."
        if name != "app":   # `potluck chat -v` as well as `potluck -v chat`
            command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help="log what happens, for a bug report")
        # a check after parsing reports with the command's usage line, not `potluck [-h] …`
        command.set_defaults(command_parser=command)
    return parser
