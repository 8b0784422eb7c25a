"""vLLM's errors as ours, in one place: what its serving classes answer (``ErrorResponse``) or
raise (``VLLMValidationError``, a template error), and what its engine raises (dead, aborted,
overloaded), each an :class:`ApiError` in OpenAI's format with an honest status: the caller's
fault a 4xx naming the field where vLLM names one, ours a 5xx."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from steerserve.server.errors import ApiError

if TYPE_CHECKING:
    from steerserve.server.drain import Drain

logger = logging.getLogger(__name__)


class EngineAborted(Exception):
    """The engine ended a request without answering it: one that reaches a stopping EngineCore
    (after a SIGINT/SIGTERM to the group) is refused with an "abort" finish, which must not
    reach the client as a 200 with no text."""


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    501: "invalid_request_error",
    503: "service_unavailable",
}


def _code(message: str) -> str | None:
    """OpenAI's ``code`` for a vLLM message that has one (vLLM's ``code`` is the HTTP status)."""
    return "context_length_exceeded" if "maximum context length" in message else None


def error_from_vllm(err: dict[str, Any]) -> ApiError:
    """vLLM's ``{"message", "type", "param", "code": <http status>}`` as our :class:`ApiError`."""
    status = int(err.get("code") or 400)
    status = status if 400 <= status < 600 else 500
    if status == 501:  # "not implemented" features of a request: the request's to change
        status = 400
    param = err.get("param")
    message = str(err.get("message") or "error")
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    kind = _TYPES.get(status, "server_error")
    return ApiError(message, status=status, param=param, type=kind, code=_code(message))


def answer_error(result: Any) -> ApiError | None:
    """The :class:`ApiError` of a serving call that answered vLLM's ``ErrorResponse``."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    if isinstance(result, ErrorResponse):
        return error_from_vllm(result.error.model_dump())
    return None


def raised_error(e: BaseException) -> ApiError | None:
    """A request-side exception vLLM's serving code raises (``VLLMValidationError`` names its
    ``parameter``) as a 400; None for anything else (engine faults: ``engine_error``)."""
    if isinstance(e, ApiError):
        return e
    from vllm.exceptions import VLLMValidationError

    if isinstance(e, VLLMValidationError):
        param = getattr(e, "parameter", None)
        msg = str(e)
        return ApiError(f"{param}: {msg}" if param else msg, param=param, code=_code(msg))
    from jinja2 import TemplateError

    if isinstance(e, (TemplateError, ValueError)):
        return ApiError(str(e) or type(e).__name__, code=_code(str(e)))
    return None


def engine_error(e: BaseException, drain: Drain | None = None) -> ApiError:
    """An engine exception as an API error: the caller's fault (4xx) or ours (5xx). A request
    the engine aborted while the server stops is one the drain dropped (counted: exit 1)."""
    if isinstance(e, BaseExceptionGroup):
        return engine_error(e.exceptions[0], drain)
    if isinstance(e, ApiError):
        return e
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    if drain is not None and isinstance(e, (EngineAborted, EngineGenerateError, EngineDeadError)):
        return drain.error()  # the engine stopped with the server, before answering
    if isinstance(e, EngineAborted):
        return ApiError(
            "the engine stopped this request before answering it; retry it",
            status=503,
            type="service_unavailable",
        )
    from vllm.exceptions import GracefulHTTPError, VLLMClientError

    if (request_error := raised_error(e)) is not None:  # vLLM's serving layer refused it
        return request_error
    if isinstance(e, GracefulHTTPError):
        return ApiError(e.message, status=int(e.http_status), type="service_unavailable")
    if isinstance(e, (VLLMClientError, ValueError)):
        return ApiError(str(e))
    if isinstance(e, EngineDeadError):
        return ApiError("the engine died", status=503, type="service_unavailable")
    logger.error("generation failed", exc_info=e)
    return ApiError("generation failed", status=500, type="server_error")
