"""What FastAPI's OpenAPI document cannot know of our routes: bodies they parse themselves, the
errors every one may answer in OpenAI's format, and the bearer key."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from steerserve.server.errors import ErrorResponse

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


def openapi_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``models`` (one of them) as a route's JSON body (routes parse
    it themselves: size limit, content type and OpenAI-format errors)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


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
