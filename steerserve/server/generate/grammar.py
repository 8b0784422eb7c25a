"""Bounds on structured outputs: what one request's grammar may cost the engine."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from steerserve.server.errors import ApiError

#: The JSON text of a request's grammars (schema, regex, grammar, choices, structural tag, the
#: tools a required or named ``tool_choice`` compiles) that one request may send: 64 KiB, ten
#: times a large hand-written schema, a third of the probe's 200 KB ones.
MAX_GRAMMAR_CHARS = 65_536
#: ``stop_token_ids`` one request may send (100,000 of them held the event loop 2.3 s).
MAX_STOP_TOKEN_IDS = 1_024


def _text(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif hasattr(value, "model_dump"):
        value = value.model_dump(mode="json", exclude_none=True)
    return json.dumps(value, default=str, separators=(",", ":"))


def grammars(req: Any) -> dict[str, Any]:
    """The request's fields that vLLM compiles into a grammar, by name."""
    out = {
        name: getattr(req, name)
        for name in ("structured_outputs", "response_format")
        if getattr(req, name, None) is not None
    }
    fmt = getattr(getattr(req, "text", None), "format", None)  # the Responses API's
    if getattr(fmt, "type", None) == "json_schema":
        out["text"] = fmt
    choice = getattr(req, "tool_choice", None)
    if getattr(req, "tools", None) and choice not in (None, "none", "auto"):
        out["tools"] = req.tools  # required or a named tool: its parameters become a grammar
    return out


def check(req: Any) -> str | None:
    """A 400 naming the field when the request's grammars or stop ids exceed their bounds; else
    the field of its first grammar (what an engine-side compile failure is reported against)."""
    total = 0
    found = grammars(req)
    for name, value in found.items():
        total += len(_text(value))
        if total > MAX_GRAMMAR_CHARS:
            raise ApiError(
                f"{name}: the request's structured-output grammars are {total:,}+ characters of "
                f"JSON; this server compiles at most {MAX_GRAMMAR_CHARS:,} per request",
                param=name,
                code="grammar_too_large",
            )
    stops = getattr(req, "stop_token_ids", None) or ()
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise ApiError(
            f"stop_token_ids: {len(stops)} ids; at most {MAX_STOP_TOKEN_IDS} per request",
            param="stop_token_ids",
        )
    return next(iter(found), None)
