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

def run(merged=True, parsed=True, bounded=True, plain=False):
    """One stream of N chunks into a null send: stock's path with nothing on, then each piece
    steerserve's ``streaming._events`` adds (the pump and queue, parse-label-rewrite, the bounded
    write) and the pass-through of a plain stream's later chunks."""
    async def body():  # fresh state per stream, as each request gets
        ep, info, told, first = Completions(), {"steered": False}, set(), True
        async for _, ev in S.merge([gen()], Drain(), ended=lambda: None):
            if not parsed or (plain and not first and S._as_sent(ev)):
                yield ev
                continue
            b = event_json(ev)
            ep.label_chunk(b, "bench", info, first); first = False
            repeat(b, 1); ep.echo_chunk(b, [info], 1, told)
            yield ep.sse(b)

    async def go():
        content = body() if merged else gen()
        if bounded:
            r = S.BoundedStream(content, 30.0, lambda: None, media_type="text/event-stream")
        else:
            r = StreamingResponse(content, media_type="text/event-stream")
        await r.stream_response(null_send)
    return go

def timed(fn):
    best = 1e9
    for _ in range(3):
        t = time.process_time(); asyncio.run(fn()); best = min(best, time.process_time() - t)
    return best / N * 1e6

CASES = [("stock", run(merged=False, parsed=False, bounded=False)),
         ("+ pump/queue merge", run(parsed=False, bounded=False)),
         ("+ parse, label, re-dump", run(bounded=False)),
         ("+ bounded write", run()),
         ("all, later chunks as sent", run(plain=True))]
for name, fn in CASES:
    print(f"{name}: {timed(fn):.1f} us/chunk")
