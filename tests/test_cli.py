"""The command line parses, and says what it wants when it cannot (engine/cli/)."""

import argparse
import os
import subprocess
import sys
import time

import pytest

from engine.cli import main, pipeline_config
from engine.cli.parser import add_pipeline_args, build_parser
from engine.core.cli_args import prompt_chunk_arg


def test_the_cli_takes_auto_or_tokens_and_says_what_it_wants_otherwise():
    assert prompt_chunk_arg("auto") == "auto" and prompt_chunk_arg("32") == 32
    p = argparse.ArgumentParser()
    add_pipeline_args(p)
    assert p.parse_args([]).prompt_chunk == "auto"   # the default: sized to the link
    for bad in ("0", "-8", "big", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number of tokens"):
            prompt_chunk_arg(bad)


def test_pipeline_flags_become_a_typed_config():
    args = build_parser().parse_args(["chat", "--stages", "3", "--device", "cpu", "--prompt-chunk", "32",
                                      "--layers", "0:10,10:20,20:30"])
    cfg = pipeline_config(args)
    assert (cfg.stages, cfg.device, cfg.prompt_chunk, cfg.layers, cfg.dtype) == (3, "cpu", 32, "0:10,10:20,20:30", "auto")
    assert pipeline_config(args, pipeline="abc").pipeline == "abc"


def test_an_api_open_to_the_network_without_a_key_is_refused_before_anything_loads(monkeypatch):
    import subprocess
    import sys
    import time

    monkeypatch.delenv("POTLUCK_API_KEY", raising=False)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "engine", "serve", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "without an API key" in p.stderr, p.stderr
    assert "Loading" not in p.stderr and time.monotonic() - t0 < 60
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--api-key", "k"])
    assert args.api_key == "k"
    cfg = pipeline_config(build_parser().parse_args(["chat", "--wait-timeout", "30", "--memory-cap-mb", "512"]))
    assert (cfg.wait_timeout, cfg.memory_cap_mb) == (30.0, 512.0)


def test_a_certificate_that_will_not_load_is_said_before_anything_loads(tmp_path):
    import subprocess
    import sys

    from testkit.certs import self_signed

    cert, _ = self_signed(tmp_path)
    for extra, said in ([["--tls-cert", str(cert)], "go together"],
                        [["--tls-cert", str(cert), "--tls-key", str(tmp_path / "nope.pem")], "does not exist"],
                        [["--tls-cert", str(cert), "--tls-key", str(cert)], "cannot use the certificate"],
                        [["--cors-origin", "*"], "any web page"],
                        [["--cors-origin", "localhost:3000"], "is not a web page's origin"]):
        p = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", "0", *extra],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and said in p.stderr and "Loading" not in p.stderr, p.stderr


def test_origins_and_advertised_addresses_are_read_as_browsers_and_friends_will_use_them():
    """`--cors-origin garbage` and `host --advertise garbage` were taken as given: a page
    whose origin never matched was refused with no word of why, and an address with its
    port went into the invite as ws://[1.2.3.4:7870]:7870, which no friend could dial."""
    from engine.core.cli_args import advertise_arg
    from engine.pipeline.api_cors import origin

    # what the browser sends in its Origin header: lower case, no slash, no default port
    assert origin("HTTP://LocalHost:3000/") == "http://localhost:3000"
    assert origin("https://chat.example.org:443") == "https://chat.example.org" and origin("*") == "*"
    for bad in ("garbage", "localhost:3000", "http://localhost:3000/chat", "http://a:b@x.org"):
        with pytest.raises(ValueError, match="not a web page's origin"):
            origin(bad)
    assert advertise_arg("203.0.113.7") == "203.0.113.7" and advertise_arg("[2001:db8::1]") == "2001:db8::1"
    assert advertise_arg("home.example.org") == "home.example.org"
    assert advertise_arg("203.0.113.7:7870") == "ws://203.0.113.7:7870"   # a router forwarding another port
    assert advertise_arg("ws://home.example.org:9000") == "ws://home.example.org:9000"
    for bad in ("two words", "http://x.org:80", "host:99999", "a..b", "ws://x.org"):
        with pytest.raises(argparse.ArgumentTypeError):
            advertise_arg(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["host", "--listen", "0.0.0.0:7870", "--advertise", "two words"])


def test_a_relay_on_a_port_in_use_says_so_as_the_other_commands_do():
    """It said "[Errno 98] error while attempting to bind on address…" (the socket library's words)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "engine", "relay", "--host", "127.0.0.1", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"port {port} is already in use" in p.stderr and "Errno" not in p.stderr, p.stderr


def test_ports_and_counts_out_of_range_are_refused_as_the_command_line_is_read(capsys):
    for argv, said in ((["chat", "--stages", "0"], "not a number of stages from 1 to 8"),
                       (["serve", "--stages", "-1"], "not a number of stages from 1 to 8"),
                       (["serve", "--port", "99999"], "not a port number"),
                       (["serve", "--port", "http"], "not a port number"),
                       (["chat", "--api-port", "-1"], "not a port number"),
                       (["chat", "--max-tokens", "-3"], "max-tokens must be between 1 and"),
                       (["chat", "--min-p", "2"], "min-p must be between 0.0 and 1.0"),
                       (["chat", "--temperature", "nan"], "temperature must be between"),
                       (["chat", "--top-p", "1.5"], "top-p must be between"),
                       (["chat", "--threads", "0"], "not a whole number from 1"),
                       # 100000 was taken, and the reply never came
                       (["chat", "--micro-batches", "100000"], "not a number of micro-batches from 1 to 64"),
                       (["host", "--peers", "-1"], "not a whole number from 0"),
                       # a port out of range ended these with a traceback from bind()
                       (["host", "--listen", "127.0.0.1:99999"], "not HOST:PORT with a port from 0 to 65535"),
                       (["join", "4821-917305", "--reply-listen", "0.0.0.0:-1"], "not HOST:PORT"),
                       (["chat", "--memory-cap-mb", "-5"], "not a number of MiB from 1"),
                       (["serve", "--wait-timeout", "-1"], "not a number of seconds from 0"),
                       (["relay", "--max-frame", "-1"], "not a number of bytes from 4096"),
                       (["serve", "--stage-addr", "not-a-url"], "is not a stage's address"),
                       (["chat", "--stage-addr", "http://10.0.0.2:7860#s"], "is not a stage's address"),
                       (["relay", "--idle", "-1"], "not a number of seconds from 1"),
                       (["relay", "--rate", "0"], "not a number of MB/s above 0"),
                       # a relay given as a web address went into the invite, then failed
                       # at every registration in a library's words
                       (["host", "--relay", "http://relay.example:8765"], "is written ws://host:port"),
                       (["host", "--relay", "ws:///nohost"], "is written ws://host:port"),
                       (["join", "4821-917305", "--relay", "relay.example:8765/x"], "not a relay's address"),
                       (["join", "4821-917305", "--relay", "ws://relay.example:8765/?x=1"], "not a relay's address")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err, argv
    # a draft model with speculation off loaded for nothing (its help said "not with")
    with pytest.raises(SystemExit) as e:
        main(["chat", "--draft", "default", "--speculate", "off"])
    assert e.value.code == 2 and "--speculate off" in capsys.readouterr().err
    # -v after the command too
    assert build_parser().parse_args(["chat", "-v"]).verbose and build_parser().parse_args(["-v", "doctor"]).verbose
    assert not build_parser().parse_args(["doctor"]).verbose
    # the README's `potluck stage --accept-model` (only join and node had it)
    assert build_parser().parse_args(["stage", "--accept-model", "a/b", "--accept-model", "c"]).accept_model == \
        ["a/b", "c"]
    assert build_parser().parse_args(["host", "--relay", " wss://relay.example:443 "]).relay == "wss://relay.example:443"
    assert build_parser().parse_args(["join", "x", "--relay", "wss://relay.example"]).relay == "wss://relay.example"
    # behind a web server under a path: its routes are made by adding to it
    assert build_parser().parse_args(["join", "x", "--relay", "wss://example.com/potluck"]).relay == \
        "wss://example.com/potluck"
    args = build_parser().parse_args(["serve", "--port", "0", "--threads", "2"])
    assert (args.port, args.threads) == (0, 2)      # 0: a port the system picks


def test_a_layer_split_given_alone_says_how_many_stages():
    from engine.cli import _stage_count

    for argv, count in ((["chat", "--layers", "0:10,10:20,20:30", "--device", "cpu"], "3"),
                        (["chat", "--layers", "10,20", "--device", "cpu"], "2"),
                        (["chat", "--layers", "0:30", "--device", "cpu"], "1"),
                        (["chat", "--stages", "2", "--layers", "0:10,10:20,20:30", "--device", "cpu"], "2")):
        assert _stage_count(build_parser().parse_args(argv)) == count, argv


def test_a_port_in_use_is_said_before_the_model_loads():
    import socket
    import subprocess
    import sys

    from engine.cli import port_taken

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        said = port_taken("127.0.0.1", port, "--port")
        assert said and f"port {port} is already in use" in said and "--port" in said
        p = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "already in use" in p.stderr and "loading" not in p.stderr.lower(), p.stderr
        p = subprocess.run([sys.executable, "-m", "engine", "chat", "--api-port", str(port), "--prompt", "hi"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "--api-port" in p.stderr and "loading" not in p.stderr.lower(), p.stderr
    assert port_taken("127.0.0.1", port, "--port") is None     # let go: free again
    assert port_taken("127.0.0.1", 0, "--port") is None


def test_a_second_serve_on_the_port_of_one_still_loading_says_so_before_it_loads(tmp_path):
    """Two `potluck serve --port P` started a moment apart: the first had checked the
    port and let it go while it loaded, so the second loaded the whole model too and
    then failed at its bind with "[Errno 98] error while attempting to bind". The first
    holds the port from its check on; a client that connects meanwhile is answered once
    the model is up."""
    import socket
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    first = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", str(port), "--threads", "1"],
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not any(line.startswith("Loading") for line in lines):
            line = first.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        second = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=120, env=env)
        assert second.returncode == 2 and f"port {port} is already in use" in second.stderr, second.stderr
        assert "loading" not in second.stderr.lower() and "Errno" not in second.stderr, second.stderr
        # the first serves on the port it held
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=120) as r:
            assert r.status == 200 and b"SmolLM2" in r.read()
    finally:
        first.terminate()
        first.communicate(timeout=60)


def test_the_terminal_chat_samples_with_the_models_defaults_and_does_not_loop():
    import subprocess
    import sys
    from collections import Counter

    p = subprocess.run([sys.executable, "-m", "engine", "chat", "--stages", "1", "--max-tokens", "200",
                        "--seed", "1", "--prompt", "Write a haiku about friends sharing GPUs"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Sampling: temperature 0.7, top-p 0.9, top-k off, repetition penalty 1.1" in p.stderr
    words = p.stdout.split("bot>", 1)[1].split("[")[0].split()
    grams = Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3))
    assert words and max(grams.values(), default=0) <= 2, p.stdout


def test_sampling_can_be_changed_while_chatting():
    from engine.core.sampling import CHAT_DEFAULTS, sampling_defaults
    from engine.pipeline.terminal import describe, set_sampling

    s = dict(CHAT_DEFAULTS)
    assert "temperature 0.2" in set_sampling(s, "/set temperature 0.2") and s["temperature"] == 0.2
    assert "top-k 40" in set_sampling(s, "/set top-k 40") and s["top_k"] == 40
    assert "cannot set" in set_sampling(s, "/set top-p 1.5") and s["top_p"] == 0.9
    assert set_sampling(dict(s), "/set top-p 0") == "sampling: greedy, repetition penalty 1.1"
    assert "usage" in set_sampling(s, "/set warmth 3")
    assert set_sampling(s, "/set temperature abc") == "cannot set temperature: 'abc' is not a number"
    assert "'2.5' is not a whole number" in set_sampling(s, "/set top-k 2.5") and s["top_k"] == 40
    assert describe({**s, "temperature": 0}) == "greedy, repetition penalty 1.1"
    assert describe({**s, "temperature": 0, "repetition_penalty": 1.0}) == "greedy"
    # OpenAI's presence and frequency penalties: /set, named once they are on, -2..2
    s.update(presence_penalty=0.0, frequency_penalty=0.0)
    assert "presence" not in describe(s)
    assert "presence penalty 0.5" in set_sampling(s, "/set presence-penalty 0.5") and s["presence_penalty"] == 0.5
    assert "frequency penalty -1" in set_sampling(s, "/set frequency-penalty -1") and s["frequency_penalty"] == -1
    assert "cannot set" in set_sampling(s, "/set frequency-penalty 2.5") and s["frequency_penalty"] == -1
    assert describe({**s, "temperature": 0, "repetition_penalty": 1.0}) == \
        "greedy, presence penalty 0.5, frequency penalty -1"
    # a model's generation_config wins where it speaks; nonsense in it is ignored
    assert sampling_defaults({"temperature": 0.6, "top_p": 0.95}) == {**CHAT_DEFAULTS, "temperature": 0.6,
                                                                       "top_p": 0.95}
    assert sampling_defaults({"do_sample": False})["temperature"] == 0.0
    assert sampling_defaults({"top_p": 7}) == CHAT_DEFAULTS


def test_a_chat_command_is_its_first_word_and_nothing_unasked_runs():
    """The README's promise: a mistyped /command is said to be unknown, not sent to the
    model; a command with words after it that takes none is said too, not run."""
    from engine.pipeline.terminal import chat_command, command_refused, set_sampling

    assert chat_command("/quit") == ("/quit", "") and chat_command("/QUIT") == ("/quit", "")
    assert chat_command("/set top-p 0.5") == ("/set", "top-p 0.5")
    assert chat_command("/settings") == ("/settings", "") and chat_command("/?") == ("/?", "")
    for message in ("hello /quit", "//quit is a word", "/usr/bin is a path", "/"):
        assert chat_command(message) is None, message
    assert command_refused("/quit", "") is None and command_refused("/set", "top-k 4") is None
    assert command_refused("/help", "me") is None          # help is help, whatever follows
    for word, rest in (("/quit", "extra"), ("/reset", "now"), ("/retry", "please")):
        assert "takes nothing after it" in command_refused(word, rest)
    assert command_refused("/settings", "").startswith("unknown command /settings")
    s = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.1}
    # the usage shows where sampling stands, and a bad value is said in the words typed
    assert "now: temperature 0.7" in set_sampling(s, "/set")
    assert set_sampling(s, "/set top-p 2").startswith("cannot set top-p: top-p must be")


def test_the_penalty_flags_take_openais_range():
    args = build_parser().parse_args(["chat", "--presence-penalty", "0.5", "--frequency-penalty", "-2"])
    assert (args.presence_penalty, args.frequency_penalty) == (0.5, -2.0)
    assert build_parser().parse_args(["chat"]).presence_penalty is None   # 0 unless named
    for bad in ("2.5", "-3", "nan", "much"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["chat", "--frequency-penalty", bad])


def test_flags_that_contradict_each_other_are_said_with_the_commands_usage(capsys):
    """--stage-addr with --stages ran on the stages named, the count unread; --draft with
    --speculate off printed the top-level usage (`potluck [-h] …`)."""
    from engine.cli import main

    for argv, said in ((["chat", "--stage-addr", "ws://127.0.0.1:7860", "--stages", "3"], "leave out one"),
                       (["chat", "--draft", "default", "--speculate", "off"], "--speculate off")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "usage: potluck chat" in err, err


def test_a_stage_open_to_the_network_refuses_a_short_secret():
    p = subprocess.run([sys.executable, "-m", "engine", "stage", "--host", "0.0.0.0", "--port", "0", "--secret", "abc"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert p.returncode == 2 and "at least 16 characters" in p.stderr and "Stage listening on" not in p.stderr, p.stderr


def test_a_sampling_flag_that_is_no_number_is_said_in_plain_words(capsys):
    for flag, bad, said in (("--seed", "abc", "'abc' is not a whole number"),
                            ("--temperature", "warm", "'warm' is not a number")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["chat", flag, bad])
        err = capsys.readouterr().err
        assert said in err and "invalid literal" not in err and "could not convert" not in err, err


def test_penalties_set_while_chatting_change_the_next_reply():
    """`potluck chat`, typed into: the same question greedy, then with /set presence-penalty
    and frequency-penalty: the settings line names them and the reply changes."""
    import subprocess
    import sys

    typed = ("Write a haiku about the sea.\n/set presence-penalty 2\n/set frequency-penalty 1.5\n/reset\n"
             "Write a haiku about the sea.\n")
    p = subprocess.run([sys.executable, "-m", "engine", "chat", "--stages", "1", "--max-tokens", "24",
                        "--temperature", "0", "--repetition-penalty", "1"],
                       input=typed, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Sampling: greedy." in p.stderr and "presence-penalty, frequency-penalty" in p.stderr
    assert "(sampling: greedy, presence penalty 2, frequency penalty 1.5)" in p.stdout, p.stdout
    replies = [part.split("\n     [")[0] for part in p.stdout.split("bot> ")[1:]]   # up to the token count
    assert len(replies) == 2 and all(replies) and replies[0] != replies[1], p.stdout


def test_potluck_chat_as_it_starts_takes_min_p_and_retry():
    """`potluck chat` with nothing pinned (its default stages and threads): min-p is named
    in the sampling line, and /retry draws the last reply again."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "engine", "chat", "--min-p", "0.1", "--max-tokens", "16",
                        "--prompt", "What is the capital of France?", "--prompt", "/retyr", "--prompt", "/Reset now",
                        "--prompt", "/retry", "--prompt", " ",
                        "--prompt", "word " * 9000],
                       capture_output=True, text=True, timeout=600)
    assert "min-p 0.1" in p.stderr
    assert p.stdout.count("bot> ") == 2 and "no reply to draw again" not in p.stdout, p.stdout
    assert "unknown command /retyr" in p.stdout     # a typo is not sent to the model
    # nor words after a command: said, and the conversation not cleared (/retry found its reply)
    assert "(/reset takes nothing after it" in p.stdout
    assert "(an empty message: nothing sent)" in p.stdout     # and counted, as the long one is
    # a message too long for the window is said, and a script hears it in the exit status
    assert "(cannot send: the prompt has" in p.stdout and p.returncode == 1, p.stderr[-2000:]
    # stderr is no terminal here: the loading bars write a line per part, not redraws
    assert "\r" not in p.stderr and "stage 0: " in p.stderr


def test_a_reader_that_goes_away_ends_the_chat_quietly():
    """`potluck chat --prompt … | head -c 20`: the pipe closes under the reply; the chat
    ends with the shell's status for it (141), without an error of its own."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "engine", "chat", "--max-tokens", "64", "--temperature", "0",
                          "--prompt", "Write a poem about the sea."],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert p.stdout.read(20)
    p.stdout.close()
    err = p.stderr.read().decode(errors="replace")
    assert p.wait(timeout=300) == 141 and "Broken pipe" not in err, err[-2000:]


def test_potluck_serve_stopped_by_sigterm_ends_a_streaming_reply_saying_why():
    """`potluck serve` as it starts, stopped as a service manager stops it (SIGTERM)
    while a reply streams: the client reads why in its stream, and the command exits
    cleanly with its stage processes (it used to die mid-reply, the stream cut). Started
    with `--port 0`, a free port: the address it prints is the one it took (it said :0)."""
    import http.client
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", "0"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        said = []
        for line in p.stdout:
            said.append(line)
            if "OpenAI-compatible API on" in line:
                break
        assert p.poll() is None, "".join(said)
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", said[-1])[1])
        assert port != 0, said[-1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 2000, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events, signalled = [], False
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if not signalled and any(c.get("delta", {}).get("content") for c in events[-1].get("choices", [])):
                os.kill(p.pid, signal.SIGTERM)
                signalled = True
        assert signalled
        errors = [e["error"]["message"] for e in events if "error" in e]
        assert errors and "shutting down" in errors[0], events[-3:]
        assert p.wait(timeout=60) == 0
        said = p.stdout.read()            # its last words: what it did, not silence
        assert "Stopping: replies in progress are told why" in said and said.rstrip().endswith("Stopped."), said
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:   # its stage processes (the same session) went with it
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError("stage processes outlived `potluck serve`")


def test_join_takes_the_link_a_friend_sent_pasted_whole():
    """The app opens potluck://join/<code> links; pasted on the command line the link's
    scheme was read as part of the code ("'U' (character 5) is never used in codes")."""
    for arg, said in (("potluck://join/ABCD-EFGH", "this is not an invite code"),
                      ("potluck://leave/ABCD", "unknown potluck link 'leave'")):
        # the `potluck` command (app/launcher.py) and the engine's own, as a venv runs it
        for command in (["app.launcher"], ["engine"]):
            p = subprocess.run([sys.executable, "-m", *command, "join", arg], capture_output=True, text=True,
                               timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
            assert p.returncode == 2 and said in p.stderr and "never used in codes" not in p.stderr, p.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM: POSIX")
def test_a_chat_told_to_stop_closes_its_pipeline_and_leaves_no_files(tmp_path):
    """`kill` (or a logout) ended `potluck chat` outright: exit 143 with the stages'
    shared-core files left in the temporary folder. It closes the pipeline now."""
    import signal

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "engine", "chat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            if "Type a message" in line:
                break
        assert list(tmp_path.glob("potluck-cores-*")), "the default chat shares its cores through a folder"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 143
        assert list(tmp_path.glob("potluck-cores-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(sys.platform == "win32", reason="a terminal's Ctrl+C to a process group: POSIX")
def test_ctrl_c_stops_the_reply_and_the_chat_goes_on():
    """`potluck chat` as typed, its defaults (a stage process beside the head on a CPU):
    Ctrl+C while a reply streams stops that reply, and the next message is answered (it
    ended the whole chat, the conversation lost); at the prompt it leaves. The terminal sends it to every process
    of the chat, its stage's too, which leaves it to the head."""
    import signal
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "engine", "chat", "--temperature", "0", "--max-tokens", "400"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"), start_new_session=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def wait_for(pred, timeout=300):
        deadline = time.monotonic() + timeout
        while not pred("".join(out)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out)[-2000:]
            time.sleep(0.05)

    try:
        wait_for(lambda o: "Type a message" in o)
        proc.stdin.write("Tell me a long story about a dragon who learns to cook.\n")
        proc.stdin.flush()
        wait_for(lambda o: "bot> " in o and len(o.rpartition("bot> ")[2]) > 20)     # the reply is streaming
        os.killpg(proc.pid, signal.SIGINT)      # as a terminal's Ctrl+C: the whole group
        wait_for(lambda o: "stopped]" in o, timeout=60)
        proc.stdin.write("Say hello.\n")
        proc.stdin.flush()
        wait_for(lambda o: o.count("tok/s") == 2)
        # a line that is not UTF-8 (a pipe in another encoding) is answered too: it ended
        # the chat with a traceback from the tokenizer
        proc.stdin.buffer.write(b"Caf\xe9?\n")
        proc.stdin.flush()
        wait_for(lambda o: o.count("tok/s") == 3)
        # Ctrl+C at the prompt leaves at once: it waited for Enter (the line being read)
        wait_for(lambda o: o.endswith("you> "))
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(30) == 130, "".join(out)[-2000:]
        # from a pipe, what was read is written after the prompt (no terminal echoes it)
        said = "".join(out)
        assert "you> Tell me a long story about a dragon who learns to cook.\nbot> " in said
        # the stage stayed: the second reply came from the same two stages, nothing rearranged
        assert "rearranged" not in said and "is leaving" not in said, said[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_ready_line_says_a_one_layer_stage_as_one_layer():
    """`--stages 3` on a small model said "layers 30–30 of 30"."""
    from engine.cli import _describe

    class Head:
        source = type("Source", (), {"name": "SmolLM2-135M-Instruct"})

        def info(self):
            return {"stages": [{"address": "head (this process)", "layers": [0, 29]},
                               {"address": "ws://127.0.0.1:1", "layers": [29, 30]}]}

    assert _describe(Head()) == ("SmolLM2-135M-Instruct, 2 stages — head (this process): layers 1–29; "
                                 "ws://127.0.0.1:1: layer 30 of 30")


def test_a_split_that_does_not_count_the_stages_says_so():
    """It said "1 layer ranges for 2 stages"; and said it only once the stage processes
    it started had loaded (12 s), where it is known before any starts."""
    for layers, stages, said in (("0:30", "2", "--layers gives 1 layer range for 2 stages"),
                                 ("0:15,15:30", "3", "--layers gives 2 layer ranges for 3 stages")):
        p = subprocess.run([sys.executable, "-m", "engine", "chat", "--layers", layers, "--stages", stages,
                            "--prompt", "hi"], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert p.returncode == 2 and said in p.stderr, p.stderr[-2000:]


def test_threads_beyond_the_cores_and_a_cache_too_small_are_said_in_the_chats_words():
    """`--threads 999` on two cores answered at a twentieth of the speed after a silent
    minute and a half: the chat says so and uses the cores there are. And a message the
    cache cannot hold was refused in the API's words ("lower max_tokens or n")."""
    p = subprocess.run([sys.executable, "-m", "engine", "chat", "--threads", str((os.cpu_count() or 1) + 7),
                        "--kv-budget-tokens", "5", "--prompt", "hi", "--max-tokens", "2"], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert f"is more than this computer's {os.cpu_count()} core{'s' if os.cpu_count() != 1 else ''}" in p.stderr, p.stderr[-2000:]
    # the message alone is more than 5 tokens: a lower --max-tokens could not help, and a
    # --prompt has no /reset to type
    assert "(cannot send: this request needs" in p.stdout and "larger --kv-budget-tokens" in p.stdout, p.stdout
    assert "max_tokens or n" not in p.stdout and "/reset" not in p.stdout and p.returncode == 1


def test_a_mistyped_command_line_is_said_in_two_lines_with_the_commands_name(capsys):
    """`potluck chat --bogus` printed the top-level usage, `potluck chat hello` too (a
    message meant as --prompt), each error twenty lines of usage long; `potluck` alone
    said "the following arguments are required: command"."""
    for argv, said in ((["chat", "--bogus"], "potluck chat: error: unrecognized arguments: --bogus"),
                       (["chat", "hello"], 'given as --prompt "hello"'),
                       (["serve", "--port", "x"], "potluck serve: error: argument --port")):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 2, err
        assert f"`potluck {argv[0]} --help` lists them" in err
    assert main([]) == 2 and "chat" in capsys.readouterr().out      # the commands, listed


def test_a_message_the_cache_cannot_hold_names_the_flag_that_helps():
    from engine.pipeline.requests import CacheTooSmall
    from engine.pipeline.terminal import too_small_words

    # 30 tokens of conversation and room for 256 more in a cache of 100: the reply's room
    words = too_small_words(CacheTooSmall(286, 100), 256, interactive=True)
    assert "--max-tokens 70 or lower" in words and "/reset" in words and "kv-budget" not in words
    # 120 tokens of conversation in a cache of 100: only a larger cache helps
    words = too_small_words(CacheTooSmall(376, 100), 256, interactive=False)
    assert "larger --kv-budget-tokens" in words and "--max-tokens" not in words and "/reset" not in words


def test_host_checks_its_model_and_its_ports_before_it_hands_out_an_invite(tmp_path):
    """`potluck host` printed an invite for a model this machine does not have (friends
    came to a host that failed as they arrived), and found --listen and --port naming one
    port only once the model had loaded."""
    import socket

    env = dict(os.environ, HF_HUB_OFFLINE="1", POTLUCK_HOME=str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for extra, said in ((["--model", "/no-such-model-folder"], "Model folder not found"),
                        (["--listen", f"127.0.0.1:{port}", "--port", str(port)], "friends and the API need a port each")):
        p = subprocess.run([sys.executable, "-m", "engine", "host", "--peers", "0", *extra], capture_output=True,
                           text=True, timeout=300, env=env)
        assert p.returncode == 2 and said in p.stderr, p.stderr[-2000:]
        assert "Invite code" not in p.stdout and "loading" not in p.stderr.lower(), (p.stdout, p.stderr[-2000:])
    # a loopback --listen is no door for friends in other homes: said
    assert "accepts friends from this computer only" in p.stderr, p.stderr[-2000:]


def test_host_with_neither_listen_nor_relay_accepts_friends_directly(tmp_path):
    """`potluck host` alone said "give a relay address (ws://...) and/or a listen address
    (HOST:PORT)": it listens on port 7870 as the app's host does."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", POTLUCK_HOME=str(tmp_path), POTLUCK_UPNP="0", POTLUCK_STUN="")
    p = subprocess.Popen([sys.executable, "-m", "engine", "host", "--peers", "0", "--port", "0", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not any("Accepting friends" in line for line in lines):
            line = p.stderr.readline()
            assert line and "potluck:" not in line, "".join(lines) + line
            lines.append(line)
        assert "Accepting friends directly on port 7870" in lines[-1], lines
        assert p.stdout.readline().startswith("Invite code")
    finally:
        p.terminate()
        p.communicate(timeout=60)


def test_invites_on_a_computer_that_never_hosted_and_a_new_one(tmp_path, capsys):
    """`potluck invites` before any `host` wrote a host file and listed nothing; `--new`
    printed a bare code; `--reply ""` listed silently."""
    from engine.wire.invite import HostState

    folder = tmp_path / "potluck"
    assert main(["invites", "--config", str(folder)]) == 0
    assert "not hosted a pipeline yet" in capsys.readouterr().out and not (folder / HostState.FILE).exists()
    assert main(["invites", "--config", str(folder), "--reply", ""]) == 2
    assert "reply code cannot be used" in capsys.readouterr().err
    # as `potluck host` leaves it: the routes recorded
    HostState(folder).set_routes("ws://relay.example:8765", [], [])
    assert main(["invites", "--config", str(folder), "--new", "--uses", "2"]) == 0
    said = capsys.readouterr()
    code = said.out.strip()
    assert len(code) > 40 and "\n" not in code
    assert "admits 2 computers, valid until" in said.err and "--revoke" in said.err
    assert main(["invites", "--config", str(folder)]) == 0
    assert "open" in capsys.readouterr().out


def test_a_host_with_no_friends_yet_serves_and_takes_the_first_in_as_it_joins(tmp_path):
    """`potluck host --peers 0`: the API answers on this machine at once (before, `host`
    served nothing until its friends had joined), and a friend who joins takes a share of
    the layers while it serves; the same greedy answer before and after."""
    import json
    import subprocess
    import sys
    import urllib.request

    from conftest import free_port

    listen, api = free_port(), free_port()
    env = dict(os.environ, POTLUCK_KEYSTORE="file", POTLUCK_UPNP="0", POTLUCK_STUN="", HF_HUB_OFFLINE="1")
    host = subprocess.Popen([sys.executable, "-m", "engine", "host", "--peers", "0", "--listen",
                             f"127.0.0.1:{listen}", "--port", str(api), "--threads", "1"],
                            env=dict(env, POTLUCK_HOME=str(tmp_path / "host")), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    joiner = None

    def ask() -> tuple[str, int]:
        body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 12, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{api}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"]
        status = json.load(urllib.request.urlopen(f"http://127.0.0.1:{api}/v1/potluck/status", timeout=30))
        return answer, len(status["stages"])

    try:
        assert host.stdout.readline().startswith("Invite code")
        code = host.stdout.readline().strip()
        assert host.stdout.readline().startswith("OpenAI-compatible API")   # before anyone joined
        alone, stages = ask()
        assert "Paris" in alone and stages == 1
        joiner = subprocess.Popen([sys.executable, "-m", "engine", "join", code, "--threads", "1", "--no-reply"],
                                  env=dict(env, POTLUCK_HOME=str(tmp_path / "joiner")),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while ask()[1] < 2:
            assert time.monotonic() < deadline, "the friend was never taken in"
            time.sleep(1)
        assert ask() == (alone, 2)
    finally:
        for p in (joiner, host):
            if p is not None:
                p.terminate()
        for p in (joiner, host):
            if p is not None:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_ctrl_c_while_potluck_starts_stops_it_without_a_traceback():
    """Ctrl+C half a second into `potluck serve` (torch and transformers being imported)
    printed a traceback from inside an import; the stage processes of `--stages 3`,
    which share the terminal, printed theirs too."""
    import signal

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for delay in (0.2, 0.4, 0.7, 1.0, 2.0, 3.5):
        # a process group of its own, as a terminal's: Ctrl+C reaches the stages too
        p = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", "0", "--stages", "2",
                              "--threads", "1"], stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        time.sleep(delay)
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err[-3000:])
        assert p.returncode in (130, -signal.SIGINT, 0), (delay, p.returncode, err[-2000:])


def test_a_folder_that_cannot_be_used_and_a_stage_nobody_runs_are_said_in_words(tmp_path, capsys):
    """"[Errno 20] Not a directory: '…'" and "[Errno 111] Connect call failed
    ('127.0.0.1', 1)": what is wrong, where, without the socket library's numbers."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["host", "--config", str(blocker / "potluck"), "--peers", "0", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert f"potluck: cannot use {blocker}" in err and "Errno" not in err, err

    p = subprocess.run([sys.executable, "-m", "engine", "chat", "--stage-addr",
                        "ws://127.0.0.1:1#abcdefghijklmnopqrstuvwxyz0123456789", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert "nothing listens at that port" in p.stderr and "Errno" not in p.stderr, p.stderr[-2000:]
