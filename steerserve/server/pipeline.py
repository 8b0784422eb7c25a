"""The one path of every generation request (chat, completions, A/B; streamed or collected):

check -> steer -> sampling params -> submit -> collect or stream -> finish.

What differs between endpoints (schema, prompts, answer shapes) is in ``endpoints.py``. The rest
is written once here: the checks before the engine sees anything, language detection and policy,
admission, and :class:`Flight`, which settles a submitted request whatever happens (the queue
gauge, the client going away, engine errors, closing engine requests, token and request metrics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from steerserve.engine.api import UNSTEERED, Prepared
from steerserve.engine.spec import SteeringError
from steerserve.server.backend import copies, engine_error
from steerserve.server.endpoints import ArmOutput, Endpoint, Prompts, sse
from steerserve.server.policy import OFF
from steerserve.server.protocol import ApiError, SteeringInfo, Usage, read_request
from steerserve.server.steering import SteeringSpec

if TYPE_CHECKING:
    from steerserve.server.state import ServerState

logger = logging.getLogger("steerserve.server")

HEADER = "x-steerserve-steering"
DONE = "data: [DONE]\n\n"
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Call:
    """Per-request bookkeeping, also read by the app's error handlers (metrics need the endpoint
    and the arm; ``arm`` stays "none" for a request refused before steering was decided)."""

    endpoint: str
    arm: str = "none"
    t0: float = field(default_factory=time.perf_counter)
    done: bool = False


@dataclass(frozen=True)
class Arm:
    """One steering arm of a request: what the engine gets and how the answer describes it."""

    label: str  # the metrics arm: steered | unsteered
    prepared: Prepared
    info: SteeringInfo
    suffix: str = ""  # of the response id (the A/B arms: -a, -b)


# --- finish -------------------------------------------------------------------------------------


def finish(state: ServerState, call: Call, status: int, timed: bool = True) -> None:
    """Count a finished request and log it (one structured line per request, once)."""
    if call.done:
        return
    call.done = True
    seconds = time.perf_counter() - call.t0
    state.metrics.observe(call.endpoint, call.arm, status, seconds if timed else None)
    logger.info(
        "request endpoint=%s arm=%s status=%d ms=%.1f",
        call.endpoint,
        call.arm,
        status,
        seconds * 1e3,
    )


def refused(request: Request, status: int) -> None:
    """For the app's error handlers: count a request refused with ``status`` (not timed)."""
    call: Call | None = getattr(request.state, "call", None)
    if call is not None:
        finish(request.app.state.steer, call, status, timed=False)


class Flight:
    """A submitted request until it is settled, collected or streamed alike: the queue gauge; the
    client going away (499, the engine requests aborted); an engine error as an API error; every
    engine request closed; tokens counted per arm; the request counted once."""

    def __init__(
        self, state: ServerState, call: Call, request: Request, gens: Sequence[AsyncGenerator]
    ) -> None:
        self.state, self.call, self.request, self.gens = state, call, request, gens
        self.status = 200
        self.tokens: dict[str, list[int]] = {}

    def count(self, arm: str, prompt: int, completion: int) -> None:
        t = self.tokens.setdefault(arm, [0, 0])
        t[0] += prompt
        t[1] += completion

    def failed(self, e: BaseException) -> ApiError:
        err = engine_error(e)
        self.status = err.status
        return err

    async def __aenter__(self) -> Flight:
        self.state.metrics.queue_depth.inc()
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool:
        gone = isinstance(e, (ClientGone, asyncio.CancelledError, GeneratorExit))
        err = None if e is None or gone else self.failed(e)
        try:
            if e is None and await client_gone(self.request):
                gone = True  # the answer was ready, but nobody is there to read it
        except asyncio.CancelledError:  # cancelled for the hang-up while looking for it
            gone = True
            raise
        finally:
            self._settle(499 if gone else self.status)
            # Closing aborts unfinished engine requests; a cancellation of this task (Starlette
            # cancels a stream's task group again at every await) must not stop it half-way.
            await asyncio.shield(asyncio.ensure_future(_close(self.gens)))
        if err is not None:
            raise err from None
        return isinstance(e, ClientGone)  # collected: answered 499 by the caller

    def _settle(self, status: int) -> None:
        self.status = status
        self.state.metrics.queue_depth.dec()
        for arm, (prompt, completion) in self.tokens.items():
            self.state.metrics.count_tokens(arm, prompt, completion)
        finish(self.state, self.call, status)


async def _close(gens: Sequence[AsyncGenerator]) -> None:
    for g in gens:
        await g.aclose()


# --- the path -----------------------------------------------------------------------------------


async def handle(state: ServerState, request: Request, ep: Endpoint) -> Response:
    """Check -> steer -> sampling params -> submit -> collect or stream -> finish."""
    call = request.state.call = Call(ep.name)
    req = await read_request(request, ep.schema, state.settings.max_body_bytes)
    check(state, req.model)
    ep.admit(req)
    backend = state.backend
    backend.check_size(*ep.size(req))
    prompts = await backend.off_loop(ep.prompts, req, backend.tokenizer, backend.vocab_size)
    arms = await steer(state, req.steering, prompts.language_text, ep.ab)
    call.arm = "ab" if ep.ab else arms[0].label
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    lp = ep.logprobs(req)
    params = [
        backend.sampling_params(req, len(ids), logprobs=lp, output_kind=kind) for ids in prompts.ids
    ]
    rid = f"{ep.id_prefix}-{uuid.uuid4().hex}"
    gens = [
        [
            backend.generate(ids, sp, arm.prepared, f"{rid}{arm.suffix}-{i}", copies(req))
            for i, (ids, sp) in enumerate(zip(prompts.ids, params, strict=True))
        ]
        for arm in arms
    ]
    headers = {HEADER: arms[-1].info.header()}
    if req.stream:
        [arm] = arms
        events = ep.events(req, prompts, rid, arm.info, backend.tokens)
        return await stream(state, call, request, arm, events, gens[0], prompts, headers)
    every = [g for per_arm in gens for g in per_arm]
    async with Flight(state, call, request, every) as flight:
        outs = await until_disconnect(request, collect_all(gens))
        usage = [_usage(out) for out in outs]
        for arm, u in zip(arms, usage, strict=True):
            flight.count(arm.label, u.prompt_tokens, u.completion_tokens)
    if flight.status == 499:
        return Response(status_code=499)
    answers = [
        ArmOutput(rid + a.suffix, a.info, out, u)
        for a, out, u in zip(arms, outs, usage, strict=True)
    ]
    body = ep.answer(req, prompts, answers, backend.tokens)
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


def check(state: ServerState, model: str) -> None:
    """The served model, and an engine ready to take it."""
    if model != state.model_name:
        raise ApiError(
            f"The model {model!r} does not exist; this server serves {state.model_name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    if not state.ready:
        raise ApiError(
            "the engine is still loading" if state.load_error is None else "the engine failed",
            status=503,
            type="service_unavailable",
        )


async def steer(state: ServerState, spec: SteeringSpec | None, text: str, ab: bool) -> list[Arm]:
    """The request's arms: detect the language when the steering is ``auto``, resolve the policy,
    admit its entries. A/B: the unsteered arm, then the steered one (which must be steered)."""
    lang = None
    if state.policy.detects(spec):
        try:
            lang = await asyncio.to_thread(state.detector.detect, text)
        except Exception:  # undetectable text: "unsure", which auto treats as English
            lang = None
    decision = state.policy.resolve(spec, language=lang, force=ab)
    try:
        prepared = state.backend.prepare(decision.entries or None, decision.field)
    except SteeringError as e:
        raise ApiError(str(e), param=e.field) from None
    if ab and not prepared.steered:
        raise ApiError("steering: the steered arm would not be steered", param="steering")
    label = "steered" if prepared.steered else "unsteered"
    arm = Arm(label, prepared, decision.info(prepared.steered))
    if not ab:
        return [arm]
    return [
        Arm("unsteered", UNSTEERED, OFF.info(False), "-a"),
        dataclasses.replace(arm, suffix="-b"),
    ]


# --- collect ------------------------------------------------------------------------------------


async def client_gone(request: Request) -> bool:
    """Whether the client has hung up. A hang-up that arrived while the event loop was busy is
    still queued as I/O: a few loop turns let the server see it before it is asked."""
    for _ in range(3):
        await asyncio.sleep(0)
    return await request.is_disconnected()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (aborting generation) and raise :class:`ClientGone` if the client
    disconnects first. Once a stream has started, Starlette cancels it on a hang-up."""
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


async def collect_all(gens: list[list[AsyncGenerator]]) -> list[list[Any]]:
    """The final output of every engine request (FINAL_ONLY streams), per arm and prompt."""

    async def last(gen: AsyncGenerator) -> Any:
        final = None
        async for out in gen:
            final = out
        return final

    async with asyncio.TaskGroup() as tg:
        tasks = [[tg.create_task(last(g)) for g in per_arm] for per_arm in gens]
    return [[t.result() for t in per_arm] for per_arm in tasks]


def _usage(outputs: Sequence[Any]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return Usage.of(prompt, sum(len(c.token_ids) for o in outputs for c in o.outputs))


# --- stream -------------------------------------------------------------------------------------


async def stream(
    state: ServerState,
    call: Call,
    request: Request,
    arm: Arm,
    events: Any,
    gens: list[AsyncGenerator],
    prompts: Prompts,
    headers: dict[str, str],
) -> Response:
    """Wait for every request's first output, so engine-side refusals are still a proper 4xx
    (the stream's 200 is not sent yet) and a client gone meanwhile is a 499, then stream."""
    try:
        firsts = await until_disconnect(request, first_outputs(gens))
    except ClientGone:
        async with Flight(state, call, request, gens) as flight:
            raise ClientGone from None
        return Response(status_code=flight.status)
    except Exception as e:
        for g in gens:
            await g.aclose()
        raise engine_error(e) from None
    body = _events(state, call, request, arm, events, gens, firsts, sum(map(len, prompts.ids)))
    headers = {**headers, "cache-control": "no-cache"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def first_outputs(gens: list[AsyncGenerator]) -> list[Any]:
    """The first output of every engine request (None for one that ended without any)."""
    firsts = []
    for g in gens:
        try:
            firsts.append(await g.__anext__())
        except StopAsyncIteration:
            firsts.append(None)
    return firsts


async def _events(
    state: ServerState,
    call: Call,
    request: Request,
    arm: Arm,
    events: Any,
    gens: list[AsyncGenerator],
    firsts: list[Any],
    prompt_tokens: int,
) -> AsyncIterator[str]:
    """The endpoint's events, ``[DONE]``, an engine error as a final OpenAI-format event."""
    async with Flight(state, call, request, gens) as flight:
        flight.count(arm.label, prompt_tokens, 0)
        merged = merge([_chained(f, g) for f, g in zip(firsts, gens, strict=True)])
        completion = 0
        try:
            for ev in events.head():
                yield ev
            async for i, out in merged:
                n = sum(len(o.token_ids) for o in out.outputs)
                completion += n
                flight.count(arm.label, 0, n)
                for ev in events.step(i, out):
                    yield ev
            for ev in events.tail(Usage.of(prompt_tokens, completion)):
                yield ev
            yield DONE
        except Exception as e:
            yield sse(flight.failed(e).body())
            yield DONE
        finally:
            await merged.aclose()


async def _chained(first: Any, gen: AsyncGenerator) -> AsyncIterator[Any]:
    """``first`` (already awaited) followed by the rest of ``gen``."""
    if first is not None:
        yield first
        async for out in gen:
            yield out


async def merge(gens: list[AsyncIterator[Any]]) -> AsyncGenerator[tuple[int, Any], None]:
    """Interleave several engine streams; closing the merge cancels (aborts) them all."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
