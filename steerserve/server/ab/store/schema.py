"""What the experiment store holds: its tables, their versions (the migrations, applied in
order by ``Store.migrate``) and a decision as a row and back, in the shape of the JSONL log's
line, so a report reads the store and the log alike."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

DECISIONS = "steerserve_ab_decisions"
FEEDBACK = "steerserve_ab_feedback"
REPLICAS = "steerserve_ab_replicas"
EXPERIMENTS = "steerserve_ab_experiments"
PHASES = "steerserve_ab_phases"
VERSIONS = "steerserve_schema"
COMPONENT = "ab_store"
#: A decision's fields kept as columns (``vectors``, ``prompt`` and ``reply`` as JSON text); any
#: other field (a later server's) goes to ``extra`` as JSON, so nothing a decision says is lost.
COLUMNS = (
    "ts",
    "experiment",
    "arm",
    "subject_hash",
    "endpoint",
    "model",
    "language",
    "applied",
    "preset",
    "vectors",
    "latency_ms",
    "prompt_tokens",
    "completion_tokens",
    "prompt",
    "reply",
    "phase",
)
JSON_COLUMNS = ("vectors", "prompt", "reply")
NUMBERS = {
    "ts": float,
    "latency_ms": float,
    "prompt_tokens": int,
    "completion_tokens": int,
    "phase": int,
}
#: The schema version that added each column (a reader of an older store reads NULL for it).
SINCE = {"phase": 3}

#: The schema, one list of statements per version, applied in order by :meth:`Store.migrate`
#: (``{serial}``: the backend's auto-increment key). Never edit a released version: add one.
MIGRATIONS: list[list[str]] = [
    [
        f"""CREATE TABLE {DECISIONS} (
            id TEXT PRIMARY KEY,
            ts DOUBLE PRECISION NOT NULL,
            experiment TEXT, arm TEXT, subject_hash TEXT, endpoint TEXT, model TEXT,
            language TEXT, applied BOOLEAN, preset TEXT, vectors TEXT,
            latency_ms DOUBLE PRECISION, prompt_tokens BIGINT, completion_tokens BIGINT,
            prompt TEXT, reply TEXT, extra TEXT, replica TEXT,
            feedback_count INTEGER NOT NULL DEFAULT 0)""",
        f"CREATE INDEX {DECISIONS}_ts ON {DECISIONS} (ts)",
        f"""CREATE TABLE {FEEDBACK} (
            seq {{serial}} PRIMARY KEY,
            fid TEXT NOT NULL UNIQUE,
            id TEXT NOT NULL REFERENCES {DECISIONS} (id),
            ts DOUBLE PRECISION NOT NULL,
            score DOUBLE PRECISION NOT NULL,
            replica TEXT)""",
        f"CREATE INDEX {FEEDBACK}_id ON {FEEDBACK} (id, seq)",
        f"""CREATE TABLE {REPLICAS} (
            replica TEXT PRIMARY KEY,
            started DOUBLE PRECISION, seen DOUBLE PRECISION,
            written BIGINT NOT NULL DEFAULT 0, queued BIGINT NOT NULL DEFAULT 0,
            dropped BIGINT NOT NULL DEFAULT 0)""",
    ],
    # 2: feedback names its metric (NULL: the human score, ``feedback``, as before)
    [f"ALTER TABLE {FEEDBACK} ADD COLUMN metric TEXT"],
    # 3: experiments as records (arms, status, phases), each decision's phase, and what a
    # replica says of itself beyond its counts (running, stopped, recovered by another)
    [
        f"ALTER TABLE {DECISIONS} ADD COLUMN phase INTEGER",
        f"ALTER TABLE {REPLICAS} ADD COLUMN status TEXT",
        f"""CREATE TABLE {EXPERIMENTS} (
            name TEXT PRIMARY KEY,
            arms TEXT NOT NULL, control TEXT NOT NULL, status TEXT NOT NULL, note TEXT,
            flags TEXT, phase INTEGER NOT NULL,
            created DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL)""",
        f"""CREATE TABLE {PHASES} (
            experiment TEXT NOT NULL REFERENCES {EXPERIMENTS} (name),
            phase INTEGER NOT NULL,
            arms TEXT NOT NULL, control TEXT NOT NULL, allocation TEXT NOT NULL,
            started DOUBLE PRECISION NOT NULL, ended DOUBLE PRECISION, why TEXT, by_replica TEXT,
            PRIMARY KEY (experiment, phase))""",
    ],
]


def known(row: Any) -> dict[str, Any]:
    """A (experiment, arm, language) row as feedback's answer has it."""
    return {"experiment": row[0], "arm": row[1], "language": row[2]}


def text(v: Any) -> str:
    """A string any database takes: lone surrogates and NUL as escapes (as the JSONL log)."""
    return v.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\u0000")


def to_json(v: Any) -> str:
    return json.dumps(v, ensure_ascii=True, separators=(",", ":"))


def from_json(v: str | None) -> Any:
    return None if v is None else json.loads(v)


def column(name: str, v: Any) -> Any:
    """A decision field as its column's value (a wrong type: NULL, the report skips it)."""
    if v is None:
        return None
    if name in JSON_COLUMNS:
        return to_json(v)
    if name == "applied":
        return v if isinstance(v, bool) else None
    if name in NUMBERS:
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        return NUMBERS[name](v) if ok else None
    return text(v) if isinstance(v, str) else None


def record(row: Sequence[Any]) -> dict[str, Any]:
    """A decision row as the decision line a JSONL log holds."""
    rec: dict[str, Any] = {"type": "decision", "id": row[0]}
    for name, v in zip(COLUMNS, row[1:-1], strict=True):
        if v is None and name in ("preset", "prompt", "reply"):
            continue  # absent in the log when absent here
        if name == "applied" and v is not None:
            v = bool(v)  # SQLite keeps a boolean as 0 or 1
        rec[name] = from_json(v) if name in JSON_COLUMNS else v
    if row[-1]:
        rec |= json.loads(row[-1])
    return rec
