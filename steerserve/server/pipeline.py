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
from steerserve.server.drain import Drain
from steerserve.server.endpoints import ArmOutput, Endpoint, Prompts, sse
from steerserve.server.experiment import SUBJECT_HEADER, UNENROLLED, header_subject
from steerserve.server.policy import OFF
from steerserve.server.protocol import (
    ApiError,
    ExperimentInfo,
    SteeringInfo,
    Usage,
    read_request,
)
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
    experiment: Enrolled | None = None  # under the server's A/B experiment
    tokens: tuple[int, int] = (0, 0)  # prompt, completion (all arms), once settled


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
    if call.experiment is not None:
        settle_experiment(state, call, status, seconds if timed else None)
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
        self.call.tokens = (
            sum(t[0] for t in self.tokens.values()),
            sum(t[1] for t in self.tokens.values()),
        )
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
    spec = enrol(state, request, req, ep)
    per_prompt = await steer_prompts(state, spec, prompts.language_texts, ep.ab)
    if call.experiment is not None:
        per_prompt = [[tagged(a, call.experiment.echo) for a in p] for p in per_prompt]
    arms = [summary([p[a] for p in per_prompt]) for a in range(len(per_prompt[0]))]
    call.arm = "ab" if ep.ab else arms[0].label
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    lp = ep.logprobs(req)
    params = [
        backend.sampling_params(req, len(ids), logprobs=lp, output_kind=kind) for ids in prompts.ids
    ]
    rid = f"{ep.id_prefix}-{uuid.uuid4().hex}"
    await decide(state, call, rid, arms[0], prompts)
    gens = [
        [
            backend.generate(
                ids, sp, per_prompt[i][a].prepared, f"{rid}{arm.suffix}-{i}", copies(req)
            )
            for i, (ids, sp) in enumerate(zip(prompts.ids, params, strict=True))
        ]
        for a, arm in enumerate(arms)
    ]
    headers = {HEADER: arms[-1].info.header()}
    if req.stream:
        if ep.ab:  # one prompt, two arms: streamed like two prompts of the same ids
            labels, infos = [a.label for a in arms], [a.info for a in arms]
            units, prompts = [g for [g] in gens], dataclasses.replace(prompts, ids=prompts.ids * 2)
        else:
            labels, infos = [p[0].label for p in per_prompt], [p[0].info for p in per_prompt]
            units = gens[0]
        events = ep.events(req, prompts, rid, arms[-1].info, backend.tokens, infos)
        return await stream(state, call, request, labels, events, units, prompts, headers)
    every = [g for per_arm in gens for g in per_arm]
    async with Flight(state, call, request, every) as flight:
        outs = await until_disconnect(request, collect_all(gens), state.drain)
        for a, per_arm in enumerate(outs):
            for p, out in zip(per_prompt, per_arm, strict=True):
                u = _usage([out])
                flight.count(p[a].label, u.prompt_tokens, u.completion_tokens)
        if call.experiment is not None and call.experiment.replies is not None:
            for i, out in enumerate(outs[0]):
                call.experiment.replies.update({(i, c.index): c.text for c in out.outputs})
    if flight.status == 499:
        return Response(status_code=499)
    answers = [
        ArmOutput(rid + arm.suffix, arm.info, out, _usage(out), [p[a].info for p in per_prompt])
        for a, (arm, out) in enumerate(zip(arms, outs, strict=True))
    ]
    body = ep.answer(req, prompts, answers, backend.tokens)
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


def check(state: ServerState, model: str) -> None:
    """The served model, and an engine ready to take it (not one past its drain deadline)."""
    if state.drain.dropping:
        raise state.drain.error()
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


async def steer_prompts(
    state: ServerState, spec: SteeringSpec | None, texts: list[str], ab: bool
) -> list[list[Arm]]:
    """Per prompt, its arms: ``auto`` decides each prompt by its own language (a batch of an
    English and a French prompt steers the French one only); other steering decides once."""
    if not state.policy.detects(spec):
        return [await steer(state, spec, "", ab)] * len(texts)
    decided: dict[str, list[Arm]] = {}
    for text in texts:
        if text not in decided:
            decided[text] = await steer(state, spec, text, ab)
    return [decided[t] for t in texts]


def summary(arms: list[Arm]) -> Arm:
    """One arm standing for the same arm of every prompt (labels, header and the answer's
    ``steering``): itself when all agree; otherwise steered when any prompt is, with the
    interventions of a steered prompt and no single detected language."""
    first = arms[0]
    if all(a.info == first.info for a in arms):
        return first
    steered = [a for a in arms if a.prepared.steered]
    model = steered[0] if steered else first
    info = model.info.model_copy(update={"detected_language": None})
    return dataclasses.replace(model, info=info)


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


# --- the A/B experiment ------------------------------------------------------------------------


@dataclass
class Enrolled:
    """A request under the server's A/B experiment: its ``experiment`` echo and, when enrolled,
    what the decision log gets once it is answered (``replies`` only with --ab-log-content)."""

    echo: ExperimentInfo
    rid: str = ""
    decision: dict[str, Any] | None = None
    replies: dict[tuple[int, int], str] | None = None  # (prompt, choice) -> text

    def add_replies(self, i: int, out: Any) -> None:
        """A streamed step's text deltas of prompt ``i``."""
        assert self.replies is not None
        for c in out.outputs:
            self.replies[i, c.index] = self.replies.get((i, c.index), "") + c.text


def enrol(state: ServerState, request: Request, req: Any, ep: Endpoint) -> SteeringSpec | None:
    """The steering under the A/B experiment: a request without ``steering`` and with a subject
    (its ``user``, else the subject header) gets its arm's; one without a subject is served as
    before, marked un-enrolled. Explicit steering and the A/B endpoint are left alone."""
    exp = state.experiment
    if exp is None or ep.ab or req.steering is not None:
        return req.steering
    call: Call = request.state.call
    subject = req.user
    if not subject and (raw := request.headers.get(SUBJECT_HEADER)):
        try:
            subject = header_subject(raw)
        except ValueError as e:
            raise ApiError(str(e), param=SUBJECT_HEADER) from None
    if not subject:
        call.experiment = Enrolled(ExperimentInfo(name=exp.name, arm=UNENROLLED))
        return None
    a = exp.assign(subject)
    call.experiment = Enrolled(ExperimentInfo(**a.echo()))
    return exp.steering(a.arm, state.settings.steering)


def tagged(arm: Arm, echo: ExperimentInfo) -> Arm:
    return dataclasses.replace(arm, info=arm.info.model_copy(update={"experiment": echo}))


async def decide(state: ServerState, call: Call, rid: str, arm: Arm, prompts: Prompts) -> None:
    """An enrolled request's decision, logged when it is answered. The language is detected for
    both arms (``auto`` already did for the steered one), so the report compares like with like."""
    ab = call.experiment
    if ab is None or ab.echo.arm == UNENROLLED:
        return
    info, text = arm.info, "\n".join(prompts.language_texts)
    lang = info.detected_language
    if lang is None:
        try:
            lang = await asyncio.to_thread(state.detector.detect, text)
        except Exception:  # undetectable text
            lang = None
    ab.rid = rid
    ab.replies = {} if state.decisions.log.content else None
    ab.decision = {
        "experiment": ab.echo.name,
        "arm": ab.echo.arm,
        "subject_hash": ab.echo.subject_hash,
        "endpoint": call.endpoint,
        "model": state.model_name,
        "language": lang,
        "applied": info.applied,
        "vectors": [iv.vector for iv in info.interventions],
        "prompt": prompts.texts,  # dropped unless --ab-log-content
    }


def settle_experiment(state: ServerState, call: Call, status: int, seconds: float | None) -> None:
    """Metrics by experiment and arm; an answered enrolled request goes to the decision log (a
    failed write is counted there, never the request's failure)."""
    ab = call.experiment
    assert ab is not None
    state.metrics.observe_ab(ab.echo.name, ab.echo.arm, status, seconds, call.tokens)
    if ab.decision is None or status != 200:
        return
    record = {
        **ab.decision,
        "latency_ms": None if seconds is None else round(seconds * 1e3, 1),
        "prompt_tokens": call.tokens[0],
        "completion_tokens": call.tokens[1],
    }
    if ab.replies is not None:
        record["reply"] = [ab.replies[k] for k in sorted(ab.replies)]
    state.decisions.record(ab.rid, record)


# --- collect ------------------------------------------------------------------------------------


async def client_gone(request: Request) -> bool:
    """Whether the client has hung up. A hang-up that arrived while the event loop was busy is
    still queued as I/O: a few loop turns let the server see it before it is asked."""
    for _ in range(3):
        await asyncio.sleep(0)
    return await request.is_disconnected()


async def until_disconnect(request: Request, work: Awaitable[T], drain: Drain) -> T:
    """Run ``work``; cancel it (aborting generation) and raise :class:`ClientGone` if the client
    disconnects first, or the drain's :class:`Dropped` at its deadline. Cancelled itself, it
    cancels ``work`` before going (else ``work`` reads engine streams that are being closed).
    Once a stream has started, Starlette cancels it on a hang-up."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    dropper = asyncio.ensure_future(drain.wait())
    try:
        await asyncio.wait({task, watcher, dropper}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel(task)
        raise
    finally:
        watcher.cancel()
        dropper.cancel()
    if task.done():
        return task.result()
    await _cancel(task)
    if drain.dropping:
        raise drain.error()
    raise ClientGone


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has stopped (whatever it raises: its request is gone)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


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
    labels: list[str],
    events: Any,
    gens: list[AsyncGenerator],
    prompts: Prompts,
    headers: dict[str, str],
) -> Response:
    """Wait for every request's first output, so engine-side refusals are still a proper 4xx
    (the stream's 200 is not sent yet) and a client gone meanwhile is a 499, then stream."""
    try:
        firsts = await until_disconnect(request, first_outputs(gens), state.drain)
    except ClientGone:
        async with Flight(state, call, request, gens) as flight:
            raise ClientGone from None
        return Response(status_code=flight.status)
    except Exception as e:
        for g in gens:
            await g.aclose()
        raise engine_error(e) from None
    body = _events(state, call, request, labels, events, gens, firsts, prompts)
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
    labels: list[str],
    events: Any,
    gens: list[AsyncGenerator],
    firsts: list[Any],
    prompts: Prompts,
) -> AsyncIterator[str]:
    """The endpoint's events, ``[DONE]``, an engine error as a final OpenAI-format event
    (tokens counted under each prompt's arm ``labels``)."""
    prompt_tokens = sum(map(len, prompts.ids))
    async with Flight(state, call, request, gens) as flight:
        for label, ids in zip(labels, prompts.ids, strict=True):
            flight.count(label, len(ids), 0)
        merged = merge([_chained(f, g) for f, g in zip(firsts, gens, strict=True)], state.drain)
        completion = 0
        try:
            for ev in events.head():
                yield ev
            async for i, out in merged:
                n = sum(len(o.token_ids) for o in out.outputs)
                completion += n
                flight.count(labels[i], 0, n)
                if call.experiment is not None and call.experiment.replies is not None:
                    call.experiment.add_replies(i, out)
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


async def merge(
    gens: list[AsyncIterator[Any]], drain: Drain | None = None
) -> AsyncGenerator[tuple[int, Any], None]:
    """Interleave several engine streams; closing the merge cancels (aborts) them all. At the
    ``drain``'s deadline it raises :class:`Dropped` (the stream's last event says so)."""
    if len(gens) == 1 and drain is None:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()
    if drain is not None:
        stopper = asyncio.ensure_future(drain.wait())
        stopper.add_done_callback(
            lambda t: None if t.cancelled() else queue.put_nowait((-1, drain.error()))
        )

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
        if drain is not None:
            stopper.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
