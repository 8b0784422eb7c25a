"""The server shares the prompt's prefix cache between steered and unsteered requests up to the
first steered token (``engine/prefix.py``) and says so in ``usage.prompt_tokens_details.
cached_tokens``, as vLLM's server does: a steered request after an unsteered one, the A/B
endpoint's two arms (collected and streamed). The tiny model's artifact steers at
``last_prompt_and_generated`` and ``generated``; vLLM's CPU blocks hold 128 tokens."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import AUTH, KEY, MODEL, Server, make_artifact

BLOCK = 128


@pytest.fixture(scope="module")
def http(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from steerserve.engine.api import EngineConfig
    from steerserve.server import ServerSettings, create_app

    vectors = tmp_path_factory.mktemp("vectors")
    make_artifact(vectors, tiny_llama, "v1", seed=0)
    cfg = EngineConfig(
        model=str(tiny_llama), dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20
    )
    srv = Server(create_app(ServerSettings(engine=cfg, vectors_dir=str(vectors), api_key=KEY)))
    srv.start()
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        yield c
    srv.stop()


def text(seed: int) -> str:
    """About 300 tokens of the tiny model's byte-level vocabulary, different for every seed."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(300))


def shared(prompt_tokens: int) -> int:
    """The full blocks before the one that holds the last prompt token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def complete(http: httpx.Client, prompt: str, steering: Any) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "steering": steering}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_steered_completion_after_an_unsteered_one_reads_the_cached_prefix(
    http: httpx.Client,
) -> None:
    prompt = text(1)
    first = complete(http, prompt, False)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = complete(http, prompt, True)
    assert second["steering"]["applied"]
    n = second["usage"]["prompt_tokens"]
    assert n > 2 * BLOCK
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == shared(n)


def test_the_ab_endpoints_arms_share_the_prompt(http: httpx.Client) -> None:
    body = {"model": MODEL, "max_tokens": 3, "steering": True, "temperature": 0}
    r = http.post("/v1/chat/completions/ab", json=body | {"messages": [msg(2)]})
    assert r.status_code == 200, r.text
    usage = [r.json()[arm]["usage"] for arm in ("unsteered", "steered")]
    n = usage[0]["prompt_tokens"]
    assert sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usage) == [0, shared(n)]
    # streamed: each arm's closing usage says the same
    stream = body | {
        "messages": [msg(3)],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions/ab", json=stream) as s:
        assert s.status_code == 200
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 2
    n = usage[0]["prompt_tokens"]
    assert sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usage) == [0, shared(n)]


def msg(seed: int) -> dict:
    return {"role": "user", "content": text(seed)}
