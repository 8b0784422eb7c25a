"""The embedded experiment store: one SQLite file in WAL mode, shared by several server processes
on one host (readers never wait for the writer; writers take turns, each a short transaction)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from steerserve.server.ab.experiment import StoreUnavailable
from steerserve.server.ab.store.base import Store, StoreError, _Cursor

#: How long a statement waits for another process's write lock before the store counts as busy
#: (the writer then retries; a feedback request answers from its queue or 503).
BUSY_SECONDS = 2.0


class SQLiteStore(Store):
    scheme = "sqlite"
    serial = "INTEGER"  # an INTEGER PRIMARY KEY is the rowid: increasing, never reused here
    for_update = ""  # BEGIN IMMEDIATE holds the database's write lock for the transaction

    def __init__(self, url: str, path: Path, busy_seconds: float = BUSY_SECONDS) -> None:
        super().__init__(url, url)  # no secrets in a file URL
        self.path = path
        self.busy_seconds = busy_seconds

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                self.path,
                timeout=self.busy_seconds,
                isolation_level=None,  # transactions are ours: BEGIN IMMEDIATE ... COMMIT
                check_same_thread=False,  # pooled: one thread at a time uses a connection
            )
            conn.execute("PRAGMA journal_mode=WAL")  # persistent, set once per file
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable across a process crash
            conn.execute("PRAGMA foreign_keys=ON")
            return conn
        except sqlite3.OperationalError as e:
            if "locked" in str(e) or "busy" in str(e):
                raise StoreUnavailable(f"{self.shown}: {e}") from None
            raise StoreError(f"{self.shown}: cannot open {str(self.path)!r}: {e}") from None
        except OSError as e:
            raise StoreError(
                f"{self.shown}: cannot create {str(self.path.parent)!r}: {e}"
            ) from None

    def _begin(self, conn: Any) -> None:
        # IMMEDIATE: the write lock up front, so two writers queue on busy_timeout instead of
        # both reading and then failing to upgrade (SQLITE_BUSY without waiting)
        conn.execute("BEGIN IMMEDIATE")

    def _transient(self, e: BaseException) -> bool:
        return isinstance(e, sqlite3.OperationalError)

    def _is_db_error(self, e: BaseException) -> bool:
        return isinstance(e, sqlite3.Error)

    def _has_table(self, cur: _Cursor, name: str) -> bool:
        cur.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,))
        return cur.fetchone() is not None
