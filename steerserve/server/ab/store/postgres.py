"""The experiment store for replicas on many hosts: PostgreSQL through psycopg 3 (the
``postgres`` extra). Credentials come from the URL or libpq's own sources (``PGUSER``,
``PGPASSWORD``, ``PGHOST``…, ``~/.pgpass``, a mounted ``PGPASSFILE``); they are never logged."""

from __future__ import annotations

import os
from typing import Any

from steerserve.server.ab.experiment import StoreUnavailable
from steerserve.server.ab.store.base import Store, StoreError, _Cursor

#: Seconds to open a connection (libpq's connect_timeout, unless the URL or PGCONNECT_TIMEOUT
#: says): an unreachable host fails a start, or a retry, in bounded time.
CONNECT_SECONDS = 5
#: A statement's limit (a lock held elsewhere, a stalled server): then it counts as unreachable.
STATEMENT_MS = 5000
#: The advisory lock migrations take, so that replicas starting together migrate once.
MIGRATION_LOCK = 0x5733_AB00


class PostgresStore(Store):
    scheme = "postgresql"
    serial = "BIGINT GENERATED ALWAYS AS IDENTITY"
    for_update = " FOR UPDATE"  # the row stays locked until commit: replicas take turns on it

    def __init__(self, url: str, shown: str) -> None:
        super().__init__(url, shown)
        try:
            import psycopg
        except ImportError:
            raise StoreError(
                f"{shown}: PostgreSQL needs the psycopg driver: pip install 'steerserve[postgres]'"
            ) from None
        self._psycopg = psycopg

    def _connect(self) -> Any:
        psycopg = self._psycopg
        kw: dict[str, Any] = {"application_name": "steerserve"}
        if "connect_timeout" not in self.url and "PGCONNECT_TIMEOUT" not in os.environ:
            kw["connect_timeout"] = CONNECT_SECONDS
        try:
            conn = psycopg.connect(self.url, **kw)
        except psycopg.ProgrammingError as e:  # a malformed URL or option: no retry mends it
            raise StoreError(f"{self.shown}: {self._scrub(e)}") from None
        except psycopg.Error as e:
            raise StoreUnavailable(f"{self.shown}: {self._scrub(e)}") from None
        try:
            conn.execute(f"SET statement_timeout = {STATEMENT_MS}")
            conn.execute(f"SET lock_timeout = {STATEMENT_MS}")
            conn.commit()
        except psycopg.Error as e:
            conn.close()
            raise StoreUnavailable(f"{self.shown}: {self._scrub(e)}") from None
        return conn

    def _begin(self, conn: Any) -> None:
        pass  # psycopg opens a transaction at the first statement; commit() or rollback() ends it

    def _lock_schema(self, cur: _Cursor) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s")

    def _transient(self, e: BaseException) -> bool:
        p = self._psycopg
        return isinstance(e, p.OperationalError | p.InterfaceError)

    def _is_db_error(self, e: BaseException) -> bool:
        return isinstance(e, self._psycopg.Error)

    def _has_table(self, cur: _Cursor, name: str) -> bool:
        cur.execute("SELECT to_regclass(?) IS NOT NULL", (name,))
        return bool(cur.fetchone()[0])
