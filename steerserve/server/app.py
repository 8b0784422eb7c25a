"""The OpenAI-compatible FastAPI app: factory, lifespan (engine in the background), error handlers
and thin routes over ``pipeline.handle``."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from steerserve.server import pages, vectors, vllm_errors
from steerserve.server import protocol as P
from steerserve.server.ab import service as ab_service
from steerserve.server.answers import (
    ABResponse,
    ChatCompletion,
    Completion,
    MessagesResponse,
    ModelCard,
    ModelList,
    ResponsesResponse,
    VectorListing,
)
from steerserve.server.body import read_body, read_request
from steerserve.server.errors import ApiError, ErrorResponse, allowed_methods, api_error
from steerserve.server.generate import endpoints, pipeline
from steerserve.server.guard import Guard
from steerserve.server.openapi import ERRORS, openapi_body, openapi_components, openapi_errors
from steerserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VectorLoadRequest,
)
from steerserve.server.runtime import ServerSettings
from steerserve.server.state import ServerState

__all__ = ["ServerSettings", "create_app"]

logger = logging.getLogger("steerserve.server")


def _state(request: Request) -> ServerState:
    return request.app.state.steer


async def require_key(request: Request) -> None:
    state = _state(request)
    keys = state.api_keys
    if not keys:  # on loopback, loopback Host names only (DNS rebinding): admin.AdminGate
        state.admin.check_api(request.headers.get("host"))
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if not auth and "x-api-key" in request.headers:  # the Anthropic SDK's header
        scheme, given = "bearer", request.headers["x-api-key"]
    # Compared as bytes: headers arrive as latin-1 text, and compare_digest refuses non-ASCII str.
    # Every key is compared (any authenticates), so the time taken does not say which matched.
    sent = given.strip().encode("latin-1")
    matched = [secrets.compare_digest(sent, key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matched):
        raise ApiError(
            "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or x-api-key)",
            status=401,
            code="invalid_api_key",
        )
    request.state.key_index = matched.index(True)  # who the client is (pipeline.client_of)


async def require_admin(request: Request) -> None:
    """The admin endpoints' gate, after the key: an admin key where the server has them (their
    indices follow the API keys' in ``state.api_keys``), else ``admin.AdminGate`` (refused
    beyond loopback without a key, open on loopback to loopback Host names only)."""
    state = _state(request)
    if state.admin_keys:
        index = getattr(request.state, "key_index", -1)
        if index < len(state.api_keys) - len(state.admin_keys):
            raise ApiError(
                "this endpoint needs an admin key (--admin-key): an API key does not open it",
                status=403,
                code="admin_key_required",
            )
    state.admin.check(request.headers.get("host"))


def create_app(settings: ServerSettings) -> FastAPI:
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(state.run())
        try:
            yield
        finally:
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            await state.backend.shutdown(signalled=state.stopping)
            await asyncio.to_thread(state.decisions.close)  # the store's queue drains (bounded)
            logger.info("engine shut down")

    # No /docs or /redoc: FastAPI's pages load Swagger UI / ReDoc from a CDN and run it on this
    # origin, with no CSP or integrity check (the pages in pages.py are strict), and no package
    # here ships those assets to serve them ourselves. /openapi.json stays: any viewer reads it.
    app = FastAPI(
        title="steerserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    app.state.steer = state
    _errors(app)
    app.include_router(_ops_router())
    app.include_router(_v1_router(), dependencies=[Depends(require_key)])
    # vLLM serves tokenization at the root too (``vllm bench serve`` aligns prompts with it)
    app.include_router(_tokenize_router(""), dependencies=[Depends(require_key)])
    app.include_router(_invocations_router(), dependencies=[Depends(require_key)])
    app.include_router(pages.pages_router())
    admin = [Depends(require_key), Depends(require_admin)]
    app.include_router(pages.experiments_router(), dependencies=admin)
    app.include_router(pages.preference_router(), dependencies=[Depends(require_key)])
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if settings.allowed_origins:  # vLLM's CORS options; none given: no CORS headers at all
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.allowed_methods),
            allow_headers=list(settings.allowed_headers),
            allow_credentials=settings.allow_credentials,
        )
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus what it cannot see: the request bodies (routes parse them
    themselves), our 400 for invalid parameters, and which operations need the API key."""
    if app.openapi_schema is None:
        # servers: FastAPI's, the --root-path a proxy serves the app under among them
        doc = get_openapi(
            title=app.title, version=app.version, routes=app.routes, servers=app.servers or None
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(openapi_components(REQUEST_MODELS))
        keyed = {
            (route.path_format, method.lower())
            for route in app.routes
            if isinstance(route, APIRoute)
            and any(d.dependency is require_key for d in route.dependencies)
            for method in route.methods
        }
        openapi_errors(doc, keyed, key=bool(app.state.steer.api_keys))
        app.openapi_schema = doc
    return app.openapi_schema


#: The admin routes' 403 (``admin.AdminGate``), as the OpenAPI document says it.
ADMIN_REFUSED = "without a key: refused beyond loopback, and under a Host name not loopback's"

REQUEST_MODELS: list[type[BaseModel]] = [
    P.ChatCompletionRequest,
    P.CompletionRequest,
    P.ResponsesRequest,
    P.MessagesRequest,
    P.TokenizeRequest,
    P.DetokenizeRequest,
    P.VectorLoadRequest,
    P.FeedbackRequest,
]


def _route(body: type[BaseModel], answer: type[BaseModel], stream: bool = False) -> dict[str, Any]:
    """What the OpenAPI document says of a POST route: its JSON body, its answers, its errors."""
    ok: dict[str, Any] = {"model": answer, "description": "the answer"}
    if stream:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
        ok["description"] = "the answer; with stream: true, server-sent events of chunks"
    return {"openapi_extra": openapi_body(body), "responses": {200: ok, **ERRORS}}


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error_handler(request: Request, e: ApiError) -> JSONResponse:
        pipeline.refused(request, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        loc = tuple(err.get("loc", ()))[1:]  # FastAPI puts "body" first
        return await api_error_handler(request, api_error({**err, "loc": loc}))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        typ = "invalid_request_error" if e.status_code < 500 else "server_error"
        err = ApiError(str(e.detail), status=e.status_code, type=typ)
        headers = e.headers
        if e.status_code == 405:
            headers = {**(headers or {}), "Allow": allowed_methods(app.routes, request.scope)}
        return JSONResponse(err.body(), status_code=e.status_code, headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect) -> Response:
        """The client hung up while sending its request: nobody reads the answer."""
        pipeline.refused(request, 499)
        return Response(status_code=499)

    # Anything no handler above typed: a 500 in OpenAI's format, the connection kept usable.
    app.add_middleware(Guard, on_error=pipeline.refused)


def _ops_router() -> APIRouter:
    r = APIRouter()

    # HEAD as its own undocumented route: one route with both methods gives two OpenAPI
    # operations the same id (FastAPI warns)
    @r.head("/health", include_in_schema=False)
    @r.get("/health", responses={503: {"description": "the engine died or failed to load"}})
    async def health(request: Request) -> JSONResponse:
        """Liveness: 200 while the process serves (also while loading); 503 once the engine
        has died or failed to load, so an orchestrator restarts the process."""
        s = _state(request)
        if s.load_error is not None or (s.loaded and not s.backend.ready):
            return JSONResponse({"status": "engine dead"}, 503)
        return JSONResponse({"status": "ok"})

    @r.get("/ready", responses={503: {"description": "the engine is loading, failed or died"}})
    async def ready(request: Request) -> JSONResponse:
        """Readiness: 200 once the engine is loaded, else 503."""
        s = _state(request)
        if s.ready:
            return JSONResponse({"status": "ready", "model": s.model_name})
        if s.load_error is not None:
            return JSONResponse({"status": "failed", "error": str(s.load_error)}, 503)
        return JSONResponse({"status": "dead" if s.loaded else "loading"}, 503)

    # vLLM's /ping (SageMaker's health check, GET or POST): its /health, which answers once the
    # engine serves; this server answers while loading, so /ping says 200 once it is ready
    @r.post("/ping", response_class=Response, responses={503: {"description": "not ready"}})
    @r.get("/ping", response_class=Response, responses={503: {"description": "not ready"}})
    async def ping(request: Request) -> Response:
        """200 (no body) once the engine serves, else 503: vLLM's /ping, for SageMaker."""
        return Response(status_code=200 if _state(request).ready else 503)

    @r.get("/load")
    async def load(request: Request) -> dict[str, int]:
        """vLLM's /load: generation requests in flight (queued or running), always counted here
        (vLLM counts them with --enable-server-load-tracking, else says 0)."""
        m = _state(request).metrics
        return {"server_load": int(m.registry.get_sample_value("steerserve_queue_depth") or 0)}

    @r.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's ``/version`` (clients such as ``vllm bench serve`` read it), and ours."""
        import vllm

        from steerserve import __version__

        return {"version": vllm.__version__, "steerserve": __version__}

    @r.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format
    async def metrics(request: Request) -> Response:
        m = _state(request).metrics
        return Response(m.render(), media_type=m.content_type)

    return r


async def _tokenization(request: Request, model: type[BaseModel], method: str) -> Response:
    """``/tokenize`` and ``/detokenize`` through vLLM's serving layer (its shapes)."""
    s = _state(request)
    req: Any = await read_request(request, model, s.settings.max_body_bytes)
    req = getattr(req, "root", req)
    pipeline.check(s, req.model or s.model_name)
    req.model = s.model_name  # a preset's id tokenizes as its base model
    if isinstance(req, DetokenizeRequest):
        endpoints.check_ids(list(req.tokens), s.backend.vocab_size, "tokens")
    assert s.serving is not None
    try:
        result = await getattr(s.serving.tokenization, method)(req, request)
    except Exception as e:
        raise (vllm_errors.raised_error(e) or e) from None
    if (err := vllm_errors.answer_error(result)) is not None:
        raise err
    return JSONResponse(result.model_dump(mode="json"))


def _tokenize_router(prefix: str) -> APIRouter:
    """``/tokenize`` and ``/detokenize`` under ``prefix`` (vLLM serves both at the root and
    under ``/v1``)."""
    r = APIRouter(prefix=prefix)

    @r.post("/tokenize", **_route(TokenizeRequest, TokenizeResponse))
    async def tokenize_route(request: Request) -> Response:
        """vLLM's tokenization of a prompt or chat, as ``vllm serve`` answers it."""
        return await _tokenization(request, TokenizeRequest, "create_tokenize")

    @r.post("/detokenize", **_route(DetokenizeRequest, DetokenizeResponse))
    async def detokenize_route(request: Request) -> Response:
        return await _tokenization(request, DetokenizeRequest, "create_detokenize")

    return r


def _invocations_router() -> APIRouter:
    r = APIRouter()
    route = _route(P.ChatCompletionRequest, ChatCompletion, True)
    route["openapi_extra"] = openapi_body(
        P.ChatCompletionRequest, P.CompletionRequest, P.ResponsesRequest
    )

    @r.post("/invocations", **route)
    async def invocations(request: Request) -> Response:
        """SageMaker's inference route, as vLLM serves it: a chat body is a chat completion, a
        completions body a completion, a Responses body a response, steered as on /v1."""
        s = _state(request)
        body = await read_body(request, s.settings.max_body_bytes)
        return await pipeline.handle(s, request, endpoints.invoked(body), body)

    return r


def _v1_router() -> APIRouter:
    r = APIRouter(prefix="/v1")

    @r.get("/models", responses={200: {"model": ModelList}, 401: ERRORS[401]})
    async def models(request: Request) -> Response:
        s = _state(request)
        max_len = s.backend.max_model_len if s.ready else s.settings.engine.max_model_len
        card = ModelCard(
            id=s.model_name, created=s.created, root=s.model_name, max_model_len=max_len
        )
        presets = [  # as vLLM lists LoRA adapters: their own ids, the base model as parent
            card.model_copy(update={"id": p.id, "parent": s.model_name, "steering": p.raw})
            for p in s.presets.values()
        ]
        body = ModelList(data=[card, *presets]).model_dump_json()
        return Response(body, media_type="application/json")

    @r.post("/chat/completions", **_route(P.ChatCompletionRequest, ChatCompletion, True))
    async def chat(request: Request) -> Response:
        return await pipeline.handle(_state(request), request, endpoints.CHAT)

    @r.post("/chat/completions/ab", **_route(P.ChatCompletionRequest, ABResponse, True))
    async def chat_ab(request: Request) -> Response:
        return await pipeline.handle(_state(request), request, endpoints.AB)

    @r.post("/completions", **_route(P.CompletionRequest, Completion, True))
    async def completions(request: Request) -> Response:
        return await pipeline.handle(_state(request), request, endpoints.COMPLETIONS)

    @r.post("/responses", **_route(P.ResponsesRequest, ResponsesResponse, True))
    async def responses(request: Request) -> Response:
        """The OpenAI Responses API (vLLM's), steered as chat is."""
        return await pipeline.handle(_state(request), request, endpoints.RESPONSES)

    @r.post("/messages", **_route(P.MessagesRequest, MessagesResponse, True))
    async def messages(request: Request) -> Response:
        """The Anthropic Messages API (vLLM's), steered as chat is."""
        return await pipeline.handle(_state(request), request, endpoints.MESSAGES)

    r.include_router(_tokenize_router(""))
    r.include_router(_steering_router())
    return r


def _steering_router() -> APIRouter:
    """``/v1/steering/...``: the vectors served (listed, loaded by an admin) and feedback."""
    r = APIRouter()

    @r.get(
        "/steering/vectors",
        response_model=None,
        responses={200: {"model": VectorListing}, 401: ERRORS[401]},
    )
    async def list_vectors(request: Request) -> dict[str, Any]:
        return vectors.listing(_state(request))

    feedback = _route(P.FeedbackRequest, P.FeedbackAnswer)
    feedback["responses"] |= {
        404: {"model": ErrorResponse, "description": "no answer of the experiment has this id"},
        409: {"model": ErrorResponse, "description": "the server keeps no decision log"},
        429: {"model": ErrorResponse, "description": "this answer was scored 5 times already"},
        503: {
            "model": ErrorResponse,
            "description": "the decision log could not be written, or the experiment store "
            "is unreachable",
        },
    }

    @r.post("/steering/feedback", response_model=None, **feedback)
    async def steering_feedback(request: Request) -> dict[str, Any]:
        """Join an outcome (thumbs up, task success) to the A/B arm of an answer."""
        s = _state(request)
        call = request.state.call = pipeline.Call("feedback")
        req = await read_request(request, P.FeedbackRequest, s.settings.max_body_bytes)
        out = await ab_service.feedback_joined(s.decisions, req.id, req.score, req.metric)
        pipeline.finish(s, call, 200, timed=False)
        return out

    admin = _route(P.VectorLoadRequest, VectorListing)
    admin["responses"] |= {
        403: {"model": ErrorResponse, "description": ADMIN_REFUSED},
        409: {"model": ErrorResponse, "description": "same name/version, other data"},
        422: {"model": ErrorResponse, "description": "the artifact fails verification"},
    }

    @r.post(
        "/steering/vectors", response_model=None, dependencies=[Depends(require_admin)], **admin
    )
    async def load_vectors(request: Request) -> dict[str, Any]:
        s = _state(request)
        call = request.state.call = pipeline.Call("vectors")
        req = await read_request(request, VectorLoadRequest, s.settings.max_body_bytes)
        out = await vectors.load_named(s, req.name, req.default)
        pipeline.finish(s, call, 200, timed=False)
        return out

    return r
