"""Server-sent-event streams for chat and completions.

Both endpoints share one tail (``guarded_stream``): ``[DONE]``, an engine error as a final
OpenAI-format event, a client that went away counted as 499, and the engine requests closed and the
metrics settled whatever happened.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from steerserve.server import protocol as P
from steerserve.server.engine import chained, engine_error, merge
from steerserve.server.state import Call, ServerState


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


def stream_response(body: AsyncIterator[str], headers: dict[str, str]) -> StreamingResponse:
    headers = {**headers, "cache-control": "no-cache"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


def chat_stream(
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
    """Chat chunks: the role, then content/logprob deltas, then usage if asked for."""
    created, tok = int(time.time()), s.engine.tokenizer
    completion = [0]  # completion tokens so far, read by the tail's metrics

    def chunk(choices: list[P.ChunkChoice], **kw: Any) -> str:
        c = P.ChatCompletionChunk(id=rid, created=created, model=req.model, choices=choices, **kw)
        return sse(c)

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
            yield chunk([], usage=P.Usage.of(prompt_len, completion[0]), steering=info)

    return guarded_stream(s, call, events(), [gen], prompt_len, completion)


async def guarded_stream(
    s: ServerState,
    call: Call,
    events: AsyncGenerator[str, None],
    gens: list[AsyncGenerator[Any, None]],
    prompt_tokens: int,
    completion: list[int],
) -> AsyncIterator[str]:
    """The SSE tail both streaming endpoints share: ``[DONE]``, an engine error as a final
    OpenAI-format event, a client that went away counted as 499, and the engine requests closed,
    the queue gauge, token counters and request metrics settled whatever happened.
    ``completion`` is a one-element counter that ``events`` keeps up to date."""
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
        yield f"data: {json_dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        s.metrics.queue_depth.dec()
        await events.aclose()
        for g in gens:
            await g.aclose()
        s.metrics.count_tokens(call.arm, prompt_tokens, completion[0])
        s.finish(call, status)


def json_dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def completion_stream(
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
    """Completion chunks of several prompts merged as they come (choice index = prompt * n +
    sample), echoed prompts first if asked for, then usage if asked for."""
    created, tok = int(time.time()), s.engine.tokenizer
    completion = [0]  # completion tokens so far, read by the tail's metrics
    offsets: dict[int, int] = {}
    prompt_tokens = sum(len(ids) for ids in prompts)

    def chunk(choices: list[P.CompletionChoice], **kw: Any) -> str:
        c = P.Completion(id=rid, created=created, model=req.model, choices=choices, **kw)
        return sse(c)

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
            yield chunk([], usage=P.Usage.of(prompt_tokens, completion[0]), steering=info)

    return guarded_stream(s, call, events(), gens, prompt_tokens, completion)
