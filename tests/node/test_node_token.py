"""Where a node started by hand (`potluck node`) writes its token."""

from __future__ import annotations

import warnings

from engine.node.control_basics import default_token_file


def test_potluck_home_holds_the_token_and_a_bare_shell_warns_of_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    assert default_token_file() == tmp_path / "run" / "node-token"    # beside the app's own (app/paths.py)
    monkeypatch.delenv("POTLUCK_HOME")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # platformdirs' RuntimeDirWarning reached the terminal
        assert default_token_file().name == "node-token"
