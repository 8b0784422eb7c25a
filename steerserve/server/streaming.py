"""The streamed answer of a generation request: wait for every engine request's first output
(so an engine refusal is still a 4xx), then the endpoint's server-sent events, interleaving
several engine streams (prompts or A/B arms), ending in ``[DONE]`` or an error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from steerserve.server.answers import Usage, cached_tokens
from steerserve.server.backend import engine_error
from steerserve.server.drain import Drain
from steerserve.server.events import Prompts, sse
from steerserve.server.flight import Call, ClientGone, Flight, until_disconnect

if TYPE_CHECKING:
    from steerserve.server.state import ServerState

DONE = "data: [DONE]\n\n"


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
    (the stream's 200 is not sent yet) and a client gone meanwhile is a 499, then stream. The
    wait counts in the queue gauge (the flight counts it from the first output on): a stream
    waiting for its first token is queued, and an autoscaler keyed on the gauge must see it."""
    try:
        with state.metrics.queue_depth.track_inprogress():
            firsts = await until_disconnect(request, first_outputs(gens), state.drain)
    except ClientGone:
        async with Flight(state, call, request, gens) as flight:
            raise ClientGone from None
        return Response(status_code=flight.status)
    except Exception as e:
        for g in gens:
            await g.aclose()
        raise engine_error(e, state.drain if state.stopping else None) from None
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
            for ev in events.tail(Usage.of(prompt_tokens, completion, cached_tokens(firsts))):
                yield ev
            yield DONE
            flight.delivered = True
        except Exception as e:
            yield sse(flight.failed(e).body())
            yield DONE
            flight.delivered = True
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
