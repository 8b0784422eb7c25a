"""The streamed answer: wait for every arm's first event (so a refusal is still a 4xx), then vLLM's
SSE with our ``steering`` and ``arm`` fields."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse
from starlette.types import Message, Send

from steerserve.server.drain import Drain
from steerserve.server.errors import ApiError
from steerserve.server.generate.endpoints import repeat
from steerserve.server.generate.flight import ClientGone, Flight, until_disconnect
from steerserve.server.generate.hosted import Plan, event_json, first_event
from steerserve.server.vllm_errors import engine_error, error_from_vllm

if TYPE_CHECKING:
    from steerserve.server.generate.context import Context
    from steerserve.server.generate.job import Job

logger = logging.getLogger("steerserve.server")


async def stream(job: Job, run_arms: Callable[[], Awaitable[list[Any]]]) -> Response:
    """Start every arm's serving stream and wait for its first event (it comes with the engine's
    first output), so engine-side refusals are still a proper 4xx (the stream's 200 is not sent
    yet) and a client gone meanwhile is a 499, then stream. The wait counts in the queue gauge
    (the flight counts it from the first event on): a stream waiting for its first token is
    queued, and an autoscaler keyed on the gauge must see it."""
    state, call, request, plans, gens = job.state, job.call, job.request, job.plans, job.gens

    async def started() -> tuple[list[AsyncIterator[str]], list[str | None]]:
        streams = await run_arms()
        firsts = [await first_event(s) for s in streams]
        for plan, first in zip(plans, firsts, strict=True):
            body = None if first is None else event_json(first)
            if isinstance(body, dict) and "error" in body:
                raise _error(plan, body["error"], state)
        return streams, firsts

    try:
        with state.metrics.queue_depth.track_inprogress():
            streams, firsts = await until_disconnect(request, started(), state.drain)
    except ClientGone:
        async with Flight(state, call, request, gens) as flight:
            raise ClientGone from None
        return Response(status_code=flight.status)
    except Exception as e:
        await _close(gens)
        raise engine_error(e, state.drain if state.stopping else None) from None
    headers = {**job.headers, "cache-control": "no-cache"}
    return BoundedStream(
        _events(job, streams, firsts),
        state.settings.stream_send_timeout_seconds,
        state.metrics.stream_stalls.inc,
        media_type="text/event-stream",
        headers=headers,
    )


class _Stalled(Exception):
    """One write of a stream waited longer than its bound for the client to read."""


class BoundedStream(StreamingResponse):
    """Starlette's stream, each write bounded: a client that stops reading (its socket's buffers
    full) blocks a write, and past ``send_timeout`` seconds the stream is cancelled (its events'
    generator closed: the engine requests aborted, the queued events freed) and ``on_stall``
    counts it. The connection is then closed by uvicorn, its unsent bytes at most the
    transport's buffer."""

    def __init__(
        self,
        content: AsyncIterator[str],
        send_timeout: float,
        on_stall: Callable[[], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout, self.on_stall = send_timeout, on_stall

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            try:
                async with asyncio.timeout(self.send_timeout):  # no task per write
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().stream_response(bounded)
        except _Stalled:
            self.on_stall()
            logger.warning(
                "stream cancelled: the client read nothing for %.0f s "
                "(--stream-send-timeout-seconds)",
                self.send_timeout,
            )
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _error(plan: Plan, err: dict[str, Any], state: Context) -> ApiError:
    """A stream's in-band error as ours: the engine call's own exception when the plan saw one
    (a steered distribution gone degenerate, the engine dying), else vLLM's message."""
    if plan.error is not None:
        return engine_error(plan.error, state.drain if state.stopping else None)
    return error_from_vllm(err)


async def _events(
    job: Job, streams: list[AsyncIterator[str]], firsts: list[str | None]
) -> AsyncIterator[str]:
    """vLLM's events of every arm, each chunk given its ``steering`` (the answer's on the first
    chunk and the usage chunk, a prompt's on its choices' first chunks) and, in an A/B stream, its
    ``arm``; one ``[DONE]``; an error as a final OpenAI-format event."""
    state, ep, req, plans, arms = job.state, job.ep, job.req, job.plans, job.arms
    infos, labels, n = job.infos, job.labels, getattr(job.req, "n", None) or 1
    told: list[set[int]] = [set() for _ in streams]
    first_chunk = [True for _ in streams]
    steering = [arm.info.model_dump(mode="json") for arm in arms]  # once, not per chunk
    # One choice, one copy, no arm label, the model vLLM names the one asked for: after its first
    # chunk an arm's events need no change but the usage chunk's label (most of a stream's
    # chunks: parsing and writing each again was the front end's main cost per token).
    simple = ep.plain and job.copies == 1 and all(len(i) * n == 1 for i in infos)
    plain = [False for _ in streams]
    async with Flight(state, job.call, job.request, job.gens) as flight:
        merged = merge(
            [_chained(f, s) for f, s in zip(firsts, streams, strict=True)],
            state.drain,
            # the engine's part is over: its seats are free, whatever the client still reads
            ended=lambda: state.seats.release(job.call.seats),
        )
        try:
            async for a, event in merged:
                if plain[a] and _as_sent(event):
                    yield event
                    continue
                body = event_json(event)
                if body is None:
                    continue  # each arm's [DONE]: one for the whole answer below
                if "error" in body:
                    err = _error(plans[a], body["error"], state)
                    flight.status = err.status
                    yield ep.sse(err.body())
                    continue
                if first_chunk[a]:  # its one choice here: echoed below, the rest pass
                    named = body.get("model") == req.model  # else a preset's id goes in each
                    plain[a] = simple and named and bool(body.get("choices")) and labels[a] is None
                # the preset's id when one was asked for, and the answer's steering
                ep.label_chunk(body, req.model, steering[a], first_chunk[a])
                first_chunk[a] = False
                repeat(body, job.copies)
                ep.echo_chunk(body, infos[a], n, told[a])
                if labels[a] is not None:
                    body["arm"] = labels[a]
                yield ep.sse(body)
            yield ep.done
            flight.delivered = True
        except Exception as e:
            yield ep.sse(flight.failed(e).body())
            yield ep.done
            flight.delivered = True
        finally:
            await merged.aclose()
            for plan in plans:
                for label, (prompt, completion) in plan.tokens.items():
                    flight.count(label, prompt, completion)


def _as_sent(event: str) -> bool:
    """A chunk of a plain stream that goes out as vLLM wrote it: not ``[DONE]`` (one for the
    whole answer), an error or the usage chunk (which carries the answer's ``steering``)."""
    return event.startswith("data: {") and '"usage"' not in event and '"error"' not in event


async def _chained(first: str | None, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``first`` (already awaited) followed by the rest of ``events``."""
    try:
        if first is not None:
            yield first
            async for ev in events:
                yield ev
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def _close(gens: list[AsyncGenerator]) -> None:
    for g in gens:
        await g.aclose()


async def merge(
    gens: list[AsyncIterator[Any]],
    drain: Drain | None = None,
    ended: Callable[[], None] | None = None,
) -> AsyncGenerator[tuple[int, Any], None]:
    """Interleave several engine streams, each read as fast as it produces (not as fast as the
    merge is read); closing the merge cancels (aborts) them all. ``ended`` is called once every
    stream has ended. At the ``drain``'s deadline it raises :class:`Dropped` (the stream's last
    event says so)."""
    if len(gens) == 1 and drain is None and ended is None:
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

    running = len(gens)

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        nonlocal running
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))
            running -= 1
            if running == 0 and ended is not None:
                ended()

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
