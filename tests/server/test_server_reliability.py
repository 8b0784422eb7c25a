"""The server under concurrent and careless clients, over real HTTP: seeded requests whose prefill
is split across engine steps, A/B calls in parallel, clients that hang up at any moment, huge
prompts. The engine here splits every prompt longer than 64 tokens (``max_num_batched_tokens``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server import (
    AUTH,
    KEY,
    MODEL,
    Server,
    chat_body,
    make_artifact,
    metric,
    tiny_server,
    wait_until,
    wrap_generate,
)

LONG = "Quelle est la capitale de la France ? " * 8  # ~300 byte tokens: 5 prefill steps


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    vectors = tmp_path_factory.mktemp("vectors")
    make_artifact(vectors, tiny_llama, "v1")
    with tiny_server(tiny_llama, vectors, {"max_num_batched_tokens": 64}) as srv:
        yield srv


async def _burst(server: Server, calls: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=server.url, headers=AUTH, timeout=300, limits=limits
    ) as c:
        return await asyncio.gather(*(c.post(path, json=body) for path, body in calls))


def _completion(i: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": f"{i} {LONG}",
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "steering": i % 2 == 0,
    }


def test_concurrent_seeded_long_prompts_and_ab_calls_all_answer(
    server: Server, http: httpx.Client
) -> None:
    """Seeded requests whose prefill spans several steps, and A/B calls (which seed both arms),
    all at once: every one answers 200 with the answer it gets alone, and the engine lives."""
    completions = [("/v1/completions", _completion(i)) for i in range(8)]
    ab = [("/v1/chat/completions/ab", chat_body(f"{i} {LONG}", temperature=0.9)) for i in range(8)]
    together = asyncio.run(_burst(server, completions + ab))
    assert [r.status_code for r in together] == [200] * 16, [r.text for r in together]
    assert http.get("/health").status_code == 200
    for (path, body), r in zip(completions, together, strict=False):
        solo = http.post(path, json=body)
        assert solo.status_code == 200, solo.text
        assert solo.json()["choices"] == r.json()["choices"]
    seeded_ab = chat_body(LONG, temperature=0.9, seed=3)
    solo_ab = http.post("/v1/chat/completions/ab", json=seeded_ab).json()
    again = asyncio.run(_burst(server, [("/v1/chat/completions/ab", seeded_ab)] * 4))
    for r in again:
        for arm in ("unsteered", "steered"):
            assert r.json()[arm]["choices"] == solo_ab[arm]["choices"]


# --- clients that hang up -----------------------------------------------------------------------


def _on_loop(server: Server, coro: Any) -> Any:
    """Run ``coro`` on the server's event loop (where the engine client lives)."""
    loop = server.server.servers[0].get_loop()
    return asyncio.run_coroutine_threadsafe(coro, loop).result(30)


def _engine_idle(server: Server, timeout: float = 15.0) -> bool:
    """Whether EngineCore itself (not only the front end) holds no request, within ``timeout``."""
    llm = server.app.state.steer.backend.llm
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _on_loop(server, llm.engine_core.call_utility_async("has_work")):
            return True
        time.sleep(0.1)
    return False


def _requests_total(http: httpx.Client, status: str) -> float:
    return metric(http, "steerserve_requests_total", endpoint="chat", status=status)


async def _drop_after_first_chunk(c: httpx.AsyncClient, body: dict[str, Any]) -> None:
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return  # hang up mid-stream


def test_mid_stream_drops_all_abort(server: Server, http: httpx.Client) -> None:
    """200 clients hang up after the first chunk of a 400-token stream, 40 at a time: each is
    a 499 and the engine aborts every one (EngineCore is idle right after)."""
    before = {s: _requests_total(http, s) for s in ("200", "499")}
    tokens = metric(http, "steerserve_tokens_total", kind="completion")
    body = chat_body("hi", stream=True, max_tokens=400, steering=False)

    async def waves() -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=120, limits=limits
        ) as c:
            for _ in range(5):
                await asyncio.gather(*(_drop_after_first_chunk(c, body) for _ in range(40)))

    asyncio.run(waves())
    assert _engine_idle(server), "EngineCore still generating for clients that left"
    assert wait_until(lambda: _requests_total(http, "499") == before["499"] + 200)
    assert _requests_total(http, "200") == before["200"]
    sent = metric(http, "steerserve_tokens_total", kind="completion") - tokens
    assert sent < 200 * 400 / 4, sent


def test_hang_ups_while_the_server_is_busy_are_499(
    server: Server, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients hang up while the server's event loop is blocked, their answers finished by the
    engine: the answers are ready but nobody reads them, so all are 499, not 200. The server
    is held from each request's first output on (the engine itself runs on), so no answer can
    be sent before the hang-up, however fast the engine; each step waits for its condition."""
    before = {s: _requests_total(http, s) for s in ("200", "499")}
    backend = server.app.state.steer.backend
    loop = server.server.servers[0].get_loop()
    release = asyncio.Event()  # set on the server's loop: the server may read on
    firsts: list[None] = []  # a request's first output reached the server
    wrap_generate(
        monkeypatch, backend, on_first=lambda: firsts.append(None), before_rest=release.wait
    )
    blocked, unblock = threading.Event(), threading.Event()

    def block() -> None:  # on the server's loop: busy until unblocked
        blocked.set()
        unblock.wait(120)

    async def until(cond: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def one(c: httpx.AsyncClient, i: int, started: asyncio.Semaphore, go: asyncio.Event):
        body = chat_body("hi", max_tokens=30, stream=i % 2 == 0, steering=False)

        async def call() -> None:
            if body["stream"]:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        break  # the answer has started
                    started.release()
                    await asyncio.sleep(600)  # read no further; closed when cancelled
            else:
                started.release()
                await c.post("/v1/chat/completions", json=body)

        task = asyncio.create_task(call())
        await go.wait()
        task.cancel()  # hang up
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def run() -> None:
        started, hang_up = asyncio.Semaphore(0), asyncio.Event()
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            tasks = [asyncio.create_task(one(c, i, started, hang_up)) for i in range(16)]
            for _ in tasks:  # however loaded the machine, every call has started
                await started.acquire()
            await until(lambda: len(firsts) == 16, "not every request reached the engine")
            await until(lambda: backend.in_flight() == 0, "the engine never finished")
            loop.call_soon_threadsafe(block)  # busy: the hang-ups queue up
            assert await asyncio.to_thread(blocked.wait, 120), "the server's loop never blocked"
            hang_up.set()
            await asyncio.gather(*tasks)
        # leaving the client and the loop closes every connection: each hang-up is sent

    try:
        asyncio.run(run())
    finally:
        loop.call_soon_threadsafe(release.set)  # runs first once unblocked: answers to read
        unblock.set()
    assert wait_until(lambda: _requests_total(http, "499") == before["499"] + 16, 60)
    assert _requests_total(http, "200") == before["200"]


def test_hang_up_while_uploading_is_499(server: Server, http: httpx.Client) -> None:
    """A client that closes the connection half-way through its request body is a 499, not a
    500 with a traceback."""
    before = {s: _requests_total(http, s) for s in ("499", "500")}
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 100000\r\n\r\n"
    )
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head.encode() + b'{"model": "llama", "messages": [')
            time.sleep(0.2)
    assert wait_until(lambda: _requests_total(http, "499") == before["499"] + 3)
    assert _requests_total(http, "500") == before["500"]


# --- huge prompts -------------------------------------------------------------------------------


def test_huge_prompts_refused_early_off_the_event_loop(
    server: Server, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 concurrent ~1 MB prompts (just under the body limit) are refused as too long without
    tokenizing them; 8 prompts longer than the context (tokenized, then refused) are tokenized
    off the event loop: what is tokenized, and where, is recorded, not inferred from timings;
    /health keeps answering throughout."""
    renderer = server.app.state.steer.backend.llm.renderer
    tokenizer = renderer.get_tokenizer()
    tokenized: list[tuple[str, int]] = []  # the thread and the tokens of each prompt tokenized

    class Spy:  # vLLM's renderer tokenizes prompts by calling its tokenizer
        def __call__(self, *a: Any, **kw: Any) -> Any:
            out = tokenizer(*a, **kw)
            tokenized.append((threading.current_thread().name, len(out["input_ids"])))
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(tokenizer, name)

    monkeypatch.setattr(renderer, "get_tokenizer", lambda: Spy())
    big = "Quelle est la capitale de la France ? " * 26_000  # ~1 MB, ~1M byte tokens
    calls = [("/v1/completions", {"model": MODEL, "prompt": big, "max_tokens": 4})] * 4
    calls += [("/v1/chat/completions", chat_body(big))] * 4
    # tokenized, then refused: longer than the context in tokens, within vLLM's character bound
    # (context x the longest token's characters), past which it refuses without tokenizing
    bound = 512 * tokenizer.max_chars_per_token
    size = min(9000, bound - 1)
    assert size > 600, bound
    mid = [("/v1/completions", {"model": MODEL, "prompt": big[:size], "max_tokens": 4})] * 8
    health: list[float] = []

    async def probe(stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                health.append(time.monotonic() - t0)
                await asyncio.sleep(0.05)

    async def run() -> tuple[list[httpx.Response], float]:
        stop = asyncio.Event()
        watcher = asyncio.create_task(probe(stop))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        rs = await _burst(server, calls + mid)
        took = time.monotonic() - t0
        stop.set()
        await watcher
        return rs, took

    responses, took = asyncio.run(run())
    for r in responses:
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["code"] == "context_length_exceeded"
    # the ~1 MB prompts refused unread; the others tokenized, each in the tokenizer's thread
    assert len(tokenized) == len(mid), tokenized
    for thread, n in tokenized:  # in vLLM's renderer's threads, never the event loop's
        # vLLM tokenizes one token past the context (truncating), enough to refuse it
        assert thread != server.thread.name and n > 512, (thread, n)
    # a loose bound (a second at most here, tokenizing a ~1 MB prompt takes 0.6 s): only a
    # server that stopped answering fails it, not a loaded machine
    assert max(health) < 10, f"/health stalled {max(health):.2f} s"
    assert took < 60, took
