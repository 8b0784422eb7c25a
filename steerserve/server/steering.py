"""A request's ``steering`` as one typed value: a discriminated union parsed with the body."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Tag,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from steerserve.engine.ops import OPS, engine_ops
from steerserve.engine.spec import (
    SteeringEntry,
    SteeringError,
    entry,
    entry_schema,
    finite_number,
    short_repr,
)
from steerserve.server.errors import api_error

STEERING_DOC = (
    'false | true | "auto" | {"interventions": {"recall": 1.0, ...}, "artifact"?: "name/version"} '
    '| {"entries": [{"vector", "layer", "scale", "positions", "op"}]}; absent: the server default'
)
MODES = ("off", "on", "auto")
#: The server's default for requests without ``steering`` (``--steering``): off, because no
#: shipped vector is confirmed to mend recall (docs/results/README.md; the chat model's v1 costs
#: 8 points of non-English accuracy on held-out facts). Steering is opted into per request
#: (``"steering": "auto"``), per experiment (``--ab-split``) or per server (``--steering auto``).
DEFAULT_MODE = "off"


def _entry_schema() -> dict[str, Any]:
    """An entry's JSON schema: the entry's own (``spec.entry_schema``, from its one declaration),
    its ``op`` narrowed to the ops the engine serves, and each bounded op's scale range as an
    if/then (the registry's, ``engine/ops.py``)."""
    served = engine_ops()
    schema = entry_schema()
    schema["description"] = "one operation on the residual stream at one layer"
    op = schema["properties"]["op"]
    op["enum"] = list(served)
    op["description"] = "; ".join(f"{n}: {OPS[n].formula}" for n in served)
    bounded = [
        {
            "if": {"properties": {"op": {"const": name}}, "required": ["op"]},
            "then": {"properties": {"scale": {"minimum": rng[0], "maximum": rng[1]}}},
        }
        for name in served
        if (rng := OPS[name].scale_range) is not None
    ]
    if bounded:
        schema["allOf"] = bounded
    return schema


_ENTRY_SCHEMA = _entry_schema()
#: The published JSON schema of ``steering`` (what clients send, before it is typed).
STEERING_SCHEMA = {
    "description": STEERING_DOC,
    "anyOf": [
        {"type": "boolean"},
        {"enum": list(MODES)},
        {
            "type": "object",
            "title": "Multipliers",
            "additionalProperties": False,
            "properties": {
                "interventions": {
                    "type": "object",
                    "minProperties": 1,
                    "additionalProperties": {"type": "number"},
                },
                "artifact": {"type": "string", "description": "name or name/version"},
            },
        },
        {
            "type": "object",
            "title": "Entries",
            "additionalProperties": False,
            "required": ["entries"],
            "properties": {"entries": {"type": "array", "minItems": 1, "items": _ENTRY_SCHEMA}},
        },
        {"type": "null"},
    ],
}


def _refuse(message: str, field: str = "") -> PydanticCustomError:
    """A validation error with our own message; ``field`` extends its location (see
    :func:`api_error`)."""
    return PydanticCustomError("steering", "{message}", {"message": message, "field": field})


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Off(_Spec):
    """``false``: unsteered."""


class On(_Spec):
    """``true``: the default artifact's interventions at their calibrated settings."""


class Auto(_Spec):
    """``"auto"``: :class:`On` when the prompt's language is detected and is not English."""


def _multiplier(v: Any) -> float:
    f = finite_number(v)
    if f is None:
        raise _refuse(f"the multiplier must be a finite number, got {short_repr(v)}")
    return f


def _multipliers(v: Any) -> Any:
    if v is not None and (not isinstance(v, Mapping) or not v):
        raise _refuse("must be a non-empty object {name: multiplier}")
    return v


def _artifact_ref(v: Any) -> Any:
    if v is not None and not isinstance(v, str):
        raise _refuse("must be a string")
    return v


class Multipliers(_Spec):
    """``{"interventions": {name: multiplier}, "artifact"?: "name[/version]"}``: the artifact's
    calibrated entries, each scale times its multiplier (no ``interventions``: all at 1)."""

    interventions: Annotated[
        dict[str, Annotated[float, BeforeValidator(_multiplier)]] | None,
        BeforeValidator(_multipliers),
    ] = None
    artifact: Annotated[str | None, BeforeValidator(_artifact_ref)] = None


def _entries(v: Any) -> tuple[SteeringEntry, ...]:
    if not isinstance(v, list) or not v:
        raise _refuse("must be a non-empty list of {vector, layer, scale, positions, op}")
    try:
        return tuple(entry(item, f"[{i}]") for i, item in enumerate(v))
    except SteeringError as e:
        raise _refuse(e.reason, e.field) from None


class Entries(_Spec):
    """``{"entries": [...]}``: explicit engine entries (the engine checks vectors and layers)."""

    entries: Annotated[tuple[SteeringEntry, ...], BeforeValidator(_entries)]

    @model_validator(mode="before")
    @classmethod
    def _alone(cls, v: Any) -> Any:
        if isinstance(v, Mapping) and ("interventions" in v or "artifact" in v):
            raise _refuse("'entries' cannot be combined with 'interventions' or 'artifact'")
        return v


def _variant(v: Any) -> str:
    if isinstance(v, Mapping):
        return "Entries" if "entries" in v else "Multipliers"
    return type(v).__name__


def _shorthand(raw: Any) -> Any:
    """``false | true | "off" | "on" | "auto"`` become their variant; objects go on to the union."""
    if raw is None or isinstance(raw, (_Spec, Mapping)):
        return raw
    if isinstance(raw, bool):
        return On() if raw else Off()
    if isinstance(raw, str):
        if raw in MODES:
            return {"off": Off, "on": On, "auto": Auto}[raw]()
        raise _refuse(f'{short_repr(raw)} is not one of false, true, "auto" (or an object)')
    raise _refuse(
        "must be false, true, \"auto\", or an object with 'interventions' or 'entries'; "
        f"got {type(raw).__name__}"
    )


#: A request's ``steering``, parsed: None means "the server's default".
SteeringSpec = Off | On | Auto | Multipliers | Entries
Steering = Annotated[
    Annotated[
        Annotated[Off, Tag("Off")]
        | Annotated[On, Tag("On")]
        | Annotated[Auto, Tag("Auto")]
        | Annotated[Multipliers, Tag("Multipliers")]
        | Annotated[Entries, Tag("Entries")],
        Discriminator(_variant),
    ]
    | None,
    BeforeValidator(_shorthand),
    WithJsonSchema(STEERING_SCHEMA),
]


_STEERING: TypeAdapter[SteeringSpec | None] = TypeAdapter(Steering)


def parse_steering(raw: Any) -> SteeringSpec | None:
    """A ``steering`` value from JSON (or already typed), as a request body would parse it."""
    try:
        return _STEERING.validate_python(raw)
    except ValidationError as e:
        raise api_error(e.errors(include_url=False)[0], prefix=("steering",)) from None
