"""The A/B experiment store (``--ab-store URL``): every replica writes decisions and feedback to it
and every report reads it, so feedback joins anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from steerserve.server.ab.experiment import StoreUnavailable
from steerserve.server.ab.store.base import Store, StoreError

if TYPE_CHECKING:
    from steerserve.server.ab.store.writer import Writer
    from steerserve.server.metrics import Metrics

__all__ = ["Store", "StoreError", "StoreUnavailable", "is_store_url", "open_store", "open_writer"]

SCHEMES = ("sqlite", "postgresql", "postgres")
FORMS = "sqlite:///PATH (sqlite:////an/absolute/path) or postgresql://USER@HOST:PORT/DB"


def is_store_url(text: str | Path) -> bool:
    """Whether ``text`` names a store (a URL) rather than a JSONL log file."""
    return isinstance(text, str) and "://" in text


def shown(url: str) -> str:
    """``url`` as it may be logged or shown: any password masked."""
    parts = urlsplit(url)
    if parts.password is None and "password" not in parts.query:
        return url  # nothing to mask (and a sqlite:////path keeps its slashes)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = urlencode(
        [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query)], safe="*/:"
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def open_store(url: str, migrate: bool = True) -> Store:
    """The store ``url`` names, reachable and (``migrate``) with this steerserve's schema, or
    ValueError saying why in one line (a bad scheme, an unreachable host, a newer schema)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    safe = shown(url) if scheme in SCHEMES else repr(url)
    if scheme not in SCHEMES:
        raise ValueError(f"{safe} is not a store URL this server knows: use {FORMS}")
    try:
        store = _backend(url, scheme)
    except StoreError as e:
        raise ValueError(str(e)) from None
    path = getattr(store, "path", None)
    if not migrate and path is not None and not path.is_file():  # a reader never creates one
        raise ValueError(f"{safe}: no such file: {str(path)!r} (no experiment store there)")
    try:
        if migrate:
            _migrate(store, scheme)
        elif store.version() == 0:
            raise StoreError(f"{store.shown}: no experiment store there (no steerserve schema)")
    except (StoreError, StoreUnavailable) as e:
        store.close()
        raise ValueError(f"cannot use the experiment store {e}") from None
    return store


#: Seconds a start waits for a SQLite file another process holds locked (replicas starting
#: together, one migrating): a bound for a busy machine; the lock's release ends the wait.
LOCKED_WAIT = 120.0


def _migrate(store: Store, scheme: str) -> None:
    """``store.migrate()``; a SQLite file locked by another process is waited for, since the
    lock frees itself (an unreachable PostgreSQL server does not: it fails the start at once)."""
    import time

    deadline = time.monotonic() + LOCKED_WAIT
    while True:
        try:
            store.migrate()
            return
        except StoreUnavailable:
            if scheme != "sqlite" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _backend(url: str, scheme: str) -> Store:
    if scheme == "sqlite":
        from steerserve.server.ab.store.sqlite import SQLiteStore

        rest = url.split("://", 1)[1]
        if not rest.startswith("/") or rest in ("/", "/:memory:"):
            raise StoreError(f"{url!r}: a SQLite store is a file: {FORMS}")
        return SQLiteStore(url, Path(rest[1:]))
    from steerserve.server.ab.store.postgres import PostgresStore

    return PostgresStore(url, shown(url))


def default_spill(store: Store) -> Path:
    """Where queued records are kept at shutdown when no folder is given: beside a SQLite file,
    else this user's state folder (``$XDG_STATE_HOME`` or ``~/.local/state``)."""
    import os

    path = getattr(store, "path", None)
    if path is not None:
        return Path(f"{path}-spill")
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "steerserve" / "ab-spill"


def open_writer(url: str, spill: str | None, metrics: Metrics | None = None) -> Writer:
    """The server's store: opened and migrated, its writer thread started (its spill files
    from the last stop queued first). ValueError naming ``--ab-store`` when it cannot be used."""
    from steerserve.server.ab.store.writer import Writer

    try:
        store = open_store(url)
    except ValueError as e:
        raise ValueError(f"--ab-store: {e}") from None
    return Writer(store, Path(spill) if spill else default_spill(store), metrics)
