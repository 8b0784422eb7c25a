"""Issue 21's reproductions over real HTTP, one per defect (``test_d<N>_...``), on one server: the
tiny Llama with a tiny artifact, no API key (loopback), an A/B experiment with a decision log.
Crafted bodies answer a 4xx in OpenAI's format and leave the keep-alive connection usable; an
error no handler typed is a 500 in that format with a request id; feedback is bounded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import MODEL, Server, chat_body, make_artifact

NAME = "hardening"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("hardening")
    make_artifact(root / "vectors", tiny_llama, "v1")
    return root


@pytest.fixture(scope="module")
def server(tiny_llama: Path, root: Path) -> Iterator[Server]:
    from steerserve.engine.api import EngineConfig
    from steerserve.server import ServerSettings, create_app

    cfg = EngineConfig(
        model=str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_memory_bytes=32 << 20
    )
    settings = ServerSettings(
        engine=cfg,
        vectors_dir=str(root / "vectors"),
        ab_split=0.5,
        ab_name=NAME,
        ab_log=str(root / "ab.jsonl"),
    )
    app = create_app(settings)

    async def boom() -> None:  # a route with a bug no handler knows: the catch-all's case
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)
    srv = Server(app)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _one_connection(server: Server, calls: list[tuple[str, str, bytes]]) -> list[tuple[int, Any]]:
    """``(method, path, body)`` sent one after another on a single keep-alive connection; raises
    when the server drops it (http.client reconnects only when told ``Connection: close``)."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=60)
    out = []
    try:
        for method, path, body in calls:
            conn.request(method, path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            assert r.getheader("connection") != "close", (path, body[:80])
            out.append((r.status, json.loads(data) if data else None))
    finally:
        conn.close()
    return out


#: ``positions`` values that raised TypeError (unhashable) instead of a 400.
BAD_POSITIONS: list[Any] = [[], ["all"], {}]


def _crafted_bodies() -> list[tuple[str, bytes]]:
    """Bodies whose ``steering`` made the server answer 500 (issue 21, defect 1), per route.
    A scale or multiplier of ``10**400`` is a JSON integer past float's range."""
    huge = "1" + "0" * 400
    steerings = [
        f'{{"interventions": {{"recall": {huge}}}}}',
        *(
            f'{{"entries": [{{"vector": "tiny/v1/recall", "layer": 1, "scale": {sign}{huge}}}]}}'
            for sign in ("", "-")
        ),
        *(
            json.dumps({"entries": [{"vector": "tiny/v1/recall", "layer": 1, "positions": p}]})
            for p in BAD_POSITIONS
        ),
    ]
    out = []
    for s in steerings:
        chat = json.dumps(chat_body("hi"))[:-1] + f', "steering": {s}}}'
        completion = json.dumps({"model": MODEL, "prompt": "hi"})[:-1] + f', "steering": {s}}}'
        out += [
            ("/v1/chat/completions", chat.encode()),
            ("/v1/chat/completions/ab", chat.encode()),
            ("/v1/completions", completion.encode()),
        ]
    return out


def test_d1_crafted_steering_is_400_and_keeps_the_connection(server: Server) -> None:
    """Defect 1: an integer scale or multiplier >= 2**1024 and ``positions`` given as ``[]``,
    ``["all"]`` or ``{}`` are 400s naming their field, on every route, and each follow-up on the
    same connection is answered."""
    calls = []
    for path, body in _crafted_bodies():
        calls += [("POST", path, body), ("GET", "/health", b"")]
    answers = _one_connection(server, calls)
    for (method, path, body), (status, data) in zip(calls, answers, strict=True):
        if method == "GET":
            assert status == 200
            continue
        assert status == 400, (path, body[:120], data)
        assert data["error"]["type"] == "invalid_request_error"
        assert data["error"]["param"].startswith("steering."), data


def test_catch_all_is_500_in_openai_form_and_keeps_the_connection(
    server: Server, http: httpx.Client
) -> None:
    """An error no handler typed: 500 ``server_error`` in OpenAI's format, with a request id in
    the message and ``x-request-id``, counted; the next request on the same connection works."""
    [(status, data), (after, _)] = _one_connection(
        server, [("GET", "/boom", b""), ("GET", "/health", b"")]
    )
    assert status == 500 and after == 200
    err = data["error"]
    assert err["type"] == "server_error" and "request id req-" in err["message"], err
    r = http.get("/boom")
    assert r.status_code == 500 and r.headers["x-request-id"] in r.json()["error"]["message"]
