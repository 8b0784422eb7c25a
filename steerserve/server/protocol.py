"""The HTTP boundary: OpenAI's chat/completions schema plus ``steering``, parsed once.

Requests are strict (unknown fields and wrong types are refused), so a misspelt ``steering`` can
never produce a silently unsteered answer. ``steering`` is a discriminated union (:data:`Steering`)
validated with the rest of the body; every problem becomes an :class:`ApiError` naming its field.
What the server answers is in ``answers.py``; the error format in ``errors.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

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


def _needs(field: str, condition: str) -> PydanticCustomError:
    """A field given without the one it depends on (OpenAI refuses these, so do we)."""
    return PydanticCustomError(
        "dependency", "{message}", {"message": f"only allowed when {condition}", "field": field}
    )


def _integral(v: Any) -> Any:
    """``2.0`` as ``2``: JSON Schema's ``integer`` (what /openapi.json publishes) includes it,
    so a client that validates against the document must not be refused; ``2.5`` stays wrong."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


#: An integer field of a request (see :func:`_integral`).
Int = Annotated[int, BeforeValidator(_integral)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension: useful for benchmarks and tests
    steering: Steering = Field(None, description=STEERING_DOC)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise _needs("stream_options", "'stream' is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _needs("top_logprobs", "'logprobs' is true")
        return self

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Int | None = Field(16, ge=1)
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: None = None

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
    name: str = Field(description="artifact name, optionally /version; never a path")
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
