"""potluck:// invite links: parsing (what a chat app may hand the OS) and the app
opening its join dialog filled in. The single-instance hand-over of a link to a running
app is in test_app_gui.py::test_single_instance; the installers' registration of the
scheme in tests/installer/."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.links import JoinLink, LinkError, parse_link
from engine.wire import invite

ROOT = Path(__file__).resolve().parents[2]


def real_code() -> str:
    inv = invite.Invite(pipeline=os.urandom(8), invite_id=os.urandom(8), secret=os.urandom(16),
                        host_key=os.urandom(32), expires=int(time.time()) + 3600, max_uses=3,
                        relay="wss://relay.example:8443", direct=["ws://192.0.2.7:7070"])
    return invite.encode(inv)


def test_a_real_invite_survives_the_link():
    code = real_code()
    link = parse_link(f"potluck://join/{code}")
    assert link == JoinLink(code=code)
    assert invite.parse(link.code).relay == "wss://relay.example:8443"
    # percent-encoded by a chat app, a trailing slash, the scheme in capitals
    assert parse_link(f"POTLUCK://join/{code.replace('-', '%2D')}/").code == code
    assert parse_link(f"potluck:join/{code}").code == code


async def test_join_on_the_command_line_redeems_the_link_as_its_code():
    """`potluck join potluck://join/<code>`: the link the host's app shares, pasted whole
    into the engine's own `join` (engine/node/homes.py redeem), is its invite."""
    from app.links import join_link
    from engine.node.homes import HomeError, redeem

    code = real_code()
    assert await redeem(join_link(code)) == invite.parse(code)
    with pytest.raises(HomeError, match="unknown potluck link 'leave'"):
        await redeem(f"potluck://leave/{code}")


def test_a_short_code_carries_its_relay():
    link = parse_link("potluck://join/4821-917305?relay=wss%3A%2F%2Frelay.example%3A8443")
    assert link == JoinLink(code="4821-917305", relay="wss://relay.example:8443")


@pytest.mark.parametrize("text, why", [
    ("https://join/ABC", "not a potluck"),
    ("potluck://host/ABC", "unknown potluck link"),
    ("potluck://join/", "no invite code"),
    ("potluck://join/AB<script>", "characters"),
    ("potluck://join/ABC?relay=file:///etc/passwd", "ws://"),
    ("potluck://join/" + "A" * 5000, "too long"),
])
def test_bad_links_say_why(text, why):
    with pytest.raises(LinkError, match=why):
        parse_link(text)


def test_the_link_fills_the_join_dialog(qtbot, tmp_path, monkeypatch):
    pytest.importorskip("PySide6.QtWidgets", reason="Qt's system libraries are missing: run `make qt-libs`")
    monkeypatch.setenv("POTLUCK_HOME", str(tmp_path))
    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    from app.controller import Controller
    from app.join_dialog import looks_like_code
    from app.settings import Settings
    from app.store import History
    from app.tray import Shell

    c = Controller(Settings(host_on_start=False), history=History(None, keep=False))
    joined = []
    c.join = lambda **kw: joined.append(kw)
    shell = Shell(c, use_tray=False)
    try:
        code = real_code()
        d = shell.open_link(f"potluck://join/{code}")
        assert d.isVisible() and d.code.text() == code and looks_like_code(d.code.text())
        assert "Filled in" in d.result.text()
        assert joined == []          # a click on a link never joins by itself: the user presses Join
        d.join()
        assert joined and joined[0]["code"] == code
        bad = shell.open_link("potluck://join/AB<script>")
        assert bad is d and "not a Potluck invite" in d.result.text()
        # a link whose code is no invite code, and text that is none: said, and nothing is
        # joined or shared (a name typed by mistake used to share this computer under it)
        joined.clear()
        for text in ("potluck://join/hello", "hello world", "https://example.com/join/ABC"):
            if text.startswith("potluck:"):
                shell.open_link(text)
                assert not d.code.text()
            else:
                d.code.setText(text)
                d.join()
            assert joined == [] and "doesn't look like an invite code" in d.result.text(), text
        # sharing by a pipeline name is asked for under Advanced, and checked
        d.code.clear()
        d.pipeline.setText("friends pipeline")
        d.join()
        assert joined == [] and "letters, digits" in d.result.text()
        d.pipeline.setText("friends-pipeline")
        d.join()
        assert joined == [{"pipeline": "friends-pipeline", "port": d.port.value(), "cb": d._done}]
        d.pipeline.clear()
        # joined: the button is spent; a link opened then starts the window over
        d._done({"sharing": {"joined": {"via": "direct"}}}, None)
        assert "Joined" in d.result.text() and not d.accept_button.isEnabled()
        again = shell.open_link(f"potluck://join/{code}")
        assert again is d and d.accept_button.isEnabled() and "Filled in" in d.result.text()
        # and "Join with invite code…" from the menu, the window still open on "Joined.": ready
        # for another code (its button stayed greyed out, only Close worked)
        d._done({"sharing": {"joined": {"via": "direct"}}}, None)
        menu = shell.open_join()
        assert menu is d and d.accept_button.isEnabled() and not d.code.text() and "Joined" not in d.result.text()
    finally:
        # not shell.quit(): it ends the QApplication, which the later GUI tests still need
        shell.close()
        shell.close()                                            # twice is harmless
        assert shell.open_link(f"potluck://join/{real_code()}") is None   # nothing opens on a closed shell
        qtbot.wait(10)   # the deleteLater()s run
        c.shutdown()


def test_the_app_refuses_a_non_link_argument():
    r = subprocess.run([sys.executable, "-m", "app.launcher", "app", "https://example.com/x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))
    assert r.returncode == 2 and "not a potluck:// link" in r.stderr


def test_screenshot_renders_the_tray_menu(tmp_path):
    png = tmp_path / "menu.png"
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    r = subprocess.run([sys.executable, "-m", "app.launcher", "app", "--screenshot", str(png)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(env, POTLUCK_HOME=str(tmp_path), POTLUCK_KEYSTORE="file"))
    assert r.returncode == 0, r.stderr
    from PySide6.QtGui import QImage

    img = QImage(str(png))
    assert img.width() > 100 and img.height() > 100


def test_a_hop_between_two_friends_says_how_it_goes():
    from app.pipeline_text import hop_label

    assert hop_label({"hop": "Ana → Ben", "path": "direct (punched)", "rtt_ms": 31.2}) == \
        "Ana → Ben: direct (punched), 31 ms"
    assert hop_label({"hop": "Ana → Ben", "path": "direct (lan)", "rtt_ms": 2.4, "live": False}) == \
        "Ana → Ben: direct (lan), 2 ms when set up"
    assert hop_label({"hop": "Ana → Ben", "path": "via the host", "rtt_ms": None}) == \
        "Ana → Ben: through this computer"


def test_an_invite_link_reads_back_and_draws_as_a_qr_code():
    from app.links import join_link, parse_link, qr_png

    assert parse_link(join_link("0411V-648F8")).code == "0411V-648F8"
    back = parse_link(join_link("4821-917305", relay="wss://relay.example:8765"))
    assert (back.code, back.relay) == ("4821-917305", "wss://relay.example:8765")
    png = qr_png(join_link("A" * 300))
    assert png.startswith(b"\x89PNG") and len(png) > 500
