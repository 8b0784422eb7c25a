"""Reading a request body: JSON only (415), bounded (413), parsed once into a model whose first
problem becomes a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from steerserve.server.errors import ApiError, api_error
from steerserve.server.vllm_errors import raised_error

M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: bytes) -> M:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    from vllm.exceptions import VLLMValidationError

    try:
        return model.model_validate_json(body)
    except VLLMValidationError as e:  # vLLM's own checks (not a ValueError: pydantic passes it)
        raise raised_error(e) or ApiError(str(e)) from None
    except (AttributeError, TypeError, KeyError) as e:  # a vLLM check read a field of a wrong type
        raise _wrong_type(model, body, e) from None
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(
                f"request body is not valid JSON: {err['msg']}", code="invalid_json"
            ) from None
        if err["type"] == "model_type" and not err["loc"]:
            raise ApiError("request body must be a JSON object", code="invalid_json") from None
        raise api_error(err) from None


def _wrong_type(model: type[BaseModel], body: bytes, e: Exception) -> ApiError:
    """A 400 naming the field whose type made one of vLLM's before-validators fail (they read
    the raw body assuming its types): each field is validated alone against its annotation."""
    data = json.loads(body)
    for key, value in data.items() if isinstance(data, dict) else ():
        field = model.model_fields.get(key)
        if field is None:
            continue
        try:
            TypeAdapter(field.annotation).validate_python(value)
        except ValidationError as err:
            raise api_error(err.errors(include_url=False)[0], prefix=(key,)) from None
        except Exception:
            return ApiError(f"{key}: invalid value", param=key)
    return ApiError(f"request body: a field has the wrong type ({type(e).__name__}: {e})")


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<something>+json``, parameters aside."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


async def read_request(request: Any, model: type[M], limit: int) -> M:
    """The body of a Starlette ``request`` parsed as ``model`` (:func:`read_body`)."""
    return parse_request(model, await read_body(request, limit))


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``: 415 unless it is declared JSON
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
    return b"".join(chunks)
