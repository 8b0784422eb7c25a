"""What one request may cost everyone else (``server/generate/capacity.py``): the seats large requests
leave to small ones and to other clients, and the prompt work one request may send; the seat
rules in-process, the caps over real HTTP on the tiny Llama."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from _server import MODEL, tiny_http

from steerserve.server.errors import ApiError
from steerserve.server.generate.capacity import Budget, Seats, budget, reserved

# --- the seats, in-process ------------------------------------------------------------------------


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_one_sequence_is_never_held_and_large_requests_leave_seats_free() -> None:
    async def go() -> None:
        s = Seats(total=64, per_client=32)
        assert s.shared == 64 - reserved(64) == 56
        assert await s.take("a", 1) is None  # a chat turn, a scoring request
        a = await s.take("a", 32)
        b = await s.take("b", 24)
        assert s.in_use == 56
        waiting = asyncio.ensure_future(s.take("c", 2))  # 58 > 56: waits
        await asyncio.sleep(0)
        assert not waiting.done()
        s.release(b)
        c = await waiting
        assert c is not None and s.in_use == 34
        s.release(a)
        s.release(a)  # once only
        s.release(c)
        assert s.in_use == 0 and s.by_client == {}

    run(go())


def test_one_client_holds_at_most_its_share_and_others_pass_it() -> None:
    async def go() -> None:
        s = Seats(total=64, per_client=32)
        first = await s.take("a", 32)
        second = asyncio.ensure_future(s.take("a", 32))  # the same client: over its share
        await asyncio.sleep(0)
        other = await asyncio.wait_for(s.take("b", 16), 1)  # another client is not held up
        assert not second.done() and other is not None
        s.release(first)
        assert (await second) is not None

    run(go())


def test_waiters_are_admitted_in_turn_so_a_large_one_is_not_starved() -> None:
    async def go() -> None:
        s = Seats(total=64, per_client=40)
        a, b, c = [await s.take(x, n) for x, n in (("a", 20), ("b", 20), ("c", 10))]  # 50 of 56
        large = asyncio.ensure_future(s.take("d", 30))  # 80 > 56: waits
        await asyncio.sleep(0)
        small = asyncio.ensure_future(s.take("e", 6))  # would fit (56), but comes after it
        await asyncio.sleep(0.01)
        assert not large.done() and not small.done()
        s.release(c)  # 40 in use: the large one still does not fit, and the small one waits
        await asyncio.sleep(0.01)
        assert not large.done() and not small.done() and s.in_use == 40
        s.release(a)  # 20: both in turn
        assert (await asyncio.wait_for(large, 1)) is not None
        assert (await asyncio.wait_for(small, 1)) is not None and s.in_use == 56
        for t in (b, await large, await small):
            s.release(t)
        assert s.in_use == 0

    run(go())


def test_a_wait_ends_in_429_naming_the_limit_and_leaks_nothing() -> None:
    async def go() -> None:
        s = Seats(total=8, per_client=4, max_wait=0.05, max_waiting=1)
        held = await s.take("a", 4)
        with pytest.raises(ApiError) as e:
            await s.take("a", 2)  # waits max_wait, then 429
        assert e.value.status == 429 and e.value.code == "engine_busy"
        blocked = asyncio.ensure_future(s.take("a", 2))
        await asyncio.sleep(0)
        with pytest.raises(ApiError, match="wait for seats already"):
            await s.take("a", 2)  # a second waiter of the same client: at once
        blocked.cancel()  # the client went away while waiting
        await asyncio.gather(blocked, return_exceptions=True)
        assert not s._queue
        s.release(held)
        assert s.in_use == 0

    run(go())


def test_prompt_work_caps_name_their_field() -> None:
    assert budget(2048, 262_144) == (16_384, 1_024)
    b = Budget(prompt_cap=100, scored_cap=10)
    b.charge(60, scored=False)
    with pytest.raises(ApiError) as e:
        b.charge(41, scored=False)
    assert e.value.param == "prompt" and e.value.code == "request_too_large"
    b = Budget(prompt_cap=100, scored_cap=10)
    b.charge(10, scored=True)
    with pytest.raises(ApiError) as e:
        b.charge(1, scored=True)
    assert e.value.param == "logprobs"


# --- over HTTP ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    caps = {"max_prompt_tokens_per_request": 400, "max_scored_tokens_per_request": 100}
    with tiny_http(tiny_llama, tmp_path_factory.mktemp("vectors"), **caps) as c:
        yield c


def test_a_request_over_its_prompt_work_is_a_400_naming_the_field(http: httpx.Client) -> None:
    word = "abcdefgh " * 9  # some 80 tokens of the byte-level vocabulary
    body = {"model": MODEL, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = http.post("/v1/completions", json=body | {"prompt": [word, word]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logprobs" and err["code"] == "request_too_large"
    r = http.post("/v1/completions", json=body | {"prompt": [word]})  # within the cap
    assert r.status_code == 200, r.text
    many = {"model": MODEL, "max_tokens": 1, "prompt": [word] * 6}
    r = http.post("/v1/completions", json=many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    steered = {"model": MODEL, "max_tokens": 1, "prompt": [word] * 4, "steering": True}
    assert http.post("/v1/completions", json=steered).status_code == 200
    assert http.get("/ready").status_code == 200


# --- structured-output grammars (server/generate/grammar.py) -----------------------------------------------


def big_schema(props: int) -> dict:
    p = {f"field_{k}": {"type": "string", "pattern": "^[a-z]{1,8}$"} for k in range(props)}
    return {"type": "object", "properties": p, "required": list(p)}


def test_a_grammar_past_its_bound_is_a_400_naming_its_field(http: httpx.Client) -> None:
    from steerserve.server.generate.grammar import MAX_GRAMMAR_CHARS

    big = big_schema(1500)
    assert len(json.dumps(big)) > MAX_GRAMMAR_CHARS
    base = {"model": MODEL, "prompt": "JSON:", "max_tokens": 4}
    cases = [
        ("structured_outputs", {"structured_outputs": {"json": big}}),
        (
            "response_format",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": big},
                }
            },
        ),
    ]
    for field, extra in cases:
        r = http.post("/v1/completions", json=base | extra)
        assert r.status_code == 400, r.text
        assert (
            r.json()["error"]["param"] == field and r.json()["error"]["code"] == "grammar_too_large"
        )
    tool = {"type": "function", "function": {"name": "f", "parameters": big}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = http.post("/v1/chat/completions", json=chat | {"tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = http.post("/v1/completions", json=base | {"stop_token_ids": list(range(2000))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    small = {"structured_outputs": {"json": big_schema(3)}}
    assert http.post("/v1/completions", json=base | small).status_code == 200


def test_an_engine_side_grammar_failure_is_a_400_naming_the_field() -> None:
    """What vLLM's scheduler sends when a grammar fails to compile in the engine (a regex past
    xgrammar's compile timeout: on a large vocabulary only, so the output is built here)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from steerserve.server.generate.hosted import Plan

    failed = CompletionOutput(0, "", [], None, None, finish_reason="error")
    out = RequestOutput("r", None, [1, 2], None, [failed], finished=True)

    async def engine():  # noqa: ANN202
        yield out

    async def go() -> None:
        plan = Plan([], ["unsteered"], None, 512, [], grammar="structured_outputs")
        with pytest.raises(ApiError) as e:
            async for _ in plan.track(0, engine()):
                pass
        assert e.value.status == 400 and e.value.param == "structured_outputs"
        assert plan.error is e.value  # a stream's in-band error says the same
        plain = Plan([], ["unsteered"], None, 512, [])
        assert [o async for o in plain.track(0, engine())] == [out]  # no grammar: vLLM's 500

    run(go())


def test_json_is_compact_by_default(http: httpx.Client) -> None:
    """The engine's default structured-outputs config has no whitespace between JSON tokens
    (``engine.api.STRUCTURED_OUTPUTS``): JSON strings hold no raw newline or tab, so any in the
    answer would be grammar-allowed whitespace, which ate steered answers' token budgets."""
    schema = big_schema(3)
    for steering in (False, True):
        body = {
            "model": MODEL,
            "prompt": "JSON:",
            "max_tokens": 40,
            "temperature": 1.0,
            "seed": 1,
            "n": 4,
            "steering": steering,
            "structured_outputs": {"json": schema},
        }
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert not set(c["text"]) & {"\n", "\t", "\r"}, c["text"]


# --- seats measure engine work, not the client's reading (issue 58) ---------------------------


def _unread_stream(port: int, key: str, body: dict) -> socket.socket:
    """A streamed request on a socket whose client never reads: its receive buffer is made small
    before connecting, so the server's writes soon wait for it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def test_unread_streams_hold_no_seats(tiny_llama: Path, tmp_path: Path) -> None:
    """Two clients stream ``n=28`` and never read: once the engine has finished them (their
    streams still open, their bytes unsent), another client's ``n=2`` and an A/B request are
    answered, not a 429 after the seat wait."""
    from _server import make_artifact, metric, tiny_server

    keys = ("k1", "k2", "k3")
    make_artifact(tmp_path, tiny_llama, "v1")  # the A/B endpoint's steered arm
    bound = {"api_key": keys, "stream_send_timeout_seconds": 600.0}
    with tiny_server(tiny_llama, tmp_path, **bound) as srv:
        state = srv.app.state.steer
        big = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "n": 28,
            "temperature": 1.0,
            "max_tokens": 400,
            "ignore_eos": True,
            # ~40 MB of events: far more than the kernel's socket buffers hold (4 MiB here)
            "logprobs": True,
            "top_logprobs": 20,
        }
        socks = [_unread_stream(srv.port, k, big) for k in keys[:2]]
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                auth = {"Authorization": "Bearer k3"}
                assert _until(lambda: metric(c, "steerserve_queue_depth") == 2)  # both streaming
                # the engine finished both (0 unfinished) and their seats are free
                assert _until(lambda: state.seats.in_use == 0 and state.backend.in_flight() == 0)
                small = {"model": MODEL, "messages": big["messages"], "max_tokens": 4}
                r = c.post("/v1/chat/completions", json=small | {"n": 2, "temperature": 1.0},
                           headers=auth)  # fmt: skip
                assert r.status_code == 200, r.text
                r = c.post("/v1/chat/completions/ab", json=small, headers=auth)
                assert r.status_code == 200, r.text
                # the two streams are still open, their writes waiting for a reader
                assert metric(c, "steerserve_queue_depth") == 2
                assert metric(c, "steerserve_stream_stalls_total") == 0
        finally:
            for s in socks:
                s.close()
        with httpx.Client(base_url=srv.url, timeout=120) as c:  # hung up: settled as 499
            assert _until(lambda: metric(c, "steerserve_queue_depth") == 0)


def test_a_send_blocked_past_its_bound_cancels_the_stream() -> None:
    """Starlette's stream over an ASGI ``send`` that never returns (a client that reads
    nothing): at the bound the stream stops, its events' generator is closed (in the server:
    the engine requests aborted) and the stall counted."""
    from steerserve.server.generate.streaming import BoundedStream

    closed, stalls, sent = [], [], []

    async def events():  # noqa: ANN202
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def send(message: dict) -> None:
        sent.append(message["type"])
        if len(sent) > 3:
            await asyncio.Event().wait()  # the socket's buffers are full: blocks for ever

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    async def go() -> None:
        resp = BoundedStream(events(), 0.2, lambda: stalls.append(1), media_type="text/plain")
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await asyncio.wait_for(resp(scope, receive, send), 10)

    run(go())
    assert closed == [True] and stalls == [1]
    assert sent[0] == "http.response.start" and len(sent) == 4  # no final message


def _until(cond: Callable[[], bool], timeout: float = 300.0) -> bool:
    """Poll ``cond`` until it holds (``timeout``: a bound for a loaded machine, not a target)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False
