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
