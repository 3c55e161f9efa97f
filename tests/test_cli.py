"""The command line parses, and says what it wants when it cannot (engine/cli.py)."""

import argparse

import pytest

from engine.cli import add_pipeline_args, build_parser, pipeline_config, prompt_chunk_arg


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
