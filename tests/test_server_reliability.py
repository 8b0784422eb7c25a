"""The server under concurrent and careless clients, over real HTTP: seeded requests whose prefill
is split across engine steps, A/B calls in parallel, clients that hang up at any moment, huge
prompts. The engine here splits every prompt longer than 64 tokens (``max_num_batched_tokens``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import AUTH, KEY, MODEL, Server, chat_body, make_artifact

LONG = "Quelle est la capitale de la France ? " * 8  # ~300 byte tokens: 5 prefill steps


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from steerserve.engine.api import EngineConfig
    from steerserve.server import ServerSettings, create_app

    vectors = tmp_path_factory.mktemp("vectors")
    make_artifact(vectors, tiny_llama, "v1")
    cfg = EngineConfig(
        model=str(tiny_llama),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=64 << 20,
    )
    app = create_app(ServerSettings(engine=cfg, vectors_dir=str(vectors), api_key=KEY))
    srv = Server(app)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


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
