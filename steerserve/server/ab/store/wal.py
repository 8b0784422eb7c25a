"""The store's files on this host: a writer's write-ahead file and the files a stopped or killed
process left, claimed by one process each and replayed."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WAL_PREFIX = "ab-wal-"
#: Records per write-ahead segment: a full segment is closed and a new one opened; a closed
#: segment is deleted once all its records have left the queue.
ROTATE = 10_000


@dataclass
class Segment:
    path: Path
    fd: int
    end: int | None = None  # the queue index after its last record, once closed
    dirty: bool = False  # written since its last fsync


@dataclass
class Claimed:
    """A file this process claimed: its records (torn or unreadable lines counted apart) and the
    replica that wrote it, when its first line says."""

    path: Path
    fd: int
    records: list[dict[str, Any]] = field(default_factory=list)
    unreadable: int = 0
    replica: str | None = None


class Wal:
    """One writer's write-ahead file (segments ``ab-wal-<store>-<ns>.jsonl`` in ``folder``)."""

    def __init__(self, folder: Path, key: str, replica: str) -> None:
        self.folder, self.key, self.replica = folder, key, replica
        self.failures = 0
        self._segments: list[Segment] = []
        self._count = 0  # records in the current segment
        folder.mkdir(parents=True, exist_ok=True)
        self._open()

    def _open(self) -> None:
        path = self.folder / f"{WAL_PREFIX}{self.key}-{time.time_ns()}-{os.getpid()}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours while this process lives
        header = {"type": "wal", "replica": self.replica, "ts": time.time()}
        os.write(fd, (json.dumps(header) + "\n").encode())
        self._segments.append(Segment(path, fd))
        self._count = 0

    def append(self, rec: dict[str, Any], index: int) -> bool:
        """Append ``rec`` (queue index ``index``) in one write(2); False when the disk refused
        it (the record stays queued, only a crash would lose it: counted and logged once)."""
        line = (json.dumps(rec, ensure_ascii=True, separators=(",", ":")) + "\n").encode()
        try:
            if self._count >= ROTATE:
                self._segments[-1].end = index - 1
                self._open()
            seg = self._segments[-1]
            os.write(seg.fd, line)
            seg.dirty = True
            self._count += 1
            return True
        except OSError as e:
            self.failures += 1
            if self.failures == 1:
                logger.error(
                    "experiment store: the write-ahead file %s failed (%s)", self.folder, e
                )
            return False

    def sync(self) -> None:
        """fsync what was appended since the last one (the writer calls it every second; a
        feedback's answer waits for it)."""
        for seg in self._segments:
            if seg.dirty:
                try:
                    os.fsync(seg.fd)
                    seg.dirty = False
                except OSError as e:
                    logger.error("experiment store: fsync of %s failed: %s", seg.path, e)

    def release(self, done: int) -> None:
        """Delete the closed segments whose records have all left the queue."""
        while (
            len(self._segments) > 1 and (end := self._segments[0].end) is not None and end <= done
        ):
            _drop(self._segments.pop(0))

    def close(self, delete: bool) -> None:
        """Close every segment; ``delete``: their records are in the store or a spill file."""
        for seg in self._segments:
            if delete:
                _drop(seg)
            else:
                os.close(seg.fd)
        self._segments = []


def _drop(seg: Segment) -> None:
    seg.path.unlink(missing_ok=True)
    os.close(seg.fd)


def claim(folder: Path | None, prefixes: tuple[str, ...]) -> Iterator[Claimed]:
    """The files in ``folder`` whose names start with one of ``prefixes`` that nobody holds:
    each locked (kept locked until :func:`done`), read whole."""
    if folder is None or not folder.is_dir():
        return
    for path in sorted(p for p in folder.iterdir() if p.name.startswith(prefixes)):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue  # gone meanwhile: another process replayed it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_nlink == 0:  # replayed and deleted after we opened it
                raise BlockingIOError
        except OSError:
            os.close(fd)
            continue
        got = Claimed(path, fd)
        with os.fdopen(os.dup(fd), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    got.unreadable += 1  # a line torn by a crash of the machine
                    continue
                if isinstance(rec, dict) and rec.get("type") in ("wal", "spill"):
                    got.replica = str(rec.get("replica") or "") or None
                elif isinstance(rec, dict) and "id" in rec:
                    got.records.append(rec)
                else:
                    got.unreadable += 1
        yield got


def done(c: Claimed) -> None:
    """A claimed file's records are all in the store (or kept elsewhere): delete it."""
    c.path.unlink(missing_ok=True)
    os.close(c.fd)
