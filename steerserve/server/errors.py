"""Every error in OpenAI's format (:class:`ApiError`), and a pydantic validation error as one
that names its field (:func:`api_error`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

#: The most characters of an error's ``message`` and ``param``: both may quote what the client
#: sent (a model id, a field or vector name), and no refusal may be as large as the request it
#: refuses. Each quoting site cuts its value with ``short_repr`` where it can; this bounds every
#: message whoever built it (vLLM's, passed through, included).
MAX_MESSAGE = 1000
MAX_PARAM = 200


def cut(text: str, limit: int) -> str:
    """``text`` whole up to ``limit`` characters, else its start and end around a note of how
    much was left out (the start names the field, the end often says what to do instead)."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head - 40  # the note's room
    return f"{text[:head]}...[{len(text) - head - tail:,} characters]...{text[-tail:]}"


class ApiError(Exception):
    """An error to return in OpenAI's format; ``status`` < 500 means the caller's fault.
    ``message`` and ``param`` are cut to :data:`MAX_MESSAGE` and :data:`MAX_PARAM`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.message = cut(message, MAX_MESSAGE)
        super().__init__(self.message)
        self.status = status
        self.param = None if param is None else cut(param, MAX_PARAM)
        self.code = code
        self.type = type
        self.headers = headers  # sent with the answer (a 503's Retry-After)

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        ).model_dump()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's format."""

    error: ErrorDetail


# pydantic puts union-member tags ("str", "list[int]", "ContentPart", "Multipliers") into locations.
_TAG = re.compile(r"^([a-z-]+\[.*\]|str|int|float|bool|none|[A-Z][A-Za-z]*)$")
UNKNOWN_STEERING_FIELD = "unknown field (use 'interventions' or 'entries')"


def field_path(loc: tuple[Any, ...], field_last: bool = False) -> str | None:
    """The dotted field of a location, union tags left out; ``field_last``: its last part is a
    field name even when it looks like a tag (an unknown field ``Temperature``)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TAG.match(str(part)) or (field_last and i == len(loc) - 1):
            out += ("." if out else "") + str(part)
    return out or None


def api_error(err: Mapping[str, Any], prefix: tuple[Any, ...] = ()) -> ApiError:
    """One pydantic error as a 400 naming its field (``prefix`` + its location, extended by a
    field our validators carry)."""
    loc = (*prefix, *err.get("loc", ()))
    field = str((err.get("ctx") or {}).get("field", ""))
    # an unknown field's name is its location's last part, unless a validator named it
    unknown = err["type"] == "extra_forbidden" and not field
    param = (field_path(loc, unknown) or "") + field or None
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = (
            UNKNOWN_STEERING_FIELD if loc[:1] == ("steering",) else "unrecognized request argument"
        )
    return ApiError(f"{param}: {msg}" if param else msg, param=param)


def allowed_methods(routes: Iterable[Any], scope: Mapping[str, Any]) -> str:
    """The ``Allow`` header of a 405: the methods of every route at the request's path (Starlette
    names only the first route's, so ``GET`` and ``POST`` on one path, two routes, said ``GET``)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))
