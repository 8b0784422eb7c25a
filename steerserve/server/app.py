"""The OpenAI-compatible FastAPI app: factory, lifespan (engine in the background), routes, errors
(server state in ``state.py``, the SSE streams in ``streaming.py``).

Every request is validated in full (body, model, prompt length, steering) before it reaches the
engine, so bad input is a 4xx in OpenAI's format and never a 500 or a silently unsteered answer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from steerserve.engine.api import UNSTEERED, Prepared
from steerserve.server import protocol as P
from steerserve.server.engine import collect, engine_error, load_artifacts, prime
from steerserve.server.policy import Decision
from steerserve.server.protocol import ApiError
from steerserve.server.state import Call, ServerSettings, ServerState, default_first
from steerserve.server.streaming import chat_stream, completion_stream, stream_response

__all__ = ["ServerSettings", "create_app"]

logger = logging.getLogger("steerserve.server")

HEADER = "x-steerserve-steering"
_ARTIFACT_REF = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99}(/[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99})?$"
)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


# --- helpers ------------------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.steer


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (before reading it when announced)."""
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


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (aborting generation) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the request is gone either way
        pass
    raise ClientGone


def _json(model: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(model.model_dump_json(), media_type="application/json", headers=headers)


# --- auth ---------------------------------------------------------------------------------------


async def require_key(request: Request) -> None:
    key = _state(request).settings.api_key
    if not key:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip(), key):
        raise ApiError(
            "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
            status=401,
            code="invalid_api_key",
        )


# --- app ----------------------------------------------------------------------------------------


def create_app(settings: ServerSettings) -> FastAPI:
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(state.load())
        try:
            yield
        finally:
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            await state.engine.shutdown()
            logger.info("engine shut down")

    app = FastAPI(title="steerserve", version="0.1.0", lifespan=lifespan)
    app.state.steer = state
    _errors(app)
    app.include_router(_ops_router())
    app.include_router(_v1_router(), dependencies=[Depends(require_key)])
    return app


def _errors(app: FastAPI) -> None:
    def record(request: Request, status: int) -> None:
        call: Call | None = getattr(request.state, "call", None)
        if call is not None:
            _state(request).finish(call, status, timed=False)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        record(request, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        param = P._param(tuple(err.get("loc", ()))[1:])
        return await api_error(request, ApiError(f"{param}: {err['msg']}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        typ = "invalid_request_error" if e.status_code < 500 else "server_error"
        err = ApiError(str(e.detail), status=e.status_code, type=typ)
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        record(request, 500)
        err = ApiError("internal server error", status=500, type="server_error")
        return JSONResponse(err.body(), status_code=500)


def _ops_router() -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness: 200 while the process serves (also while loading); 503 once the engine
        has died or failed to load, so an orchestrator restarts the process."""
        s = _state(request)
        if s.load_error is not None or (s.loaded and not s.engine.ready):
            return JSONResponse({"status": "engine dead"}, 503)
        return JSONResponse({"status": "ok"})

    @r.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Readiness: 200 once the engine is loaded, else 503."""
        s = _state(request)
        if s.ready:
            return JSONResponse({"status": "ready", "model": s.model_name})
        if s.load_error is not None:
            return JSONResponse({"status": "failed", "error": str(s.load_error)}, 503)
        return JSONResponse({"status": "dead" if s.loaded else "loading"}, 503)

    @r.get("/metrics")
    async def metrics(request: Request) -> Response:
        m = _state(request).metrics
        return Response(m.render(), media_type=m.content_type)

    return r


def _v1_router() -> APIRouter:
    r = APIRouter(prefix="/v1")

    @r.get("/models")
    async def models(request: Request) -> Response:
        s = _state(request)
        max_len = s.engine.max_model_len if s.ready else s.settings.engine.max_model_len
        card = P.ModelCard(
            id=s.model_name, created=s.created, root=s.model_name, max_model_len=max_len
        )
        return _json(P.ModelList(data=[card]))

    @r.post("/chat/completions")
    async def chat(request: Request) -> Response:
        return await _chat(request, ab=False)

    @r.post("/chat/completions/ab")
    async def chat_ab(request: Request) -> Response:
        return await _chat(request, ab=True)

    @r.post("/completions")
    async def completions(request: Request) -> Response:
        return await _completions(request)

    @r.get("/steering/vectors")
    async def list_vectors(request: Request) -> dict[str, Any]:
        return _vectors_listing(_state(request))

    @r.post("/steering/vectors")
    async def load_vectors(request: Request) -> dict[str, Any]:
        return await _load_vectors(request)

    return r


# --- chat ---------------------------------------------------------------------------------------


async def _chat(request: Request, ab: bool) -> Response:
    s = _state(request)
    call = request.state.call = Call("ab" if ab else "chat")
    req = P.parse_request(
        P.ChatCompletionRequest, await read_body(request, s.settings.max_body_bytes)
    )
    s.check(req.model)
    if ab and req.stream:
        raise ApiError("stream: the A/B endpoint does not stream", param="stream")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in req.messages
    ]
    try:
        ids = s.engine.chat_ids(messages)
    except Exception as e:  # a template that refuses the conversation (e.g. role order)
        raise ApiError(f"messages: the chat template refused them: {e}", param="messages") from None
    user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    decision, prepared = await s.steer(req.steering, user, force=ab)
    call.arm = "ab" if ab else ("steered" if prepared.steered else "unsteered")
    top = (req.top_logprobs or 0) if req.logprobs else None
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    if ab and req.seed is None:
        req.seed = random.randrange(2**31)  # both arms sample with the same seed
    sp = s.engine.sampling_params(req, len(ids), logprobs=top, output_kind=kind)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    info = decision.info(prepared.steered)
    headers = {HEADER: info.header()}
    if req.stream:
        gen = s.engine.generate(ids, sp, prepared, rid)
        first = await prime(gen)
        body = chat_stream(s, call, req, rid, gen, first, info, len(ids), top or 0)
        return stream_response(body, headers)

    async def one(p: Prepared, d: Decision, arm: str, rid: str) -> P.ChatCompletion:
        out = await collect(s.engine.generate(ids, sp, p, rid))
        return _chat_completion(s, rid, req.model, out, d.info(p.steered), arm, top or 0)

    s.metrics.queue_depth.inc()
    try:
        if not ab:
            arm = call.arm
            res: BaseModel = await until_disconnect(request, one(prepared, decision, arm, rid))
        else:
            off = Decision("off")

            async def both() -> tuple[P.ChatCompletion, P.ChatCompletion]:
                async with asyncio.TaskGroup() as tg:
                    a = tg.create_task(one(UNSTEERED, off, "unsteered", rid + "-a"))
                    b = tg.create_task(one(prepared, decision, "steered", rid + "-b"))
                return a.result(), b.result()

            un, st = await until_disconnect(request, both())
            same = [c.message.content for c in un.choices] == [
                c.message.content for c in st.choices
            ]
            res = P.ABResponse(unsteered=un, steered=st, identical=same)
    except ClientGone:
        s.finish(call, 499)
        return Response(status_code=499)
    except Exception as e:
        raise engine_error(e) from None
    finally:
        s.metrics.queue_depth.dec()
    s.finish(call, 200)
    return _json(res, headers)


def _chat_completion(
    s: ServerState, rid: str, model: str, out: Any, info: P.SteeringInfo, arm: str, top: int
) -> P.ChatCompletion:
    tok = s.engine.tokenizer
    choices = [
        P.ChatChoice(
            index=o.index,
            message=P.AssistantMessage(content=o.text),
            logprobs=P.chat_logprobs(list(o.token_ids), o.logprobs, top, tok),
            finish_reason=o.finish_reason,
        )
        for o in sorted(out.outputs, key=lambda o: o.index)
    ]
    prompt, completion = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    s.metrics.count_tokens(arm, prompt, completion)
    return P.ChatCompletion(
        id=rid,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=P.Usage.of(prompt, completion),
        steering=info,
    )


# --- completions --------------------------------------------------------------------------------


async def _completions(request: Request) -> Response:
    s = _state(request)
    call = request.state.call = Call("completions")
    req = P.parse_request(P.CompletionRequest, await read_body(request, s.settings.max_body_bytes))
    s.check(req.model)
    if req.echo and req.logprobs is not None:
        raise ApiError("echo: cannot be combined with logprobs", param="echo")
    prompts, texts = _completion_prompts(s, req.prompt)
    decision, prepared = await s.steer(req.steering, "\n".join(texts))
    call.arm = "steered" if prepared.steered else "unsteered"
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    sps = [
        s.engine.sampling_params(req, len(ids), logprobs=req.logprobs, output_kind=kind)
        for ids in prompts
    ]
    rid = f"cmpl-{uuid.uuid4().hex}"
    info = decision.info(prepared.steered)
    headers = {HEADER: info.header()}
    gens = [
        s.engine.generate(ids, sp, prepared, f"{rid}-{i}")
        for i, (ids, sp) in enumerate(zip(prompts, sps, strict=True))
    ]
    if req.stream:
        firsts = []
        for g in gens:
            try:
                firsts.append(await prime(g))
            except ApiError:
                for other in gens:
                    await other.aclose()
                raise
        body = completion_stream(s, call, req, rid, gens, firsts, info, prompts, texts)
        return stream_response(body, headers)

    async def run() -> list[Any]:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(collect(g)) for g in gens]
        return [t.result() for t in tasks]

    s.metrics.queue_depth.inc()
    try:
        outs = await until_disconnect(request, run())
    except ClientGone:
        s.finish(call, 499)
        return Response(status_code=499)
    except Exception as e:
        raise engine_error(e) from None
    finally:
        s.metrics.queue_depth.dec()
    tok, choices, completion = s.engine.tokenizer, [], 0
    for i, out in enumerate(outs):
        for o in sorted(out.outputs, key=lambda o: o.index):
            completion += len(o.token_ids)
            prefix = texts[i] if req.echo else ""
            lp = P.completion_logprobs(list(o.token_ids), o.logprobs, req.logprobs or 0, tok)
            choices.append(
                P.CompletionChoice(
                    index=i * req.n + o.index,
                    text=prefix + o.text,
                    logprobs=lp,
                    finish_reason=o.finish_reason,
                )
            )
    prompt_tokens = sum(len(ids) for ids in prompts)
    s.metrics.count_tokens(call.arm, prompt_tokens, completion)
    s.finish(call, 200)
    res = P.Completion(
        id=rid,
        created=int(time.time()),
        model=req.model,
        choices=choices,
        usage=P.Usage.of(prompt_tokens, completion),
        steering=info,
    )
    return _json(res, headers)


MAX_PROMPTS = 128


def _completion_prompts(
    s: ServerState, p: str | list[str] | list[int] | list[list[int]]
) -> tuple[list[list[int]], list[str]]:
    """Token ids and texts of a completions ``prompt`` (a string, strings, ids or lists of ids);
    ids are checked against the vocabulary before anything decodes them."""
    if isinstance(p, str):
        p = [p]
    elif p and all(isinstance(x, int) for x in p):
        p = [p]  # type: ignore[list-item]
    if not p:
        raise ApiError("prompt: must not be empty", param="prompt")
    if len(p) > MAX_PROMPTS:
        raise ApiError(f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")
    if isinstance(p[0], str):
        texts = list(p)  # type: ignore[arg-type]
        try:
            return [s.engine.encode(t) for t in texts], texts
        except Exception as e:  # e.g. a lone surrogate the tokenizer cannot encode
            raise ApiError(f"prompt: cannot be tokenized: {e}", param="prompt") from None
    prompts = [list(x) for x in p]  # type: ignore[arg-type]
    for ids in prompts:
        s.engine.check_ids(ids, "prompt")
    return prompts, [s.engine.decode(ids) for ids in prompts]


# --- steering vectors (admin) -------------------------------------------------------------------


def _vectors_listing(s: ServerState) -> dict[str, Any]:
    return {
        "object": "list",
        "default": s.policy.default_artifact,
        "policy": s.policy.default,
        "data": [
            {
                "id": key,
                "name": a.name,
                "version": a.version,
                "default": key == s.policy.default_artifact,
                "interventions": sorted(a.interventions),
                "manifest": a.manifest,
            }
            for key, a in s.policy.artifacts.items()
        ],
    }


async def _load_vectors(request: Request) -> dict[str, Any]:
    s = _state(request)
    call = request.state.call = Call("vectors")
    req = P.parse_request(P.VectorLoadRequest, await read_body(request, s.settings.max_body_bytes))
    if not s.ready:
        raise ApiError("the engine is still loading", status=503, type="service_unavailable")
    if not _ARTIFACT_REF.match(req.name) or ".." in req.name:
        raise ApiError(
            "name: must be an artifact name, optionally /version (never a path)", param="name"
        )
    if not s.engine.cfg.steering:
        raise ApiError("this server was built without the steering plugin", param="name")
    name, _, version = req.name.partition("/")
    arts = await asyncio.to_thread(load_artifacts, s.settings.vectors_dir, s.settings.engine.model)
    found = [
        a
        for a in arts
        if a.manifest.name == name and (not version or a.manifest.version == version)
    ]
    if not found:
        raise ApiError(
            f"name: no artifact {req.name!r} for this model in the vectors directory",
            status=404,
            param="name",
            code="artifact_not_found",
        )
    art = default_first(found)[0]
    try:
        loaded = await s.add_artifact(art, make_default=req.default)
    except ValueError as e:  # same name/version, other data: artifacts are immutable
        raise ApiError(str(e), status=409, param="name", code="conflict") from None
    s.finish(call, 200, timed=False)
    logger.info("loaded artifact %s (default: %s)", loaded.key, s.policy.default_artifact)
    return {"loaded": loaded.key, **_vectors_listing(s)}
