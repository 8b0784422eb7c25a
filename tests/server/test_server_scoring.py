"""A request that scores its prompt (lm-eval's loglikelihood: echo + logprobs, ``max_tokens`` 0
or 1; or ``prompt_logprobs``) reads positions before the last prompt token. Steering from the
last prompt token on (the tiny artifact's, and the shipped ones') never reaches them, so a preset
or ``steering: true`` steers every position of such a request and says so: its scores differ
from the base model's whenever its echo says applied. Explicit entries keep their positions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server import MODEL, tiny_http

ON = f"{MODEL}:steering-on"


@pytest.fixture(scope="module")
def http(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with tiny_http(tiny_llama, tmp_path_factory.mktemp("vectors")) as c:
        yield c


def score(http: httpx.Client, max_tokens: int = 0, **body: Any) -> tuple[list, dict]:
    """lm-eval's loglikelihood request: the prompt's logprobs (the first is None) and ``steering``."""
    req = {"model": MODEL, "prompt": "The capital of France is Paris", "temperature": 0}
    r = http.post(
        "/v1/completions",
        json=req | {"echo": True, "logprobs": 1, "max_tokens": max_tokens} | body,
    )
    assert r.status_code == 200, r.text
    a = r.json()
    return a["choices"][0]["logprobs"]["token_logprobs"], a["steering"]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_a_preset_steers_the_positions_it_scores(http: httpx.Client, max_tokens: int) -> None:
    base, off = score(http, max_tokens)
    preset, on = score(http, max_tokens, model=ON)
    steered, on2 = score(http, max_tokens, steering=True)
    assert not off["applied"] and on["applied"] and on2["applied"]
    assert {i["positions"] for i in on["interventions"]} == {"all"}  # the echo says where
    n = len(base) - max_tokens  # the prompt's own positions
    assert preset[1:n] != base[1:n]  # the scored numbers are steered, as the label says
    assert steered[1:n] == preset[1:n]


def test_prompt_logprobs_are_scoring_too(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}
    r = http.post("/v1/completions", json=body | {"prompt_logprobs": 1, "steering": True})
    assert r.status_code == 200, r.text
    assert {i["positions"] for i in r.json()["steering"]["interventions"]} == {"all"}


def test_explicit_entries_keep_their_positions(http: httpx.Client) -> None:
    entry = {"vector": "tiny/v1/recall", "layer": 1, "scale": 1.0, "positions": "generated"}
    base, _ = score(http)
    lps, info = score(http, steering={"entries": [entry]})
    assert info["applied"] and info["interventions"][0]["positions"] == "generated"
    assert lps == base  # what the client asked for: no prompt position is steered


def test_generation_keeps_the_artifacts_positions(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "steering": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert "all" not in {i["positions"] for i in r.json()["steering"]["interventions"]}
