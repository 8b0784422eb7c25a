"""A request's steering: entries, admission validation, wire encoding and cache salt.

Shared by the front end (validation, encoding, salting) and the worker (decoding, row planning),
so both sides agree on what an entry means.

The steering vocabulary, in one place: the engine knows one operation, *add* ``scale * v`` to
the output of block ``layer`` on the tokens ``positions`` selects (:data:`POSITIONS`). The
research runner speaks a superset (``research/runner.py``, ``Edit``): the same addition
(``entry_edits`` turns entries into edits with these position semantics) plus ``replace``
(h <- v) and ``interp`` (h <- (1 - a) h + a v) at the last prompt token, which only the lab uses.
Adding an operation to the engine (or promoting a research edit) touches, in order:

1. here: a field of :class:`SteeringEntry`, its check in :func:`entry`/:func:`validate`, its
   wire form in :func:`encode`/:func:`decode` and :func:`cache_salt` (a new meaning must not
   share a prefix cache with the old);
2. the worker: ``engine/buffers.py`` (rows and pools per layer) and the op, ``engine/op.py``;
3. the oracle: ``research/reference.py`` (plain forward hooks), which tests/test_engine_*.py
   hold the engine to, and ``research/runner.py``'s ``Edit``/``entry_edits`` for the lab;
4. the request: ``server/steering.py`` (the typed ``steering`` value) and ``server/policy.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Key of the steering spec in ``SamplingParams.extra_args``.
EXTRA_ARGS_KEY = "steerserve"

#: Token phases: 0 = prompt token before the last, 1 = last prompt token, 2 = generated token
#: (a token whose *input* is a generated token, i.e. position >= prompt length).
PHASE_PROMPT, PHASE_LAST_PROMPT, PHASE_GENERATED = 0, 1, 2

#: Which phases each ``positions`` value steers.
POSITIONS: dict[str, tuple[int, ...]] = {
    "all": (PHASE_PROMPT, PHASE_LAST_PROMPT, PHASE_GENERATED),
    "last_prompt_and_generated": (PHASE_LAST_PROMPT, PHASE_GENERATED),
    "generated": (PHASE_GENERATED,),
}

DEFAULT_MAX_ABS_SCALE = 64.0
DEFAULT_MAX_ENTRIES = 16


@dataclass(frozen=True, slots=True)
class SteeringEntry:
    """Add ``scale * vectors[vector]`` to the residual stream at the output of decoder block
    ``layer`` (0-based; transformers' ``hidden_states[layer + 1]``) on the tokens ``positions``
    selects."""

    vector: str
    layer: int
    scale: float
    positions: str = "all"


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One delta row a request needs: at ``layer``, on ``phases``, the sum of ``terms``."""

    layer: int
    phases: tuple[int, ...]
    terms: tuple[tuple[str, float], ...]


class SteeringError(ValueError):
    """A refused steering value. ``field`` names where (``steering[1].layer``), so a caller can
    report it without taking the message apart; the message is ``"<field>: <reason>"``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


ENTRY_FIELDS = frozenset({"vector", "layer", "scale", "positions"})


def finite_number(v: Any) -> float | None:
    """``v`` as a finite float, or None when it is not a real number (a bool, a string) or is not
    finite; JSON integers past float's range (``10**400``) are not finite either, where
    ``math.isfinite`` would raise OverflowError. The one rule for scales and multipliers."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def entry(item: Any, field: str = "steering[0]") -> SteeringEntry:
    """One entry from its JSON form, its types checked (the engine-independent half of
    :func:`validate`); ``field`` prefixes every error."""
    if isinstance(item, SteeringEntry):
        return item
    if not isinstance(item, Mapping):
        raise SteeringError(field, "must be an object with vector, layer, scale, positions")
    unknown = set(item) - ENTRY_FIELDS
    if unknown:
        raise SteeringError(f"{field}.{sorted(unknown)[0]}", "unknown field")
    vec = item.get("vector")
    if not isinstance(vec, str) or not vec:
        raise SteeringError(f"{field}.vector", "must be the name of a registered vector")
    layer = item.get("layer")
    if isinstance(layer, float) and layer.is_integer():  # 2.0: an integer to JSON Schema
        layer = int(layer)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise SteeringError(f"{field}.layer", f"must be an integer, got {short_repr(layer)}")
    if not -(2**31) <= layer < 2**31:
        raise SteeringError(f"{field}.layer", "is out of range")
    raw_scale = item.get("scale", 1.0)
    scale = finite_number(raw_scale)
    if scale is None:
        if isinstance(raw_scale, bool) or not isinstance(raw_scale, (int, float)):
            raise SteeringError(f"{field}.scale", f"must be a number, got {short_repr(raw_scale)}")
        raise SteeringError(f"{field}.scale", "must be finite")
    pos = item.get("positions", "all")
    if not isinstance(pos, str) or pos not in POSITIONS:
        raise SteeringError(
            f"{field}.positions", f"{short_repr(pos)} is not one of {', '.join(POSITIONS)}"
        )
    return SteeringEntry(vec, layer, scale, pos)


def short_repr(v: Any, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters: an error message echoes a value, never a megabyte."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**limit:
        return "an integer too large to show"  # repr would raise past 4,300 digits
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def validate(
    raw: Iterable[Any] | None,
    *,
    num_layers: int,
    vectors: Mapping[str, Any],
    steerable_layers: Iterable[int] | None = None,
    max_abs_scale: float = DEFAULT_MAX_ABS_SCALE,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    rows_per_request: int | None = None,
    field: str = "steering",
) -> tuple[SteeringEntry, ...]:
    """Turn raw entries (dicts, checked by :func:`entry`, or :class:`SteeringEntry`) into entries
    this engine can run.

    Raises :class:`SteeringError` naming the offending field under ``field``, e.g.
    ``steering[1].layer: 40 is out of range 0..17``. Never drops an entry silently.
    """
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes, Mapping)):
        raise SteeringError(field, "must be a list of entries")
    steerable = None if steerable_layers is None else frozenset(steerable_layers)
    out: list[SteeringEntry] = []
    for i, item in enumerate(raw):
        f = f"{field}[{i}]"
        e = entry(item, f)
        if e.vector not in vectors:
            raise SteeringError(f"{f}.vector", f"unknown vector {e.vector!r}")
        if not 0 <= e.layer < num_layers:
            raise SteeringError(f"{f}.layer", f"{e.layer} is out of range 0..{num_layers - 1}")
        if steerable is not None and e.layer not in steerable:
            raise SteeringError(f"{f}.layer", f"layer {e.layer} is not steerable on this engine")
        if abs(e.scale) > max_abs_scale:
            raise SteeringError(
                f"{f}.scale", f"{e.scale} is outside [-{max_abs_scale}, {max_abs_scale}]"
            )
        out.append(e)
    if len(out) > max_entries:
        raise SteeringError(field, f"{len(out)} entries, at most {max_entries} allowed")
    if rows_per_request is not None:
        need = len(plan_rows(out))
        if need > rows_per_request:
            raise SteeringError(
                field,
                f"needs {need} distinct (layer, positions) deltas, the engine holds "
                f"{rows_per_request} per request",
            )
    return tuple(out)


def first_steered(entries: Sequence[SteeringEntry]) -> int | None:
    """Where the entries' steering starts, from the end of the prompt (-1: the last prompt token,
    0: the first generated token), or None from token 0: every token before it keeps exactly its
    unsteered KV, so its cached blocks are shared (``engine/prefix.py``)."""
    phases = {ph for e in entries for ph in POSITIONS[e.positions]}
    if PHASE_PROMPT in phases:
        return None
    return -1 if PHASE_LAST_PROMPT in phases else 0


def plan_rows(entries: Sequence[SteeringEntry]) -> list[RowPlan]:
    """Group entries into the delta rows the worker materialises: per layer, the phases that see
    the same set of entries share one row (the sum of those entries' ``scale * vector``)."""
    by_layer: dict[int, list[SteeringEntry]] = {}
    for e in entries:
        by_layer.setdefault(e.layer, []).append(e)
    rows: list[RowPlan] = []
    for layer in sorted(by_layer):
        groups: dict[tuple[tuple[str, float], ...], list[int]] = {}
        for phase in (PHASE_PROMPT, PHASE_LAST_PROMPT, PHASE_GENERATED):
            terms = tuple(
                (e.vector, e.scale) for e in by_layer[layer] if phase in POSITIONS[e.positions]
            )
            if terms:
                groups.setdefault(terms, []).append(phase)
        rows.extend(RowPlan(layer, tuple(ph), terms) for terms, ph in groups.items())
    return rows


def encode(entries: Sequence[SteeringEntry]) -> str:
    """Compact JSON for ``extra_args`` (a flat string, so it also survives ``vllm_xargs``)."""
    return json.dumps(
        [[e.vector, e.layer, e.scale, e.positions] for e in entries], separators=(",", ":")
    )


def decode(value: Any) -> tuple[SteeringEntry, ...]:
    """Inverse of :func:`encode`; also accepts a list of entry dicts (in-process callers)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)):
        value = json.loads(value)
    out = []
    for item in value:
        if isinstance(item, Mapping):
            out.append(
                SteeringEntry(
                    str(item["vector"]),
                    int(item["layer"]),
                    float(item.get("scale", 1.0)),
                    str(item.get("positions", "all")),
                )
            )
        else:
            v, layer, s, p = item
            out.append(SteeringEntry(str(v), int(layer), float(s), str(p)))
    return tuple(out)


#: How a steered request's ``cache_salt`` begins (``engine/prefix.py`` reads the rest).
SALT_PREFIX = "steer-"


def cache_salt(entries: Sequence[SteeringEntry], digests: Mapping[str, str]) -> str:
    """Prefix-cache salt: steered KV is never shared with unsteered requests or other configs
    from the first steered token on (``:`` and :func:`first_steered`, when it is not token 0);
    the blocks before it are shared (``engine/prefix.py``).

    ``digests`` maps vector names to a content hash, so a different vector under the same name
    can never reuse cached KV.
    """
    h = hashlib.sha256()
    for e in entries:
        h.update(
            f"{e.vector}|{digests.get(e.vector, '')}|{e.layer}|{e.scale!r}|{e.positions};".encode()
        )
    start = first_steered(entries)
    return SALT_PREFIX + h.hexdigest()[:32] + ("" if start is None else f":{start}")
