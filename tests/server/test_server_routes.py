"""The rest of ``vllm serve``'s routes, over real HTTP on the tiny Llama: the Responses API
(``/v1/responses``, vLLM's serving class) steered as chat is and reached with the ``openai``
SDK, streamed and not; ``/tokenize`` and ``/detokenize`` at the root; ``/ping`` and ``/load``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _server import EN, FR, KEY, MODEL, tiny_http

ON = f"{MODEL}:steering-on"  # the served artifact's preset (test_server_presets.py)
#: Greedy and a fixed length, so answers compare token for token.
GREEDY: dict[str, Any] = {"max_output_tokens": 8, "temperature": 0}
FIXED = {"ignore_eos": True}


@pytest.fixture(scope="module")
def http(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One server, under an A/B experiment (a request with a ``user`` and no ``steering`` is
    enrolled; the others are served as without one)."""
    vectors = tmp_path_factory.mktemp("vectors")
    with tiny_http(tiny_llama, vectors, ab_split=0.5, ab_name="routes") as c:
        yield c


@pytest.fixture(scope="module")
def url(http: httpx.Client) -> str:
    return str(http.base_url).rstrip("/")


@pytest.fixture(scope="module")
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def ask(oai: openai.OpenAI, steering: Any = None, model: str = MODEL, **kw: Any) -> Any:
    body = FIXED if steering is None else {**FIXED, "steering": steering}
    return oai.responses.create(model=model, input=FR, extra_body=body, **{**GREEDY, **kw})


def completion_text(http: httpx.Client, steering: Any) -> str:
    """The answer to :data:`FR` as vLLM's Responses layer renders it (the chat template, then
    tokenized with special tokens: the tiny template's BOS comes twice), as a completion."""
    messages = [{"role": "user", "content": FR}]
    ids = http.post("/v1/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    body = {
        "model": MODEL,
        "prompt": [ids[0], *ids],
        "max_tokens": GREEDY["max_output_tokens"],
        "temperature": 0,
        "steering": steering,
        **FIXED,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# --- /v1/responses ------------------------------------------------------------------------------


def test_responses_answer_as_completions_do(oai: openai.OpenAI, http: httpx.Client) -> None:
    """Unsteered and steered (the body's ``steering``), a Responses answer is the completion of
    the prompt vLLM renders for it, and carries the ``steering`` that was applied."""
    off, on = ask(oai, False), ask(oai, True)
    assert off.output_text == completion_text(http, False) and off.steering["applied"] is False
    assert on.output_text == completion_text(http, True) and on.output_text != off.output_text
    assert on.steering["applied"] is True and on.steering["policy"] == "on"
    names = [iv["name"] for iv in on.steering["interventions"]]
    assert names == ["recall", "translation"]
    assert on.id.startswith("resp_") and on.model == MODEL
    assert (on.status, on.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert on.usage.output_tokens == GREEDY["max_output_tokens"]


def test_responses_preset_model(oai: openai.OpenAI) -> None:
    """A preset's id as ``model`` steers as ``steering: true`` does, and is echoed."""
    on, preset = ask(oai, True), ask(oai, model=ON)
    assert preset.output_text == on.output_text and preset.model == ON
    assert preset.steering["applied"] is True and preset.steering["preset"] == ON


def test_responses_header_and_instructions(http: httpx.Client) -> None:
    """The ``x-steerserve-steering`` header, as chat's; ``instructions`` are rendered."""
    body = {"model": MODEL, "input": FR, "steering": True, **GREEDY}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-steerserve-steering"].startswith('{"applied":true')
    with_sys = http.post("/v1/responses", json={**body, "instructions": "Be brief."})
    assert with_sys.status_code == 200, with_sys.text
    assert with_sys.json()["usage"]["input_tokens"] > r.json()["usage"]["input_tokens"]


def test_responses_stream(oai: openai.OpenAI, http: httpx.Client) -> None:
    """Streamed: the deltas make the collected answer; the response object of the opening and
    closing events carries ``steering`` and the preset's id; events are named as vLLM's."""
    collected = ask(oai, model=ON)
    events = list(ask(oai, model=ON, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == collected.output_text
    done = events[-1].response
    assert done.output_text == collected.output_text and done.model == ON
    assert done.steering == collected.steering and events[0].response.steering["applied"]
    body = {"model": MODEL, "input": FR, "stream": True, "steering": False, **GREEDY}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: response.created" and lines[1].startswith("data: {")
    assert lines[-2] == "event: response.completed" and "[DONE]" not in lines[-1]


def test_responses_enrolled_under_the_experiment(oai: openai.OpenAI) -> None:
    """A request with a ``user`` and no ``steering`` takes its arm of the A/B experiment."""
    r = oai.responses.create(model=MODEL, input=EN, user="alice", extra_body=FIXED, **GREEDY)
    assert r.steering["experiment"]["name"] == "routes"
    assert r.steering["experiment"]["arm"] in ("steered", "unsteered")


def test_responses_refusals(oai: openai.OpenAI, http: httpx.Client) -> None:
    """Errors in OpenAI's format naming their field, before anything streams."""
    with pytest.raises(openai.NotFoundError) as nf:
        oai.responses.create(model="nope", input=EN)
    assert nf.value.body["code"] == "model_not_found"
    cases = [
        ({"model": ON, "steering": True}, "steering"),
        ({"steering": {"interventions": {"nope": 1.0}}}, "steering"),
        ({"max_output_tokens": 100_000}, "max_output_tokens"),  # vLLM's refusal
        ({"max_output_tokens": 500, "stream": True}, "max_output_tokens"),  # the prompt's room
        ({"background": True}, "background"),
        ({"bogus": 1}, "bogus"),
    ]
    gone = {"model": MODEL, "input": EN, "previous_response_id": "resp_x"}
    r = http.post("/v1/responses", json=gone)  # vLLM's store is off: nothing to continue
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
    for extra, param in cases:
        r = http.post("/v1/responses", json={"model": MODEL, "input": EN, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err


# --- tokenization, ping, load, auth -------------------------------------------------------------


def test_root_tokenize_round_trip(http: httpx.Client) -> None:
    """``/tokenize`` and ``/detokenize`` at the root answer as under ``/v1``."""
    body = {"model": MODEL, "prompt": EN, "add_special_tokens": False}
    tok = http.post("/tokenize", json=body)
    assert tok.status_code == 200, tok.text
    assert tok.json() == http.post("/v1/tokenize", json=body).json()
    tokens = tok.json()["tokens"]
    assert tok.json()["count"] == len(tokens) > 0
    detok = http.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert detok.status_code == 200, detok.text
    assert detok.json()["prompt"] == EN


def test_ping_and_load(url: str, oai: openai.OpenAI) -> None:
    """``/ping`` (GET or POST) is 200 once ready, with no body; ``/load`` counts generation
    requests in flight, as vLLM's ``{"server_load": n}``; both without a key, as vLLM's."""
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{url}/ping")
        assert (r.status_code, r.content) == (200, b"")
    idle(url)
    long = threading.Thread(target=ask, args=(oai, True), kwargs={"max_output_tokens": 128})
    long.start()
    seen = set()
    while long.is_alive():
        seen.add(httpx.get(f"{url}/load").json()["server_load"])
        time.sleep(0.02)
    assert 1 in seen and seen <= {0, 1}, seen
    idle(url)


def idle(url: str) -> None:
    """``/load`` back at 0: a stream's last event can reach the client a moment before the
    server settles the request, so wait for it (bounded for a busy machine)."""
    deadline = time.monotonic() + 60
    while (load := httpx.get(f"{url}/load").json()) != {"server_load": 0}:
        assert time.monotonic() < deadline, load
        time.sleep(0.05)


@pytest.mark.parametrize("path", ["/v1/responses", "/tokenize", "/detokenize"])
def test_keyed_routes_need_the_key(url: str, path: str) -> None:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, "input": EN})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
