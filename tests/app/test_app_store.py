"""The app's files: chat history (SQLite), settings (JSON), secrets (keyring or 0600 file)."""

from __future__ import annotations

import sqlite3
import stat

import pytest

from app.settings import Settings
from app.store import DamagedConversation, History, Message


def fill(h: History) -> list[int]:
    ids = []
    for i in range(3):
        cid = h.new_conversation(f"chat {i}")
        h.add_message(cid, Message("user", f"question {i}"))
        h.add_message(cid, Message("assistant", f"**answer** {i}", ttft=0.2, tokens_per_s=12.5, tokens=7))
        ids.append(cid)
    return ids


def test_round_trip(tmp_path):
    path = tmp_path / "h.sqlite3"
    h = History(path)
    ids = fill(h)
    h.close()
    h = History(path)
    assert [c.title for c in h.conversations()] == ["chat 2", "chat 1", "chat 0"]
    conv = h.load(ids[1])
    assert [(m.role, m.content) for m in conv.messages] == [("user", "question 1"), ("assistant", "**answer** 1")]
    assert conv.messages[1].ttft == 0.2 and conv.messages[1].tokens == 7
    assert h.problems == [] and h.check() == []


def test_how_a_reply_ended_is_kept_and_an_older_history_gains_it(tmp_path):
    path = tmp_path / "h.sqlite3"
    # a history written before replies kept how they ended (the schema of 2026-12-05)
    old = sqlite3.connect(str(path))
    old.executescript(
        "CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, "
        "updated REAL NOT NULL);"
        "CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL REFERENCES "
        "conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL, "
        "ttft REAL, tokens_per_s REAL, tokens INTEGER, error TEXT);"
        "INSERT INTO conversations VALUES (1, 'old chat', 0, 0);"
        "INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'old question', 0);")
    old.commit()
    old.close()
    h = History(path)
    assert h.problems == []
    assert [(m.content, m.finish) for m in h.load(1).messages] == [("old question", None)]
    h.add_message(1, Message("assistant", "a long story, cut", tokens=400, finish="length"))
    cid = h.new_conversation("new chat")
    h.add_message(cid, Message("assistant", "stopped half", finish="cancelled"))
    h.add_message(cid, Message("assistant", "ended", finish="stop"))   # ended on its own: nothing to say
    h.close()
    h = History(path)
    assert [m.finish for m in h.load(1).messages] == [None, "length"]
    assert [m.finish for m in h.load(cid).messages] == ["cancelled", None]


def test_a_failed_write_leaves_the_previous_state(tmp_path):
    h = History(tmp_path / "h.sqlite3")
    cid = h.new_conversation("chat")
    h.add_message(cid, Message("user", "kept"))
    with pytest.raises(sqlite3.IntegrityError):
        h.add_message(cid, Message("user", None))  # NOT NULL: the transaction rolls back
    assert [m.content for m in h.load(cid).messages] == ["kept"]


def test_damaged_conversation_is_reported_and_others_survive(tmp_path):
    path = tmp_path / "h.sqlite3"
    h = History(path)
    ids = fill(h)
    h.close()
    db = sqlite3.connect(path)  # bytes that are not UTF-8 where text belongs, as a bad disk leaves them
    db.execute("UPDATE messages SET content = CAST(X'C328FFFE' AS TEXT) WHERE conversation_id=? AND role='user'",
               (ids[1],))
    db.commit()
    db.close()
    h = History(path)
    assert h.check() == [ids[1]]
    assert any("damaged" in p for p in h.problems)
    with pytest.raises(DamagedConversation):
        h.load(ids[1])
    assert [c.damaged for c in h.conversations()] == [False, True, False]
    assert h.load(ids[0]).messages[0].content == "question 0"
    assert h.load(ids[2]).messages[0].content == "question 2"
    h.delete_conversation(ids[1])  # the user can remove it and carry on
    cid = h.new_conversation("new")
    h.add_message(cid, Message("user", "still works"))
    assert h.check() == []


def test_unreadable_file_is_moved_aside_and_a_new_history_starts(tmp_path):
    path = tmp_path / "h.sqlite3"
    h = History(path)
    fill(h)
    h.close()
    path.write_bytes(b"this is not a database at all" * 100)
    h = History(path)
    assert h.conversations() == []
    assert len(h.problems) == 1 and "could not be read" in h.problems[0]
    kept = list(tmp_path.glob("h.sqlite3.damaged-*"))
    assert kept and kept[0].read_bytes().startswith(b"this is not")
    cid = h.new_conversation("fresh")
    h.add_message(cid, Message("user", "hello"))
    assert History(path).load(cid).messages[0].content == "hello"


def test_dont_keep_history(tmp_path):
    path = tmp_path / "h.sqlite3"
    h = History(path, keep=False)
    cid = h.new_conversation("secret")
    h.add_message(cid, Message("user", "nobody should see this"))
    assert h.load(cid).messages[0].content == "nobody should see this"
    h.close()
    assert not path.exists()


def test_delete_all_removes_the_text_from_the_file(tmp_path):
    path = tmp_path / "h.sqlite3"
    h = History(path)
    cid = h.new_conversation("chat")
    h.add_message(cid, Message("user", "ZEBRA-SECRET-" * 50))
    h.delete_all()
    assert h.conversations() == []
    h.close()
    assert b"ZEBRA-SECRET" not in path.read_bytes()


def test_settings_round_trip_and_bad_files(tmp_path):
    s = Settings(keep_history=False, max_tokens=99)
    s.limits["vram_cap_mb"] = 4096.0
    s.save(tmp_path)
    t = Settings.load(tmp_path)
    assert t.keep_history is False and t.max_tokens == 99 and t.limits["vram_cap_mb"] == 4096.0
    (tmp_path / "settings.json").write_text('{"keep_history": "maybe", "max_tokens": 5, "bogus": 1')
    assert Settings.load(tmp_path) == Settings()  # truncated file: defaults, no crash
    (tmp_path / "settings.json").write_text('{"keep_history": "maybe", "max_tokens": 5, "bogus": 1}')
    t = Settings.load(tmp_path)
    assert t.keep_history is True and t.max_tokens == 5
    # the chat's presence/frequency penalties: saved; out of OpenAI's -2..2 or not a number: 0
    Settings(presence_penalty=1.5, frequency_penalty=-0.5).save(tmp_path)
    t = Settings.load(tmp_path)
    assert (t.presence_penalty, t.frequency_penalty) == (1.5, -0.5)
    (tmp_path / "settings.json").write_text('{"presence_penalty": 7, "frequency_penalty": true}')
    t = Settings.load(tmp_path)
    assert (t.presence_penalty, t.frequency_penalty) == (0.0, 0.0)
    (tmp_path / "settings.json").write_text('{"presence_penalty": 1, "frequency_penalty": NaN}')
    t = Settings.load(tmp_path)
    assert (t.presence_penalty, t.frequency_penalty) == (1.0, 0.0) and isinstance(t.presence_penalty, float)
    assert not list(tmp_path.glob(".settings-*"))  # no temp files left behind


def test_secrets_file_fallback_is_private(tmp_path, monkeypatch):
    from app import secrets_store

    monkeypatch.setenv("POTLUCK_KEYSTORE", "file")
    assert secrets_store.set_secret("hf_token", "hf_abc", tmp_path) == "file"
    f = tmp_path / "secrets.json"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert secrets_store.get_secret("hf_token", tmp_path) == "hf_abc"
    secrets_store.set_secret("hf_token", None, tmp_path)
    assert secrets_store.get_secret("hf_token", tmp_path) is None
