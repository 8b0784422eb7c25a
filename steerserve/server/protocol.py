"""The HTTP boundary: OpenAI's chat/completions schema plus ``steering``, parsed once.

Requests are strict (unknown fields and wrong types are refused), so a misspelt ``steering`` can
never produce a silently unsteered answer. ``steering`` is a discriminated union (:data:`Steering`)
validated with the rest of the body; every problem becomes an :class:`ApiError` naming its field.
What the server answers is in ``answers.py``; the error format in ``errors.py``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from steerserve.server.admin import ARTIFACT_REF
from steerserve.server.errors import ApiError, ErrorResponse, api_error
from steerserve.server.experiment import SCORE_MAX, SCORE_MIN
from steerserve.server.steering import STEERING_DOC, Steering, SteeringSpec

_STEERING: TypeAdapter[SteeringSpec | None] = TypeAdapter(Steering)


def parse_steering(raw: Any) -> SteeringSpec | None:
    """A ``steering`` value from JSON (or already typed), as a request body would parse it."""
    try:
        return _STEERING.validate_python(raw)
    except ValidationError as e:
        raise api_error(e.errors(include_url=False)[0], prefix=("steering",)) from None


# --- requests ----------------------------------------------------------------------------------


def _needs(field: str, flag: str) -> PydanticCustomError:
    """A field given without the flag it depends on (OpenAI refuses these, so do we)."""
    message = f"only allowed when '{flag}' is true"
    return PydanticCustomError("dependency", "{message}", {"message": message, "field": field})


def _publish_dependencies(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """Each of ``model.DEPENDENCIES`` in its JSON schema as ``if`` (the field, not null) ``then``
    (its flag true), so a client or fuzzer reading /openapi.json knows the rule."""
    rules = [
        {
            "if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
            "then": {"required": [flag], "properties": {flag: {"const": True}}},
        }
        for field, flag in getattr(model, "DEPENDENCIES", {}).items()
    ]
    if rules:
        schema["allOf"] = rules


def _integral(v: Any) -> Any:
    """``2.0`` as ``2``: JSON Schema's ``integer`` (what /openapi.json publishes) includes it,
    so a client that validates against the document must not be refused; ``2.5`` stays wrong."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


#: An integer field of a request (see :func:`_integral`).
Int = Annotated[int, BeforeValidator(_integral)]
#: Bounded ones: the bounds come before the validator, or pydantic publishes them as ``ge``/``le``
#: (not JSON Schema) once the field is optional.
Tokens = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1), BeforeValidator(_integral)]
#: What ``/v1/completions`` generates when ``max_tokens`` is absent or null (OpenAI's and vLLM's
#: default; SDKs send unset fields as null, which must not mean "to the context limit").
COMPLETION_MAX_TOKENS = 16
#: Stop sequences a request may give (OpenAI's limit).
MAX_STOP = 4


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_publish_dependencies)


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Clients echo assistant turns back with extra fields (tool_calls, refusal...): ignore them.
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message as plain text; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(
                    f"content part of type {part.type!r} is not supported (text only)",
                    param="messages.content",
                )
            out.append(part.text)
        return "".join(out)


class _Sampling(_Request):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: Int = Field(1, ge=1, le=16)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension: useful for benchmarks and tests
    steering: Steering = Field(None, description=STEERING_DOC)

    #: field -> the boolean flag it needs (refused without it; published in the schema)
    DEPENDENCIES: ClassVar[dict[str, str]] = {"stream_options": "stream"}

    @model_validator(mode="after")
    def _dependencies(self) -> _Sampling:
        for field, flag in self.DEPENDENCIES.items():
            if getattr(self, field) is not None and not getattr(self, flag):
                raise _needs(field, flag)
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        """Before the union, so a long list gets this message, not one per union member."""
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Tokens | None = Field(
        None, description="absent or null: up to the context limit (as OpenAI and vLLM)"
    )
    max_completion_tokens: Tokens | None = Field(
        None, description="takes precedence over max_tokens; absent or null: as max_tokens"
    )
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None

    DEPENDENCIES: ClassVar[dict[str, str]] = {
        **_Sampling.DEPENDENCIES,
        "top_logprobs": "logprobs",
    }

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Tokens | None = Field(
        COMPLETION_MAX_TOKENS, description=f"absent or null: {COMPLETION_MAX_TOKENS}"
    )
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: None = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _default_budget(cls, v: Any) -> Any:
        return COMPLETION_MAX_TOKENS if v is None else v

    def token_budget(self) -> int | None:
        return self.max_tokens


class FeedbackRequest(_Request):
    id: str = Field(min_length=1, max_length=200, description="the answer's completion id")
    score: float = Field(
        allow_inf_nan=False,
        ge=SCORE_MIN,
        le=SCORE_MAX,
        description="the outcome in [-1, 1], e.g. 1 thumbs up, 0 down; an answer's last counts",
    )


class FeedbackAnswer(BaseModel):
    """``POST /v1/steering/feedback``: the feedback, joined to its request's arm."""

    object: Literal["steering.feedback"] = "steering.feedback"
    id: str
    score: float
    experiment: str | None
    arm: str | None
    language: str | None


class VectorLoadRequest(_Request):
    name: str = Field(
        description="artifact name, optionally /version; never a path",
        # the rule is admin.check_ref's; published so clients and fuzzers know it
        json_schema_extra={"pattern": ARTIFACT_REF.pattern, "not": {"pattern": r"\.\."}},
    )
    default: bool = Field(False, description="make it the artifact `steering: true` uses")


# --- reading a request ---------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(
                f"request body is not valid JSON: {err['msg']}", code="invalid_json"
            ) from None
        if err["type"] == "model_type" and not err["loc"]:
            raise ApiError("request body must be a JSON object", code="invalid_json") from None
        raise api_error(err) from None


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<something>+json``, parameters aside."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


async def read_request(request: Any, model: type[M], limit: int) -> M:
    """The body of a Starlette ``request`` parsed as ``model``: 415 unless it is declared JSON
    (a web page can send ``text/plain`` cross-site without a preflight, never JSON), 413 past
    ``limit`` bytes (before reading it when announced)."""
    if not is_json(request.headers.get("content-type", "")):
        raise ApiError(
            "send the body as JSON with 'Content-Type: application/json'",
            status=415,
            code="unsupported_media_type",
        )
    too_big = ApiError(
        f"request body is larger than {limit} bytes", status=413, code="request_too_large"
    )
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return parse_request(model, b"".join(chunks))


# --- the OpenAPI document ------------------------------------------------------------------------

#: Errors every generation endpoint may answer (the 200 answer is declared per route).
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in {
        400: "invalid request (the message and `param` name the field)",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "body larger than the limit",
        408: "the request did not arrive in full in time (a slow client)",
        415: "body not sent as application/json",
        499: "the client went away (logged; the client never reads it)",
        500: "server error (its message and x-request-id carry the id it is logged under)",
        503: "engine loading, failed or dead, or the server stopping (drain deadline passed)",
    }.items()
}


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` as a route's JSON body (routes parse it themselves:
    size limit, content type and OpenAI-format errors)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_components(models: list[type[BaseModel]]) -> dict[str, Any]:
    """JSON schemas of ``models`` and what they refer to, for ``components.schemas``."""
    out: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def _error_answer(status: int) -> dict[str, Any]:
    """:data:`ERRORS`' entry for ``status`` as the document writes a response."""
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    return {
        "description": ERRORS[status]["description"],
        "content": {"application/json": {"schema": ref}},
    }


def openapi_errors(doc: dict[str, Any], keyed: set[tuple[str, str]], key: bool) -> None:
    """What FastAPI's document cannot know: an invalid parameter is our 400 (FastAPI documents a
    422 ``HTTPValidationError``), the operations ``keyed`` (path, method) answer 401, and, when
    the server has a ``key``, they say so as a bearer security scheme."""
    comps = doc.setdefault("components", {})
    comps.setdefault("schemas", {}).update(openapi_components([ErrorResponse]))
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            answers = op.setdefault("responses", {})
            if "HTTPValidationError" in json.dumps(answers.get("422", {})):
                del answers["422"]
                answers.setdefault("400", _error_answer(400))
            if (path, method) in keyed:
                answers.setdefault("401", _error_answer(401))
                if key:
                    op["security"] = [{"apiKey": []}]
    if "HTTPValidationError" not in json.dumps(doc.get("paths", {})):
        comps["schemas"].pop("HTTPValidationError", None)
        comps["schemas"].pop("ValidationError", None)
    if key:
        comps["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
