"""A request's steering: entries, admission validation and wire encoding."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Annotated, Any, Literal

from pydantic import Field

from steerserve.engine.ops import DEFAULT_OP, OPS, engine_ops

#: Key of the steering spec in ``SamplingParams.extra_args``; every key of ours there starts
#: with it (the prefix-cache key too), and no client may send one (:func:`reserved_key`).
EXTRA_ARGS_KEY = "steerserve"


def reserved_key(key: Any) -> bool:
    """Whether an ``extra_args`` key is steerserve's own: refused from clients, set only by
    admission."""
    return isinstance(key, str) and key.startswith(EXTRA_ARGS_KEY)


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
#: Delta rows (and op rows) one running request holds in the worker's buffers.
DEFAULT_ROWS_PER_REQUEST = 4
#: Non-additive entries one request may stack on one layer and token (``steer_edit``'s slots).
DEFAULT_OPS_PER_LAYER = 2


#: The ``positions`` values, and the operations, by name (the types every layer's copy uses).
PositionName = Literal[tuple(POSITIONS)]  # type: ignore[valid-type]
OpName = Literal[tuple(OPS)]  # type: ignore[valid-type]
#: The largest layer an entry may name before the engine's own bound (its block count).
MAX_LAYER = 2**31 - 1


@dataclass(frozen=True, slots=True)
class SteeringEntry:
    """Apply ``op`` (default: add ``scale * vectors[vector]``) at the output of decoder block
    ``layer`` (0-based) on the tokens ``positions`` selects."""

    vector: Annotated[str, Field(min_length=1, description="a registered vector")]
    layer: Annotated[
        int, Field(ge=0, le=MAX_LAYER, description="0-based decoder block (its output)")
    ]
    scale: Annotated[float, Field(allow_inf_nan=False, description="the operation's strength")] = (
        1.0
    )
    positions: Annotated[
        PositionName, Field(description="the tokens steered: " + ", ".join(POSITIONS))
    ] = "all"
    op: Annotated[
        OpName, Field(description="; ".join(f"{n}: {o.formula}" for n, o in OPS.items()))
    ] = DEFAULT_OP


#: An entry's fields, and the defaults of those a client may leave out.
ENTRY_FIELDS = frozenset(f.name for f in fields(SteeringEntry))
ENTRY_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(SteeringEntry) if f.default is not MISSING
}


def entry_fields(leave_out: Iterable[str] = ()) -> dict[str, Any]:
    """The entry's fields as pydantic field definitions (``create_model``), types, bounds and
    defaults included: how a model elsewhere carries an entry without declaring it again."""
    import typing

    hints = typing.get_type_hints(SteeringEntry, include_extras=True)
    return {
        f.name: (hints[f.name], ... if f.default is MISSING else f.default)
        for f in fields(SteeringEntry)
        if f.name not in leave_out
    }


def entry_schema() -> dict[str, Any]:
    """An entry's JSON schema, generated from :class:`SteeringEntry` (pydantic reads its
    annotations); the server narrows ``op`` to what the engine serves."""
    from pydantic import TypeAdapter

    schema = TypeAdapter(SteeringEntry).json_schema()
    schema["additionalProperties"] = False
    return schema


@dataclass(frozen=True, slots=True)
class RowPlan:
    """One delta row a request needs: at ``layer``, on ``phases``, the sum of ``terms``' deltas
    (``(vector, scale, op)``, each additive: ``OPS[op].delta``)."""

    layer: int
    phases: tuple[int, ...]
    terms: tuple[tuple[str, float, str], ...]


@dataclass(frozen=True, slots=True)
class OpPlan:
    """One non-additive entry's kernel row: at ``layer``, ``op`` with ``vector`` and ``scale``,
    in op slot ``k`` of each ``(phase, k)`` it steers (slots apply in order, ``engine/kernels.py``)."""

    layer: int
    op: str
    vector: str
    scale: float
    slots: tuple[tuple[int, int], ...]


class SteeringError(ValueError):
    """A refused steering value. ``field`` names where (``steering[1].layer``), so a caller can
    report it without taking the message apart; the message is ``"<field>: <reason>"``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


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
        raise SteeringError(field, "must be an object with vector, layer, scale, positions, op")
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
    if not 0 <= layer <= MAX_LAYER:  # the field's own bounds (ge=0, le=MAX_LAYER), at parse
        raise SteeringError(
            f"{field}.layer", f"{short_repr(layer)} is out of range: a 0-based block"
        )
    raw_scale = item.get("scale", ENTRY_DEFAULTS["scale"])
    scale = finite_number(raw_scale)
    if scale is None:
        if isinstance(raw_scale, bool) or not isinstance(raw_scale, (int, float)):
            raise SteeringError(f"{field}.scale", f"must be a number, got {short_repr(raw_scale)}")
        raise SteeringError(f"{field}.scale", "must be finite")
    pos = item.get("positions", ENTRY_DEFAULTS["positions"])
    if not isinstance(pos, str) or pos not in POSITIONS:
        raise SteeringError(
            f"{field}.positions", f"{short_repr(pos)} is not one of {', '.join(POSITIONS)}"
        )
    op = item.get("op", ENTRY_DEFAULTS["op"])
    if not isinstance(op, str) or op not in OPS:
        raise SteeringError(f"{field}.op", f"{short_repr(op)} is not one of {', '.join(OPS)}")
    e = SteeringEntry(vec, layer, scale, pos, op)
    check_op(e, field)
    return e


def check_op(e: SteeringEntry, field: str) -> None:
    """The registry's word on an entry's op: known, served by the engine, its scale in range."""
    op = OPS.get(e.op)
    if op is None:
        raise SteeringError(f"{field}.op", f"{short_repr(e.op)} is not one of {', '.join(OPS)}")
    if not op.engine:
        raise SteeringError(
            f"{field}.op",
            f"{e.op!r} is not implemented by the engine; it serves {', '.join(engine_ops())}",
        )
    why = op.scale_refusal(e.scale)
    if why is not None:
        raise SteeringError(f"{field}.scale", f"{e.scale} {why}")


def _is_zero(v: Any) -> bool:
    """Whether a registered vector (or a tensor) has norm 0; a stand-in without a norm is not."""
    n = getattr(v, "norm", None)
    if callable(n):
        n = n()
    return n is not None and float(n) == 0.0


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
    ops_per_layer: int | None = None,
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
            raise SteeringError(f"{f}.vector", f"unknown vector {short_repr(e.vector)}")
        if not 0 <= e.layer < num_layers:
            raise SteeringError(f"{f}.layer", f"{e.layer} is out of range 0..{num_layers - 1}")
        if steerable is not None and e.layer not in steerable:
            raise SteeringError(f"{f}.layer", f"layer {e.layer} is not steerable on this engine")
        check_op(e, f)
        if abs(e.scale) > max_abs_scale:
            raise SteeringError(
                f"{f}.scale", f"{e.scale} is outside [-{max_abs_scale}, {max_abs_scale}]"
            )
        if OPS[e.op].needs_direction and _is_zero(vectors[e.vector]):
            raise SteeringError(
                f"{f}.vector", f"{e.op} needs a non-zero vector; {short_repr(e.vector)} is 0"
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
        need = sum(not OPS[e.op].additive for e in out)
        if need > rows_per_request:
            raise SteeringError(
                field,
                f"needs {need} non-additive entries, the engine holds {rows_per_request} "
                "per request",
            )
    if ops_per_layer is not None:
        _check_op_slots(out, ops_per_layer, field)
    return tuple(out)


def _check_op_slots(entries: Sequence[SteeringEntry], ops_per_layer: int, field: str) -> None:
    """Refuse more non-additive entries on one layer and token phase than the engine's slots."""
    used: dict[tuple[int, int], int] = {}
    for i, e in enumerate(entries):
        if OPS[e.op].additive:
            continue
        if ops_per_layer == 0:
            raise SteeringError(
                f"{field}[{i}].op", "this engine serves additive steering only (ops_per_layer 0)"
            )
        for ph in POSITIONS[e.positions]:
            used[e.layer, ph] = used.get((e.layer, ph), 0) + 1
            if used[e.layer, ph] > ops_per_layer:
                raise SteeringError(
                    f"{field}[{i}].op",
                    f"more than {ops_per_layer} non-additive entries on layer {e.layer} at the "
                    "same tokens; the engine applies at most that many per layer",
                )


def first_steered(entries: Sequence[SteeringEntry]) -> int | None:
    """Where the entries' steering starts, from the end of the prompt (-1: the last prompt token,
    0: the first generated token), or None from token 0: every token before it keeps exactly its
    unsteered KV, so its cached blocks are shared (``engine/prefix.py``)."""
    phases = {ph for e in entries for ph in POSITIONS[e.positions]}
    if PHASE_PROMPT in phases:
        return None
    return -1 if PHASE_LAST_PROMPT in phases else 0


def plan_rows(entries: Sequence[SteeringEntry]) -> list[RowPlan]:
    """Group the additive entries into the delta rows the worker materialises: per layer, the
    phases that see the same set of entries share one row (the sum of their ``scale * vector``)."""
    by_layer: dict[int, list[SteeringEntry]] = {}
    for e in entries:
        if OPS[e.op].additive:
            by_layer.setdefault(e.layer, []).append(e)
    rows: list[RowPlan] = []
    for layer in sorted(by_layer):
        groups: dict[tuple[tuple[str, float, str], ...], list[int]] = {}
        for phase in (PHASE_PROMPT, PHASE_LAST_PROMPT, PHASE_GENERATED):
            terms = tuple(
                (e.vector, e.scale, e.op)
                for e in by_layer[layer]
                if phase in POSITIONS[e.positions]
            )
            if terms:
                groups.setdefault(terms, []).append(phase)
        rows.extend(RowPlan(layer, tuple(ph), terms) for terms, ph in groups.items())
    return rows


def plan_ops(entries: Sequence[SteeringEntry]) -> list[OpPlan]:
    """The non-additive entries as kernel rows, in entry order: on each phase an entry steers,
    it takes the next op slot of its layer (so on one layer and token they apply in order)."""
    used: dict[tuple[int, int], int] = {}
    out: list[OpPlan] = []
    for e in entries:
        if OPS[e.op].additive:
            continue
        slots = []
        for ph in POSITIONS[e.positions]:
            k = used.get((e.layer, ph), 0)
            used[e.layer, ph] = k + 1
            slots.append((ph, k))
        out.append(OpPlan(e.layer, e.op, e.vector, e.scale, tuple(slots)))
    return out


def encode(entries: Sequence[SteeringEntry]) -> str:
    """Compact JSON for ``extra_args`` (a flat string, so it also survives ``vllm_xargs``); an
    ``add`` entry has 4 fields, another op a 5th, its name."""
    return json.dumps(
        [
            [e.vector, e.layer, e.scale, e.positions, *(() if e.op == DEFAULT_OP else (e.op,))]
            for e in entries
        ],
        separators=(",", ":"),
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
                    str(item.get("op", DEFAULT_OP)),
                )
            )
        else:
            v, layer, s, p, *op = item
            out.append(SteeringEntry(str(v), int(layer), float(s), str(p), *map(str, op)))
    return tuple(out)
