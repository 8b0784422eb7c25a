"""A throwaway PostgreSQL server for the experiment-store tests: Debian's ``postgresql`` package
(``make postgres`` installs it) initialised in a temporary folder and started on a free loopback
port with password authentication; as an unprivileged user when the tests run as root (the
server refuses to run as root). Where no server binaries are found, a skip that says what to
install."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _server import free_port

USER, PASSWORD = "steer", "s3cret-pw"


def bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: ``STEERSERVE_PG_BIN``, Debian's newest version
    under /usr/lib/postgresql, or PATH."""
    if env := os.environ.get("STEERSERVE_PG_BIN"):
        return Path(env)
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=_version)
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _version(p: Path) -> int:
    try:
        return int(p.parent.parent.name)
    except ValueError:
        return 0


class Postgres:
    """One PostgreSQL cluster in a temporary folder; :meth:`stop` and :meth:`start` are a real
    outage and recovery (the tests' "database stopped mid-load")."""

    def __init__(self, bins: Path) -> None:
        self.bins = bins
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="steerserve-pg-"))
        self.data = self.root / "data"
        self.owner = _owner()
        pwfile = self.root / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self.owner is not None:
            shutil.chown(self.root, self.owner)
            shutil.chown(pwfile, self.owner)
        self._run(
            "initdb", "-D", str(self.data), "-U", USER, "--auth=scram-sha-256",
            f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync", "--no-instructions",
        )  # fmt: skip

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bins / tool), *args]
        if self.owner is not None:
            cmd = ["runuser", "-u", self.owner, "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
        if r.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(cmd)}: {r.stdout}{r.stderr}{tail}")

    def start(self) -> None:
        """Start and wait until it accepts connections (pg_ctl -w)."""
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c fsync=off "
            "-c max_connections=60"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"),
                  "-o", opts, "-w", "-t", "120", "start")  # fmt: skip

    def stop(self) -> None:
        """A fast shutdown: every connection is cut, as when the server goes away."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "120", "stop")

    def url(self, db: str = "postgres", password: bool = True) -> str:
        auth = f"{USER}:{PASSWORD}" if password else USER
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{db}"

    def database(self, name: str) -> str:
        """A new empty database's URL (each test its own)."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop()
        except RuntimeError:
            pass  # stopped already
        shutil.rmtree(self.root, ignore_errors=True)


def _owner() -> str | None:
    """The user the server runs as when we are root: Debian's ``postgres``, else ``nobody``."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    pytest.skip("PostgreSQL tests: running as root with no unprivileged user to run the server")


def postgres_server() -> Iterator[Postgres]:
    """A started cluster, or a skip naming what is missing (for a fixture to yield from)."""
    bins = bindir()
    if bins is None or not (bins / "pg_ctl").exists():
        pytest.skip(
            "PostgreSQL tests: no server binaries (initdb, pg_ctl); install them with "
            "`make postgres` (apt-get install postgresql) or set STEERSERVE_PG_BIN"
        )
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("PostgreSQL tests: the psycopg driver is missing (pip install -e '.[dev]')")
    pg = Postgres(bins)
    try:
        pg.start()
        yield pg
    finally:
        pg.close()
