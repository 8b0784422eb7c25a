"""The server shares the prompt's prefix cache between steered and unsteered requests up to the
first steered token (``engine/prefix.py``) and says so in ``usage.prompt_tokens_details.
cached_tokens``, as vLLM's server does: a steered request after an unsteered one, the A/B
endpoint's two arms (collected and streamed). The tiny model's artifact steers at
``last_prompt_and_generated`` and ``generated``; vLLM's CPU blocks hold 128 tokens."""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server import MODEL, tiny_http

BLOCK = 128


@pytest.fixture(scope="module")
def http(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with tiny_http(tiny_llama, tmp_path_factory.mktemp("vectors")) as c:
        yield c


def text(seed: int) -> str:
    """About 300 tokens of the tiny model's byte-level vocabulary, different for every seed."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(300))


def shared(prompt_tokens: int) -> int:
    """The full blocks before the one that holds the last prompt token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def complete(http: httpx.Client, prompt: str, steering: Any, salt: str | None = None) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "steering": steering}
    if salt is not None:
        body["cache_salt"] = salt
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


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_probes_engine_killer_is_an_ordinary_salt(http: httpx.Client) -> None:
    """A client salt shaped like steerserve's old one, on an unsteered request whose generated
    tokens fill blocks (where the scheduler hashes): answered, and the engine lives on."""
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 300,
        "ignore_eos": True,
        "temperature": 0,
        "cache_salt": "steer-x:boom",
    }
    for _ in range(2):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 300
    assert http.get("/ready").status_code == 200


@pytest.mark.parametrize(
    ("first", "second", "shares"),
    [
        (("alice", True), ("bob", True), False),
        (("alice", True), (None, True), False),
        (("alice", True), (None, False), False),
        (("alice", "all"), ("bob", "all"), False),
        (("alice", "generated"), ("bob", "generated"), False),
        (("alice", False), ("bob", False), False),
        (("steer-abc:-1", False), (None, False), False),
        ((None, False), ("steer-abc:-1", False), False),
        (("alice", False), ("alice", True), True),
        (("alice", True), ("alice", False), True),
    ],
)
def test_a_client_salt_isolates_steered_requests(
    http: httpx.Client, first: tuple, second: tuple, shares: bool
) -> None:
    """The probe's table over HTTP: blocks are read only within one client salt (the steered
    arm of the tiny artifact starts at the last prompt token, so a shared prompt is shared up to
    it); ``all`` and ``generated`` are positions given as explicit entries."""
    prompt = text(zlib.crc32(repr((first, second)).encode()))
    answers = [complete(http, prompt, entries(st), salt) for salt, st in (first, second)]
    n = answers[1]["usage"]["prompt_tokens"]
    assert cached(answers[0]) == 0
    assert cached(answers[1]) == (shared(n) if shares else 0)


def entries(steering: Any) -> Any:
    """``True``/``False`` as sent; a positions name as one explicit entry of the artifact's vector."""
    if isinstance(steering, bool):
        return steering
    return {
        "entries": [{"vector": "tiny/v1/recall", "layer": 1, "scale": 1.0, "positions": steering}]
    }
