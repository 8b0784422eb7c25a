"""The OpenAI-compatible FastAPI app: factory, lifespan (engine in the background), routes, errors.

Every request is validated in full (body, model, prompt length, steering) before it reaches the
engine, so bad input is a 4xx in OpenAI's format and never a 500 or a silently unsteered answer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import secrets
import signal
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from steerserve.engine.api import UNSTEERED, EngineConfig, Prepared
from steerserve.server import protocol as P
from steerserve.server.engine import (
    ServingEngine,
    chained,
    collect,
    engine_error,
    load_artifacts,
    merge,
    prime,
)
from steerserve.server.metrics import Metrics
from steerserve.server.policy import MODES, Decision, LoadedArtifact, SteeringPolicy
from steerserve.server.protocol import ApiError

logger = logging.getLogger("steerserve.server")

HEADER = "x-steerserve-steering"
_ARTIFACT_REF = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99}(/[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,99})?$"
)
T = TypeVar("T")


@dataclass
class ServerSettings:
    """What ``steerserve serve`` configures (see ``cli.py`` for the options and variables)."""

    engine: EngineConfig
    vectors_dir: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    steering: str = "auto"  # default policy: off | on | auto
    max_body_bytes: int = 1 << 20
    exit_on_load_failure: bool = False  # the CLI: a server that cannot load should not idle


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Call:
    """Per-request bookkeeping read by the error handlers (metrics need endpoint and arm)."""

    endpoint: str
    arm: str = "none"
    t0: float = field(default_factory=time.perf_counter)


class ServerState:
    """The app's state: settings, engine, policy, metrics, readiness."""

    def __init__(self, settings: ServerSettings) -> None:
        if settings.steering not in MODES:
            raise ValueError(f"steering: {settings.steering!r} is not one of {', '.join(MODES)}")
        self.settings = settings
        self.engine = ServingEngine(settings.engine)
        self.policy = SteeringPolicy(
            self.engine.registry, settings.steering, settings.engine.max_abs_scale
        )
        self.metrics = Metrics()
        self.model_name = settings.served_model_name or Path(settings.engine.model).name
        self.load_error: BaseException | None = None
        self.created = int(time.time())
        self.loaded = False

    @property
    def ready(self) -> bool:
        return self.loaded and self.engine.ready

    # --- startup -----------------------------------------------------------------------------

    async def load(self) -> None:
        try:
            await self.engine.start()
            if self.engine.cfg.steering:
                arts = await asyncio.to_thread(
                    load_artifacts, self.settings.vectors_dir, self.settings.engine.model
                )
                for art in _default_first(arts):
                    await self.add_artifact(art)
            if self.policy.default_artifact is None and self.policy.default != "off":
                if self.policy.default == "on":
                    raise RuntimeError(
                        f"--steering on, but no artifact for this model under "
                        f"{self.settings.vectors_dir!r}"
                    )
                logger.warning("no steering artifact for this model: default policy is off")
                self.policy.default = "off"
            if self.policy.default_artifact is not None:
                await asyncio.to_thread(self.policy.detector.warm)
            self.loaded = True
            self.metrics.ready.set(1)
            logger.info(
                "ready: model %s, artifacts %s (default %s), policy %s",
                self.model_name,
                list(self.policy.artifacts),
                self.policy.default_artifact,
                self.policy.default,
            )
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.load_error = e
            logger.exception("engine failed to load")
            if self.settings.exit_on_load_failure:
                os.kill(os.getpid(), signal.SIGTERM)

    def finish(self, call: Call, status: int, timed: bool = True) -> None:
        """Count a finished request and log it (one structured line per request)."""
        seconds = time.perf_counter() - call.t0
        self.metrics.observe(call.endpoint, call.arm, status, seconds if timed else None)
        logger.info(
            "request endpoint=%s arm=%s status=%d ms=%.1f",
            call.endpoint,
            call.arm,
            status,
            seconds * 1e3,
        )

    async def add_artifact(self, art: Any, make_default: bool = False) -> LoadedArtifact:
        m = art.manifest
        for iv in m.interventions:
            await self.engine.register(m.vector_name(iv), art.tensors[iv.tensor], str(art.path))
        loaded = LoadedArtifact.from_artifact(art)
        self.policy.add(loaded, make_default)
        return loaded

    # --- per request -------------------------------------------------------------------------

    def check(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        if not self.ready:
            raise ApiError(
                "the engine is still loading" if self.load_error is None else "the engine failed",
                status=503,
                type="service_unavailable",
            )

    async def steer(self, raw: Any, text: str, force: bool = False) -> tuple[Decision, Prepared]:
        lang = None
        if self.policy.mode_of(raw) == "auto":
            try:
                lang = await asyncio.to_thread(self.policy.detector.detect, text)
            except Exception:  # undetectable text: "unsure", which auto treats as English
                lang = None
        decision = self.policy.resolve(raw, language=lang, force=force)
        try:
            prepared = self.engine.prepare(list(decision.entries) or None)
        except ValueError as e:
            msg = str(e)
            if decision.policy == "entries":
                msg = msg.replace("steering[", "steering.entries[", 1)
            param = msg.split(":", 1)[0] if ":" in msg else "steering"
            raise ApiError(msg, param=param) from None
        if force and not prepared.steered:
            raise ApiError("steering: the steered arm would not be steered", param="steering")
        return decision, prepared


def _default_first(arts: list[Any]) -> list[Any]:
    """Load order: by name, latest version first; the first one becomes the default."""
    from steerserve.artifacts import _version_key

    newest = sorted(arts, key=lambda a: _version_key(a.manifest.version), reverse=True)
    return sorted(newest, key=lambda a: a.manifest.name)


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


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


def _usage(prompt: int, completion: int) -> P.Usage:
    return P.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


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
        body = _chat_stream(s, call, req, rid, gen, first, info, len(ids), top or 0)
        return _stream_response(body, headers)

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
        usage=_usage(prompt, completion),
        steering=info,
    )


def _stream_response(body: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    headers = {**headers, "cache-control": "no-cache"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


def _chat_stream(
    s: ServerState,
    call: Call,
    req: P.ChatCompletionRequest,
    rid: str,
    gen: AsyncGenerator[Any, None],
    first: Any,
    info: P.SteeringInfo,
    prompt_len: int,
    top: int,
) -> AsyncIterator[str]:
    created, tok = int(time.time()), s.engine.tokenizer
    completion = [0]

    def chunk(choices: list[P.ChunkChoice], **kw: Any) -> str:
        c = P.ChatCompletionChunk(id=rid, created=created, model=req.model, choices=choices, **kw)
        return _sse(c)

    async def events() -> AsyncGenerator[str, None]:
        yield chunk(
            [
                P.ChunkChoice(index=i, delta=P.Delta(role="assistant", content=""))
                for i in range(req.n)
            ],
            steering=info,
        )
        async for out in chained(first, gen):
            for o in out.outputs:
                completion[0] += len(o.token_ids)
                lp = (
                    P.chat_logprobs(list(o.token_ids), o.logprobs, top, tok)
                    if req.logprobs
                    else None
                )
                if o.text or lp or o.finish_reason:
                    delta = P.Delta(content=o.text) if o.text else P.Delta()
                    yield chunk(
                        [
                            P.ChunkChoice(
                                index=o.index,
                                delta=delta,
                                logprobs=lp,
                                finish_reason=o.finish_reason,
                            )
                        ]
                    )
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=_usage(prompt_len, completion[0]), steering=info)

    return _guarded_stream(s, call, events(), [gen], prompt_len, completion)


async def _guarded_stream(
    s: ServerState,
    call: Call,
    events: AsyncGenerator[str, None],
    gens: list[AsyncGenerator[Any, None]],
    prompt_tokens: int,
    completion: list[int],
) -> AsyncIterator[str]:
    """The SSE tail both streaming endpoints share: ``[DONE]``, an engine error as a final
    OpenAI-format event, a client that went away counted as 499, and the engine requests closed,
    the queue gauge, token counters and request metrics settled whatever happened."""
    status = 200
    s.metrics.queue_depth.inc()
    try:
        async for event in events:
            yield event
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        status = 499  # the client went away: the engine requests are aborted below
        raise
    except Exception as e:
        err = engine_error(e)
        status = err.status
        yield f"data: {_json_dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        s.metrics.queue_depth.dec()
        await events.aclose()
        for g in gens:
            await g.aclose()
        s.metrics.count_tokens(call.arm, prompt_tokens, completion[0])
        s.finish(call, status)


def _json_dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"))


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
        body = _completion_stream(s, call, req, rid, gens, firsts, info, prompts, texts)
        return _stream_response(body, headers)

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
        usage=_usage(prompt_tokens, completion),
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


def _completion_stream(
    s: ServerState,
    call: Call,
    req: P.CompletionRequest,
    rid: str,
    gens: list[AsyncGenerator[Any, None]],
    firsts: list[Any],
    info: P.SteeringInfo,
    prompts: list[list[int]],
    texts: list[str],
) -> AsyncIterator[str]:
    created, tok = int(time.time()), s.engine.tokenizer
    completion = [0]
    offsets: dict[int, int] = {}
    prompt_tokens = sum(len(ids) for ids in prompts)

    def chunk(choices: list[P.CompletionChoice], **kw: Any) -> str:
        c = P.Completion(id=rid, created=created, model=req.model, choices=choices, **kw)
        return _sse(c)

    async def events() -> AsyncGenerator[str, None]:
        streams = [chained(f, g) for f, g in zip(firsts, gens, strict=True)]
        first_chunk = True
        if req.echo:
            for i, text in enumerate(texts):
                for j in range(req.n):
                    yield chunk([P.CompletionChoice(index=i * req.n + j, text=text)], steering=info)
            first_chunk = False
        async for i, out in merge(streams):  # type: ignore[arg-type]
            for o in out.outputs:
                idx = i * req.n + o.index
                completion[0] += len(o.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = P.completion_logprobs(
                        list(o.token_ids), o.logprobs, req.logprobs, tok, offsets.get(idx, 0)
                    )
                    offsets[idx] = offsets.get(idx, 0) + len(o.text)
                if o.text or lp or o.finish_reason or first_chunk:
                    c = P.CompletionChoice(
                        index=idx, text=o.text, logprobs=lp, finish_reason=o.finish_reason
                    )
                    yield chunk([c], steering=info if first_chunk else None)
                    first_chunk = False
        if req.stream_options and req.stream_options.include_usage:
            yield chunk([], usage=_usage(prompt_tokens, completion[0]), steering=info)

    return _guarded_stream(s, call, events(), gens, prompt_tokens, completion)


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
    art = _default_first(found)[0]
    try:
        loaded = await s.add_artifact(art, make_default=req.default)
    except ValueError as e:  # same name/version, other data: artifacts are immutable
        raise ApiError(str(e), status=409, param="name", code="conflict") from None
    s.finish(call, 200, timed=False)
    logger.info("loaded artifact %s (default: %s)", loaded.key, s.policy.default_artifact)
    return {"loaded": loaded.key, **_vectors_listing(s)}
