"""Front-end CPU per streamed chunk: stock's path (vLLM's generator straight into Starlette's stream)
against steerserve's (pump + queue merge, parse, label, re-dump, bounded write), piece by piece."""
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".")
from starlette.responses import StreamingResponse
from steerserve.server.drain import Drain
from steerserve.server.generate import streaming as S
from steerserve.server.generate.endpoints import Completions, repeat
from steerserve.server.generate.hosted import event_json

N = 20000
CHUNK = {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion", "created": 1765000000,
         "model": "bench", "choices": [{"index": 0, "text": " the", "logprobs": None, "finish_reason": None,
         "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}]}
EV = f"data: {json.dumps(CHUNK)}\n\n"

async def gen():
    for _ in range(N):
        yield EV
        await asyncio.sleep(0)  # the engine's output arrives from another task

async def null_send(msg):
    return None

def scope():
    return {"type": "http"}

async def run_stock():
    r = StreamingResponse(gen(), media_type="text/event-stream")
    await r.stream_response(null_send)

async def run_merge_only():
    d = Drain()
    async def body():
        async for _, ev in S.merge([gen()], d, ended=lambda: None):
            yield ev
    r = StreamingResponse(body(), media_type="text/event-stream")
    await r.stream_response(null_send)

async def run_parse():
    d = Drain(); ep = Completions(); info = {"steered": False}; told = set(); first = True
    async def body():
        nonlocal first
        async for _, ev in S.merge([gen()], d, ended=lambda: None):
            b = event_json(ev)
            ep.label_chunk(b, "bench", info, first); first = False
            repeat(b, 1); ep.echo_chunk(b, [info], 1, told)
            yield ep.sse(b)
    r = StreamingResponse(body(), media_type="text/event-stream")
    await r.stream_response(null_send)

async def run_full():
    d = Drain(); ep = Completions(); info = {"steered": False}; told = set(); first = True
    async def body():
        nonlocal first
        async for _, ev in S.merge([gen()], d, ended=lambda: None):
            b = event_json(ev)
            ep.label_chunk(b, "bench", info, first); first = False
            repeat(b, 1); ep.echo_chunk(b, [info], 1, told)
            yield ep.sse(b)
    r = S.BoundedStream(body(), 30.0, lambda: None, media_type="text/event-stream")
    await r.stream_response(null_send)

async def run_plain():
    d = Drain(); ep = Completions(); info = {"steered": False}; told = set(); first = True
    async def body():
        nonlocal first
        async for _, ev in S.merge([gen()], d, ended=lambda: None):
            if not first and S._as_sent(ev):
                yield ev
                continue
            b = event_json(ev)
            ep.label_chunk(b, "bench", info, first); first = False
            repeat(b, 1); ep.echo_chunk(b, [info], 1, told)
            yield ep.sse(b)
    r = S.BoundedStream(body(), 30.0, lambda: None, media_type="text/event-stream")
    await r.stream_response(null_send)

def timed(fn):
    best = 1e9
    for _ in range(3):
        t = time.process_time(); asyncio.run(fn()); best = min(best, time.process_time() - t)
    return best / N * 1e6

base = timed(run_stock)
print(f"stock: {base:.1f} us/chunk")
for name, fn in [("+ pump/queue merge", run_merge_only), ("+ parse, label, re-dump", run_parse), ("+ bounded write", run_full), ("all, later chunks as sent", run_plain)]:
    print(f"{name}: {timed(fn):.1f} us/chunk")
