"""What a person reads when a model cannot be had: the cause they can act on, not
"could not find model" for every failure."""

from __future__ import annotations

import pytest

from engine.model.sources import ModelError, hub_failure, resolve


def _exc(name: str, *bases):
    return type(name, bases or (Exception,), {})("details")


def test_each_hub_failure_says_its_own_cause():
    said = hub_failure("meta-llama/Llama-3.1-8B", _exc("GatedRepoError", _exc("RepositoryNotFoundError").__class__),
                       offline=False)
    assert "is gated" in said and "HF_TOKEN" in said
    assert "no model 'a/b' on the Hugging Face hub" in hub_failure("a/b", _exc("RepositoryNotFoundError"), False)
    assert "could not be reached" in hub_failure("a/b", _exc("LocalEntryNotFoundError"), False)
    assert "could not be reached" in hub_failure("a/b", _exc("ConnectError"), False)
    assert "downloading is off" in hub_failure("a/b", _exc("RepositoryNotFoundError"), True)
    assert hub_failure("a/b", RuntimeError("disk full\nmore"), False).endswith("disk full")


def test_a_hub_id_offline_and_a_file_that_is_no_model_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="downloading is off"):
        resolve("no-such-user/no-such-model-xyz")
    note = tmp_path / "notes.txt"
    note.write_text("hello")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="is a file, not a model"):
        resolve("./notes.txt")
    with pytest.raises(ModelError, match="Model folder not found"):
        resolve("./nothing-here")
    # an absolute path of one part is a folder, not a hub id ("owner/name")
    with pytest.raises(ModelError, match="Model folder not found"):
        resolve("/nothing-here-xyz")
    with pytest.raises(ModelError, match="is a file, not a model"):
        resolve(str(note))
    # a file named without a path ("rand.bin") was looked up on the hub: "not on this computer"
    with pytest.raises(ModelError, match="is a file, not a model"):
        resolve("notes.txt")


def test_a_half_made_model_folder_is_one_line_not_a_traceback(tmp_path):
    """A folder with only a config.json, or a config.json of {}: transformers' tracebacks
    (35-55 lines) reached the terminal; each is one line naming the folder now."""
    import json

    empty = tmp_path / "empty-config"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="config.json cannot be read as a model's"):
        resolve(str(empty)).config()
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                                  "num_hidden_layers": 2, "num_attention_heads": 4}))
    source = resolve(str(bare))
    assert source.config().num_hidden_layers == 2
    with pytest.raises(ModelError, match="has no tokenizer Potluck can read"):
        source.tokenizer()


def test_the_default_model_is_found_however_it_is_capitalised():
    """`--model DEFAULT` was looked up on the hub ("not on this computer")."""
    for spec in ("default", "DEFAULT", "Default", "smollm2-135m-instruct"):
        source = resolve(spec)
        assert source.gguf_path is not None and source.name, spec
