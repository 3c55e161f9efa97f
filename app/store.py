"""Chat history in SQLite: conversations and their messages.

Every change is one transaction (SQLite's rollback journal makes it atomic: a crash
mid-write leaves the previous state). Damage is contained:
- a file that is not a readable database is moved aside (kept for the curious, named
  in `problems`) and a fresh one is started;
- a conversation whose rows cannot be read (bad bytes, bad roles) is reported as
  damaged, and every other conversation still loads.
With `keep=False` ("don't keep history") nothing touches the disk: conversations live
in an in-memory database for the session.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

ROLES = ("user", "assistant", "system")
FINISHES = ("cancelled", "length")    # how a reply ended when it did not end on its own
SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL,
    ttft REAL, tokens_per_s REAL, tokens INTEGER, error TEXT, finish TEXT);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


def _add_finish_column(db: sqlite3.Connection):
    """Histories written before replies kept how they ended gain the column (empty for
    their old replies); nothing else in them changes."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(messages)").fetchall()}
    if "finish" not in columns:
        with db:
            db.execute("ALTER TABLE messages ADD COLUMN finish TEXT")


class DamagedConversation(Exception):
    pass


class ConversationGone(Exception):
    """A message was added to a conversation that was deleted meanwhile (Settings →
    Delete all history while a chat was open)."""


@dataclass
class Message:
    role: str
    content: str
    ttft: float | None = None
    tokens_per_s: float | None = None
    tokens: int | None = None
    error: str | None = None
    id: int | None = None
    finish: str | None = None     # "cancelled" or "length" when the reply did not end on its own


@dataclass
class Conversation:
    id: int
    title: str
    updated: float
    damaged: bool = False
    messages: list[Message] = field(default_factory=list)


class History:
    def __init__(self, path: Path | None, keep: bool = True):
        self.path = path
        self.keep = keep and path is not None
        self.problems: list[str] = []     # plain-language notes for the user
        self.damaged: set[int] = set()
        self.db = self._open()

    # ---- opening ------------------------------------------------------------
    def _connect(self, target) -> sqlite3.Connection:
        db = sqlite3.connect(str(target), isolation_level=None if target == ":memory:" else "DEFERRED")
        db.execute("PRAGMA foreign_keys = ON")
        return db

    def _open(self) -> sqlite3.Connection:
        if not self.keep:
            db = self._connect(":memory:")
            db.executescript(SCHEMA)
            return db
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            db = self._connect(self.path)
            db.execute("PRAGMA synchronous = FULL")
            db.executescript(SCHEMA)
            db.execute("SELECT id, title, created, updated FROM conversations").fetchall()
            _add_finish_column(db)
            return db
        except sqlite3.DatabaseError as exc:
            try:
                db.close()
            except Exception:
                pass
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            try:
                self.path.replace(aside)
                for extra in ("-journal", "-wal", "-shm"):
                    side = self.path.with_name(self.path.name + extra)
                    if side.exists():
                        side.replace(aside.with_name(aside.name + extra))
                kept = f" It was kept as {aside.name}."
            except OSError:
                kept = ""
            self.problems.append(f"Your chat history could not be read ({exc}); a new history was started.{kept}")
            db = self._connect(self.path)
            db.executescript(SCHEMA)
            return db

    # ---- reading ------------------------------------------------------------
    def conversations(self) -> list[Conversation]:
        """Newest first; damaged ones are listed with damaged=True."""
        try:
            rows = self.db.execute("SELECT id, title, updated FROM conversations ORDER BY updated DESC, id DESC"
                                   ).fetchall()
        except sqlite3.DatabaseError:
            # a damaged index or title: read ids alone, title each row separately
            rows = []
            for (cid,) in self.db.execute("SELECT id FROM conversations").fetchall():
                try:
                    rows.append(self.db.execute("SELECT id, title, updated FROM conversations WHERE id=?",
                                                (cid,)).fetchone())
                except sqlite3.DatabaseError:
                    rows.append((cid, "(damaged conversation)", 0.0))
                    self.damaged.add(cid)
        out = []
        for cid, title, updated in rows:
            if not isinstance(title, str):
                title, updated = "(damaged conversation)", 0.0
                self.damaged.add(cid)
            out.append(Conversation(cid, title, float(updated or 0), damaged=cid in self.damaged))
        return out

    def load(self, cid: int) -> Conversation:
        try:
            row = self.db.execute("SELECT id, title, updated FROM conversations WHERE id=?", (cid,)).fetchone()
            if row is None:
                raise DamagedConversation(f"conversation {cid} does not exist")
            rows = self.db.execute(
                "SELECT id, role, content, ttft, tokens_per_s, tokens, error, finish FROM messages "
                "WHERE conversation_id=? ORDER BY id", (cid,)).fetchall()
        except sqlite3.DatabaseError as exc:
            self.damaged.add(cid)
            raise DamagedConversation(f"this conversation is damaged and cannot be shown ({exc})") from None
        msgs = []
        for mid, role, content, ttft, tps, tokens, error, finish in rows:
            if role not in ROLES or not isinstance(content, str):
                self.damaged.add(cid)
                raise DamagedConversation("this conversation is damaged and cannot be shown "
                                          f"(message {mid} is unreadable)")
            finish = finish if finish in FINISHES else None   # a damaged note is no reason to hide the reply
            msgs.append(Message(role, content, ttft, tps, tokens, error, mid, finish))
        title = row[1] if isinstance(row[1], str) else "(untitled)"
        return Conversation(cid, title, float(row[2] or 0), messages=msgs)

    def check(self) -> list[int]:
        """Try every conversation; the damaged ones' ids (also noted in `problems`)."""
        bad = []
        for c in self.conversations():
            try:
                self.load(c.id)
            except DamagedConversation:
                bad.append(c.id)
        if bad:
            self.problems.append(f"{len(bad)} conversation(s) in your history are damaged and cannot be shown; "
                                 "the others are fine.")
        return bad

    # ---- writing (each one transaction) ------------------------------------------
    def new_conversation(self, title: str) -> int:
        now = time.time()
        with self.db:
            cur = self.db.execute("INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)",
                                  (title[:200] or "New chat", now, now))
        return cur.lastrowid

    def add_message(self, cid: int, m: Message) -> int:
        now = time.time()
        with self.db:
            if self.db.execute("SELECT 1 FROM conversations WHERE id=?", (cid,)).fetchone() is None:
                raise ConversationGone(cid)
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, ttft, tokens_per_s, tokens, error, "
                "finish) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cid, m.role, m.content, now, m.ttft, m.tokens_per_s, m.tokens, m.error,
                 m.finish if m.finish in FINISHES else None))
            self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (now, cid))
        m.id = cur.lastrowid
        return cur.lastrowid

    def delete_message(self, mid: int):
        with self.db:
            self.db.execute("DELETE FROM messages WHERE id=?", (mid,))

    def delete_conversation(self, cid: int):
        with self.db:
            self.db.execute("DELETE FROM messages WHERE conversation_id=?", (cid,))
            self.db.execute("DELETE FROM conversations WHERE id=?", (cid,))
        self.damaged.discard(cid)

    def delete_all(self):
        with self.db:
            self.db.execute("DELETE FROM messages")
            self.db.execute("DELETE FROM conversations")
        self.damaged.clear()
        if self.keep:
            self.db.execute("VACUUM")  # the deleted text leaves the file too

    def set_keep(self, keep: bool):
        """Switching "don't keep history" on forgets what is on disk from now on."""
        if keep == self.keep or self.path is None:
            return
        self.db.close()
        self.keep = keep
        self.db = self._open()

    def close(self):
        self.db.close()
