"""The OpenAI-compatible server over real HTTP: one uvicorn server (in a thread) on a tiny Llama with
a tiny two-intervention artifact, reached with the official ``openai`` client and httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import torch
from _server import (
    AUTH,
    DE,
    EN,
    FR,
    JA,
    KEY,
    MODEL,
    Server,
    chat,
    chat_body,
    corrupt,
    make_artifact,
    metric,
    steering_header,
    tiny_server,
    tiny_settings,
    wait_until,
    wrap_generate,
)


@pytest.fixture(scope="module")
def vectors_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("vectors")
    make_artifact(root, tiny_llama, "v1", seed=0)
    return root


@pytest.fixture(scope="module")
def server(tiny_llama: Path, vectors_dir: Path) -> Iterator[Server]:
    with tiny_server(tiny_llama, vectors_dir, steering="auto") as srv:
        yield srv
    assert not srv.thread.is_alive()


# --- ops endpoints, models, auth ----------------------------------------------------------------


def test_health_ready_models(server: Server, http: httpx.Client) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json()["status"] == "ready"
    models = http.get("/v1/models").json()
    # the base model, then the served artifact's steering presets (test_server_presets.py)
    assert [m["id"] for m in models["data"]] == [
        MODEL,
        f"{MODEL}:steering-on",
        f"{MODEL}:steering-auto",
    ]
    assert models["data"][0]["max_model_len"] == 512


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions/ab"),
        ("GET", "/v1/steering/vectors"),
        ("POST", "/v1/steering/vectors"),
    ],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic " + KEY, KEY])
def test_auth_required(server: Server, method: str, path: str, auth: str | None) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    r = httpx.request(method, server.url + path, headers=headers, json={"name": "tiny"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("key", ["clé", "キー", KEY + "é"])
def test_non_ascii_key_is_401(server: Server, key: str) -> None:
    """A key that is not ASCII (sent as UTF-8 bytes) is refused like any wrong key, not a 500."""
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}".encode()})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_ops_endpoints_need_no_key(server: Server) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200
    assert "steerserve_queue_depth" in httpx.get(server.url + "/metrics").text


def test_openai_client_auth(server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# --- chat and completions -----------------------------------------------------------------------


def test_chat_openai_client(oai: openai.OpenAI) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": EN}],
        max_tokens=6,
        temperature=0,
        extra_body={"steering": True, "ignore_eos": True},
    )
    resp = raw.parse()
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 6
    steering = resp.model_extra["steering"]
    assert steering["applied"] is True and steering["policy"] == "on"
    names = [(i["name"], i["layer"], i["scale"]) for i in steering["interventions"]]
    assert names == [("recall", 1, 4.0), ("translation", 2, 2.0)]
    assert all(
        len(i["sha256"]) == 12 and i["artifact"] == "tiny" for i in steering["interventions"]
    )
    assert json.loads(raw.headers["x-steerserve-steering"])["applied"] is True


def test_chat_stream_equals_non_stream(oai: openai.OpenAI, http: httpx.Client) -> None:
    for steering in (False, True):
        full = chat(http, EN, steering=steering, max_tokens=10)
        stream = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": EN}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"steering": steering, "ignore_eos": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full["choices"][0]["message"]["content"]
        assert chunks[0].model_extra["steering"]["applied"] is steering
        assert chunks[-1].model_extra["steering"] == chunks[0].model_extra["steering"]
        assert {c.model for c in chunks} == {MODEL}
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length"
        assert chunks[-1].usage.completion_tokens == 10
        assert chunks[-1].usage.prompt_tokens == full["usage"]["prompt_tokens"]


def test_chat_stream_n_choices(oai: openai.OpenAI, http: httpx.Client) -> None:
    kw = {"temperature": 1.0, "seed": 11, "n": 2, "max_tokens": 6}
    full = chat(http, FR, steering=True, **kw)
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": FR}],
        stream=True,
        extra_body={"steering": True, "ignore_eos": True},
        **kw,
    ):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in full["choices"]]
    assert finish == {0: "length", 1: "length"}


def test_sse_framing_httpx(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-steerserve-steering"] == "off"  # English under "auto"
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        assert json.loads(ev[6:])["object"] == "chat.completion.chunk"


def test_completions_openai_and_stream(oai: openai.OpenAI, http: httpx.Client) -> None:
    resp = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=7, temperature=0, logprobs=2
    )
    c = resp.choices[0]
    assert resp.object == "text_completion" and resp.usage.completion_tokens <= 7
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == resp.usage.completion_tokens
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert resp.model_extra["steering"]["detected_language"] == "en"
    text = ""
    for chunk in oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=7, temperature=0, stream=True
    ):
        text += "".join(ch.text for ch in chunk.choices)
    assert text == c.text


def test_completions_batch_n_seed_stop_echo(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": ["abc", "xyz"], "max_tokens": 5, "n": 2}
    body |= {"temperature": 1.0, "seed": 7, "ignore_eos": True, "steering": False}
    a = http.post("/v1/completions", json=body).json()
    b = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]  # seeded
    assert a["usage"]["completion_tokens"] == 20
    assert a["usage"]["prompt_tokens"] == 2 * 4  # <bos> + 3 bytes each
    streamed: dict[int, str] = {}
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    assert [streamed[i] for i in range(4)] == [c["text"] for c in a["choices"]]
    # stop: generation ends before the stop string, which is not returned
    full = http.post("/v1/completions", json=body | {"n": 1, "prompt": "abc"}).json()
    text = full["choices"][0]["text"]
    stop = text[2:4]
    if stop.strip() and "\ufffd" not in stop:
        cut = http.post("/v1/completions", json=body | {"n": 1, "prompt": "abc", "stop": [stop]})
        assert cut.json()["choices"][0]["text"] == text[: text.index(stop)]
        assert cut.json()["choices"][0]["finish_reason"] == "stop"
    echo = http.post("/v1/completions", json=body | {"n": 1, "prompt": "abc", "echo": True})
    assert echo.json()["choices"][0]["text"] == "abc" + text


def test_completions_auto_decides_per_prompt(http: httpx.Client) -> None:
    """``auto`` decides each prompt of a batch by its own language (before, the batch's joined
    text decided for all: [en, fr] steered both, [en, en, ja] neither) and says so per choice;
    each choice equals its prompt sent alone, collected or streamed."""
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0, "steering": "auto"}

    def complete(prompt: Any, **kw: Any) -> dict[str, Any]:
        r = http.post("/v1/completions", json=base | {"prompt": prompt} | kw)
        assert r.status_code == 200, r.text
        assert r.headers["x-steerserve-steering"] == steering_header(r.json()["steering"])
        return r.json()

    for batch, steered in (([EN, FR], [False, True]), ([EN, EN, JA], [False, False, True])):
        alone = [complete(p) for p in batch]
        both = complete(batch)
        for c, a, on in zip(both["choices"], alone, steered, strict=True):
            assert c["steering"]["applied"] is on, (batch, c["steering"])
            assert c["steering"] == a["steering"] == a["choices"][0]["steering"]
            assert c["text"] == a["choices"][0]["text"]
        assert both["steering"]["applied"] and both["steering"]["policy"] == "auto"
        assert both["steering"]["detected_language"] is None  # prompts differ
        assert both["steering"]["interventions"] == alone[-1]["steering"]["interventions"]
        streamed: dict[int, str] = {}
        told: dict[int, Any] = {}
        with http.stream(
            "POST", "/v1/completions", json=base | {"prompt": batch, "stream": True}
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
                        if "steering" in ch:
                            assert ch["index"] not in told  # once per choice
                            told[ch["index"]] = ch["steering"]
        assert streamed == {i: c["text"] for i, c in enumerate(both["choices"])}
        assert told == {i: c["steering"] for i, c in enumerate(both["choices"])}
    same = complete([FR, DE])  # both steered, languages differ
    assert same["steering"]["applied"] and all(c["steering"]["applied"] for c in same["choices"])


def test_chat_logprobs(http: httpx.Client) -> None:
    r = chat(http, EN, logprobs=True, top_logprobs=3, steering=False)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 8
    for tok in content:
        assert len(tok["top_logprobs"]) == 3
        assert tok["top_logprobs"][0]["logprob"] >= tok["top_logprobs"][-1]["logprob"]
        assert tok["logprob"] == pytest.approx(tok["top_logprobs"][0]["logprob"])  # greedy


def test_greedy_n_repeats_the_greedy_answer(http: httpx.Client) -> None:
    """n > 1 at temperature 0 (OpenAI accepts it; vLLM alone refuses it): n identical choices,
    the n = 1 answer, streamed or not, on both endpoints."""
    one = chat(http, FR, steering=True)["choices"][0]
    many = chat(http, FR, steering=True, n=3)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in many["choices"]} == {one["message"]["content"]}
    assert many["usage"]["completion_tokens"] == 3 * 8
    streamed: dict[int, str] = {}
    body = chat_body(FR, steering=True, n=3, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + (
                        c["delta"].get("content") or ""
                    )
    assert streamed == {i: one["message"]["content"] for i in range(3)}
    comp = {"model": MODEL, "prompt": ["abc", "xyz"], "max_tokens": 4, "temperature": 0}
    texts = [
        c["text"] for c in http.post("/v1/completions", json=comp | {"n": 2}).json()["choices"]
    ]
    solo = [c["text"] for c in http.post("/v1/completions", json=comp).json()["choices"]]
    assert texts == [solo[0], solo[0], solo[1], solo[1]]


# --- steering -----------------------------------------------------------------------------------


def test_steering_modes(http: httpx.Client) -> None:
    off_en, on_en = chat(http, EN, steering=False), chat(http, EN, steering=True)
    off_fr, on_fr = chat(http, FR, steering=False), chat(http, FR, steering=True)
    assert off_en["steering"] == {
        "applied": False,
        "policy": "off",
        "interventions": [],
        "detected_language": None,
    }
    text = lambda r: r["choices"][0]["message"]["content"]  # noqa: E731
    assert text(off_en) != text(on_en) and text(off_fr) != text(on_fr)
    # auto (explicit, and the server default when absent): English off, French and German on
    for steering in ("auto", None):
        kw = {} if steering is None else {"steering": steering}
        a_en, a_fr, a_de = chat(http, EN, **kw), chat(http, FR, **kw), chat(http, DE, **kw)
        assert (a_en["steering"]["applied"], a_en["steering"]["detected_language"]) == (False, "en")
        assert (a_fr["steering"]["applied"], a_fr["steering"]["detected_language"]) == (True, "fr")
        assert a_de["steering"]["detected_language"] == "de" and a_de["steering"]["applied"]
        assert text(a_en) == text(off_en) and text(a_fr) == text(on_fr)
        assert a_fr["steering"]["interventions"] == on_fr["steering"]["interventions"]


def test_steering_object_forms(http: httpx.Client) -> None:
    text = lambda r: r["choices"][0]["message"]["content"]  # noqa: E731
    on = chat(http, EN, steering=True)
    ones = chat(http, EN, steering={"interventions": {"recall": 1.0, "translation": 1.0}})
    assert text(ones) == text(on) and ones["steering"]["policy"] == "interventions"
    half = chat(http, EN, steering={"interventions": {"recall": 0.5}})
    [iv] = half["steering"]["interventions"]
    assert (iv["name"], iv["scale"], iv["layer"]) == ("recall", 2.0, 1)
    explicit = chat(
        http,
        EN,
        steering={
            "entries": [
                {
                    "vector": "tiny/v1/recall",
                    "layer": 1,
                    "scale": 2.0,
                    "positions": "last_prompt_and_generated",
                }
            ]
        },
    )
    assert text(explicit) == text(half)
    assert explicit["steering"]["interventions"][0]["artifact"] == "tiny"
    assert explicit["steering"]["policy"] == "entries"
    pinned = chat(http, EN, steering={"artifact": "tiny/v1"})
    assert text(pinned) == text(on)


def test_steering_ops_over_http(server: Server, http: httpx.Client) -> None:
    """Entries with an ``op``: applied (a changed answer), echoed with their op (body and
    header), each op its own prefix-cache key; ablating a zero vector is a 400 naming it."""
    text = lambda r: r["choices"][0]["message"]["content"]  # noqa: E731
    v = "tiny/v1/recall"
    entries = [
        {"vector": v, "layer": 1, "scale": 1.0, "op": "ablate"},
        {"vector": v, "layer": 2, "scale": 0.5, "positions": "generated", "op": "interp"},
        {"vector": "tiny/v1/translation", "layer": 2, "scale": 2.0},
        {"vector": v, "layer": 3, "scale": 1.0, "positions": "generated", "op": "replace"},
    ]
    plain = chat(http, EN, steering=False)
    steered = chat(http, EN, steering={"entries": entries})
    echo = steered["steering"]["interventions"]
    assert [(i["op"], i["layer"], i["scale"]) for i in echo] == [
        ("ablate", 1, 1.0), ("interp", 2, 0.5), ("add", 2, 2.0), ("replace", 3, 1.0)
    ]  # fmt: skip
    assert text(steered) != text(plain)
    as_add = chat(http, EN, steering={"entries": [e | {"op": "add"} for e in entries]})
    assert [i["op"] for i in as_add["steering"]["interventions"]] == ["add"] * 4
    assert text(as_add) != text(steered)
    on = chat(http, EN, steering=True)  # an artifact's entries name their op too
    assert {i["op"] for i in on["steering"]["interventions"]} == {"add"}
    backend = server.app.state.steer.backend
    loop = server.server.servers[0].get_loop()
    asyncio.run_coroutine_threadsafe(backend.register("raw/zero", torch.zeros(64)), loop).result(60)
    zero = {"vector": "raw/zero", "layer": 1, "scale": 1.0}
    r = http.post("/v1/chat/completions", json=chat_body(EN, steering={"entries": [zero]}))
    assert r.status_code == 200 and text(r.json()) == text(plain)  # adding nothing is allowed
    r = http.post("/v1/chat/completions",
                  json=chat_body(EN, steering={"entries": [zero | {"op": "ablate"}]}))  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "steering.entries[0].vector"
    assert "ablate needs a non-zero vector" in err["message"]


def test_ab_endpoint(http: httpx.Client) -> None:
    body = chat_body(FR, temperature=0.9, seed=1234, n=2)
    r = http.post("/v1/chat/completions/ab", json=body)
    assert r.status_code == 200, r.text
    ab = r.json()
    assert set(ab) == {"unsteered", "steered", "identical"}
    assert ab["unsteered"]["steering"]["applied"] is False
    assert ab["steered"]["steering"]["applied"] is True
    assert ab["identical"] is False
    assert json.loads(r.headers["x-steerserve-steering"])["applied"] is True
    # each arm is the answer a plain request with the same seed gets
    off = chat(http, FR, temperature=0.9, seed=1234, n=2, steering=False)
    on = chat(http, FR, temperature=0.9, seed=1234, n=2, steering=True)
    texts = lambda r: [c["message"]["content"] for c in r["choices"]]  # noqa: E731
    assert texts(ab["unsteered"]) == texts(off)
    assert texts(ab["steered"]) == texts(on)
    # English under the default "auto" is still steered in the B arm; scale 0 is identical
    en = http.post("/v1/chat/completions/ab", json=chat_body(EN)).json()
    assert en["steered"]["steering"]["applied"] and not en["identical"]
    zero = {"interventions": {"recall": 0.0, "translation": 0.0}}
    same = http.post("/v1/chat/completions/ab", json=chat_body(EN, steering=zero)).json()
    assert same["identical"] is True


# --- bad input ----------------------------------------------------------------------------------

BAD: list[tuple[str, Any, int, str, str | None]] = [
    ("malformed json", b'{"model": "llama", "messages": [', 400, "not valid JSON", None),
    ("not an object", b"[1, 2]", 400, "must be a JSON object", None),
    ("wrong type", {"temperature": "hot"}, 400, "temperature: ", "temperature"),
    ("wrong message type", {"messages": [{"role": "user", "content": 3}]}, 400, "", None),
    ("no messages", {"messages": []}, 400, "messages", "messages"),
    ("negative max_tokens", {"max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("temperature range", {"temperature": 3.5}, 400, "temperature", "temperature"),
    # past 64 bits an integer vLLM leaves unbounded cannot cross to the engine core (once a 500)
    ("top_k past 64 bits", {"top_k": 2**64}, 400, "2**64 - 1", "top_k"),
    ("stream_interval past 64 bits", {"stream_interval": 10**30}, 400, "2**64", "stream_interval"),
    (
        "an integer past 64 bits in a schema",
        {"structured_outputs": {"json": {"type": "array", "items": [{"maximum": -(2**63) - 1}]}}},
        400,
        "-2**63",
        "structured_outputs.json.items[0].maximum",
    ),
    ("misspelt steering", {"steerng": True}, 400, "unrecognized", "steerng"),
    ("steering string", {"steering": "yes"}, 400, "steering", "steering"),
    ("steering number", {"steering": 1}, 400, "steering", "steering"),
    (
        "unknown intervention",
        {"steering": {"interventions": {"recal": 1.0}}},
        400,
        "unknown intervention",
        "steering.interventions.recal",
    ),
    (
        "scale out of bounds",
        {"steering": {"interventions": {"recall": 1000}}},
        400,
        "outside",
        "steering.interventions.recall",
    ),
    (
        "multiplier type",
        {"steering": {"interventions": {"recall": "big"}}},
        400,
        "finite number",
        "steering.interventions.recall",
    ),
    (
        "unknown steering field",
        {"steering": {"interventions": {"recall": 1}, "layer": 3}},
        400,
        "unknown field",
        "steering.layer",
    ),
    (
        "entry layer",
        {"steering": {"entries": [{"vector": "tiny/v1/recall", "layer": 40, "scale": 1}]}},
        400,
        "out of range 0..3",
        "steering.entries[0].layer",
    ),
    (
        "entry vector",
        {"steering": {"entries": [{"vector": "nope", "layer": 1, "scale": 1}]}},
        400,
        "unknown vector",
        "steering.entries[0].vector",
    ),
    (
        "entry scale",
        {"steering": {"entries": [{"vector": "tiny/v1/recall", "layer": 1, "scale": 1e9}]}},
        400,
        "outside",
        "steering.entries[0].scale",
    ),
    (
        "entry positions",
        {"steering": {"entries": [{"vector": "tiny/v1/recall", "layer": 1, "positions": "x"}]}},
        400,
        "positions",
        "steering.entries[0].positions",
    ),
    (
        "entry op",
        {
            "steering": {
                "entries": [{"vector": "tiny/v1/recall", "layer": i} for i in (1, 2)]
                + [{"vector": "tiny/v1/recall", "layer": 1, "op": "rotate"}]
            }
        },
        400,
        "'rotate' is not one of add, ablate, replace, interp",
        "steering.entries[2].op",
    ),
    (
        "entry interp alpha",
        {
            "steering": {
                "entries": [{"vector": "tiny/v1/recall", "layer": 1, "op": "interp", "scale": 1.5}]
            }
        },  # fmt: skip
        400,
        "1.5 is outside [0, 1] for op 'interp'",
        "steering.entries[0].scale",
    ),
    (
        "entry op scale not finite",
        {
            "steering": {
                "entries": [
                    {"vector": "tiny/v1/recall", "layer": 1, "op": "ablate", "scale": 1e400}
                ]
            }
        },  # fmt: skip
        400,
        "must be finite",
        "steering.entries[0].scale",
    ),
    (
        "entry layer negative",
        {"steering": {"entries": [{"vector": "tiny/v1/recall", "layer": -1}]}},
        400,
        "out of range",
        "steering.entries[0].layer",
    ),
    (
        "entry layer past the model",
        {
            "steering": {
                "entries": [
                    {"vector": "tiny/v1/recall", "layer": 2},
                    {"vector": "tiny/v1/recall", "layer": 99},
                ]
            }
        },
        400,
        "out of range",
        "steering.entries[1].layer",
    ),
    ("unknown artifact", {"steering": {"artifact": "other"}}, 400, "not loaded", None),
    (
        "prompt too long",
        {"messages": [{"role": "user", "content": "x" * 600}]},
        400,
        "context",
        None,
    ),
    ("prompt + max_tokens too long", {"max_tokens": 505}, 400, "maximum context", "max_tokens"),
    ("unknown model", {"model": "gpt-4"}, 404, "does not exist", "model"),
    (
        "image content",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "content",
        "messages[0].content[0].text",
    ),
    ("top_logprobs alone", {"top_logprobs": 2}, 400, "`logprobs`", "top_logprobs"),
    (
        "top_logprobs, logprobs false",
        {"top_logprobs": 2, "logprobs": False},
        400,
        "`logprobs` must be set to true",
        "top_logprobs",
    ),
    (
        "stream_options alone",
        {"stream_options": {"include_usage": True}},
        400,
        "`stream=True`",
        "stream_options",
    ),
    ("lone surrogate", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "", None),
    ("empty stop", {"stop": [""]}, 400, "", None),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(http: httpx.Client, case: tuple[str, Any, int, str, str | None]) -> None:
    _, change, status, message, param = case
    if isinstance(change, bytes):
        r = http.post(
            "/v1/chat/completions", content=change, headers={"content-type": "application/json"}
        )
    else:  # json.dumps escapes to ASCII, so even a lone surrogate reaches the server
        body = json.dumps(chat_body() | change).encode()
        r = http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert message in err["message"]
    if param is not None:
        assert err["param"] == param


def test_bad_completions_and_ab(http: httpx.Client) -> None:
    base = {"model": MODEL, "max_tokens": 4}
    for change, msg in [
        ({"prompt": [999999]}, "outside the vocabulary"),
        ({"prompt": [[5, 6], [999999]]}, "outside the vocabulary"),
        ({"prompt": [[5, 6], [-1]]}, "prompt"),
        ({"prompt": "\ud800"}, "not valid JSON"),  # a lone surrogate: refused by the parser
        ({"prompt": ["a"] * 129}, "at most 128"),
        ({"prompt": []}, "must not be empty"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x" * 600}, "maximum context length"),
    ]:
        body = json.dumps(base | change).encode()  # json.dumps escapes the lone surrogate
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions/ab", json=chat_body(steering=False))
    assert r.status_code == 400 and r.json()["error"]["param"] == "steering"


def test_oversized_body(http: httpx.Client) -> None:
    big = chat_body("x" * (2 << 20))
    r = http.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no content-length: counted while reading
        yield b'{"model": "llama", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}]}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize(
    "content_type,status",
    [
        ("text/plain", 415),  # what a web page may send cross-site without a preflight
        ("application/x-www-form-urlencoded", 415),  # curl -d without a content type
        ("multipart/form-data; boundary=x", 415),
        (None, 415),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
        ("application/vnd.api+json", 200),
    ],
)
def test_json_only_with_a_json_content_type(
    http: httpx.Client, content_type: str | None, status: int
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    for path, body in [
        ("/v1/chat/completions", chat_body(max_tokens=1)),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1}),
        ("/v1/steering/vectors", {"name": "tiny/v1"}),
    ]:
        r = http.post(path, content=json.dumps(body).encode(), headers=headers)
        assert r.status_code == status, (path, r.text)
        if status == 415:
            assert r.json()["error"]["code"] == "unsupported_media_type"


def test_unknown_route_is_openai_error(http: httpx.Client) -> None:
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# --- the OpenAPI document -----------------------------------------------------------------------


def test_openapi_publishes_request_bodies_and_errors(server: Server, http: httpx.Client) -> None:
    """/openapi.json declares each POST route's JSON body and its OpenAI-format errors, and
    the published schemas hold what the server really takes and answers."""
    import jsonschema

    doc = httpx.get(f"{server.url}/openapi.json").json()

    def schema(name: str) -> jsonschema.Draft202012Validator:
        root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        return jsonschema.Draft202012Validator(root)

    routes = {
        "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletion"),
        "/v1/chat/completions/ab": ("ChatCompletionRequest", "ABResponse"),
        "/v1/completions": ("CompletionRequest", "Completion"),
        "/v1/steering/vectors": ("VectorLoadRequest", "VectorListing"),
    }
    for path, (body, answer) in routes.items():
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{body}", path
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ok.endswith(f"/{answer}"), path
        for status in ("400", "401", "413", "415", "503"):
            err = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert err.endswith("/ErrorResponse"), (path, status)

    entry = {"vector": "tiny/v1/recall", "layer": 1, "scale": 2.0, "positions": "generated"}
    chat_request = schema("ChatCompletionRequest")
    for steering in (
        True,
        False,
        "auto",
        None,
        {"interventions": {"recall": 0.5}},
        {"entries": [entry]},
    ):
        chat_request.validate(chat_body(steering=steering, logprobs=True, top_logprobs=2))
    for bad in ({"temperature": "hot"}, {"steerng": True}, {"steering": {"entries": []}}):
        assert not chat_request.is_valid(chat_body() | bad), bad
    schema("CompletionRequest").validate({"model": MODEL, "prompt": [[1, 2], [3]], "n": 2})

    schema("ChatCompletion").validate(chat(http, FR, steering=True, logprobs=True, top_logprobs=2))
    comp = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "logprobs": 2})
    schema("Completion").validate(comp.json())
    schema("ABResponse").validate(http.post("/v1/chat/completions/ab", json=chat_body(FR)).json())
    schema("VectorListing").validate(http.get("/v1/steering/vectors").json())
    for r in (
        http.post("/v1/chat/completions", json=chat_body(temperature="hot")),
        http.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"}),
        httpx.get(f"{server.url}/v1/models"),
    ):
        assert r.status_code >= 400
        schema("ErrorResponse").validate(r.json())


# --- abort on disconnect, metrics ---------------------------------------------------------------


def engine_family(backend: Any) -> list[psutil.Process]:
    """EngineCore and its children: a process of its own even with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the server's ``AsyncLLM`` always runs it apart)."""
    from steerserve.server.engine_exit import engine_processes

    cores = [psutil.Process(p.pid) for p in engine_processes(backend.llm)]
    assert cores, "no EngineCore process"
    return [q for p in cores for q in (p, *p.children(recursive=True))]


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs if sig == signal.SIGSTOP else reversed(procs):
        if p.is_running():
            p.send_signal(sig)


@contextlib.contextmanager
def frozen(backend: Any) -> Iterator[None]:
    """The engine stopped with SIGSTOP: the server admits requests (counted in flight) and
    hears hang-ups, but no request can produce a token, whatever the machine's speed."""
    family = engine_family(backend)
    signal_all(family, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_all(family, signal.SIGCONT)


def test_stream_disconnect_aborts(
    server: Server, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that hangs up after the first event of a 450-token stream: a 499, the request
    aborted (fewer than 450 tokens sent), none left queued. The engine is frozen from the
    request's first output until the hang-up is settled, so the answer cannot finish first,
    however fast the machine (nor however slowly the hang-up is noticed)."""
    engine = server.app.state.steer.backend
    family = engine_family(engine)
    wrap_generate(monkeypatch, engine, on_first=lambda: signal_all(family, signal.SIGSTOP))
    before_499 = metric(http, "steerserve_requests_total", endpoint="chat", status="499")
    before_tok = metric(http, "steerserve_tokens_total", arm="unsteered", kind="completion")
    body = chat_body("hi", stream=True, max_tokens=450, steering=False)
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():  # the first event, then hang up
                    if line.startswith("data: {"):
                        break
        assert wait_until(lambda: engine.in_flight() == 0, 60), "generation still running"
        assert wait_until(
            lambda: (
                metric(http, "steerserve_requests_total", endpoint="chat", status="499")
                == before_499 + 1
            ),
            60,
        )
    finally:
        signal_all(family, signal.SIGCONT)
    generated = metric(http, "steerserve_tokens_total", arm="unsteered", kind="completion")
    assert 0 < generated - before_tok < 450, generated - before_tok
    assert metric(http, "steerserve_queue_depth") == 0


def test_non_stream_disconnect_aborts(server: Server, http: httpx.Client) -> None:
    """A client that hangs up while its 480-token completion is in flight: a 499, the request
    aborted. The engine is frozen meanwhile, so the answer cannot come first, however fast the
    machine; the hang-up comes once the server holds the request, however slow."""
    engine = server.app.state.steer.backend
    before = metric(http, "steerserve_requests_total", endpoint="completions", status="499")
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 480, "ignore_eos": True}
    # One answered first: AsyncLLM asks EngineCore for its tasks at its first request (then
    # caches them), which a frozen engine would never answer.
    assert http.post("/v1/completions", json=body | {"max_tokens": 1}).status_code == 200

    async def hang_up_in_flight() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            call = asyncio.create_task(c.post("/v1/completions", json=body))
            deadline = time.monotonic() + 60
            while engine.in_flight() == 0:
                assert not call.done(), call.result()
                assert time.monotonic() < deadline, "the request never reached the engine"
                await asyncio.sleep(0.02)
            call.cancel()  # hang up
            with contextlib.suppress(asyncio.CancelledError):
                await call

    with frozen(engine):
        asyncio.run(hang_up_in_flight())
        assert wait_until(lambda: engine.in_flight() == 0, 60)
        assert wait_until(
            lambda: (
                metric(http, "steerserve_requests_total", endpoint="completions", status="499")
                == before + 1
            ),
            60,
        )


def test_metrics_move(http: httpx.Client) -> None:
    def snap() -> tuple[float, ...]:
        return (
            metric(http, "steerserve_requests_total", endpoint="chat", arm="steered", status="200"),
            metric(
                http, "steerserve_requests_total", endpoint="chat", arm="unsteered", status="200"
            ),
            metric(http, "steerserve_requests_total", endpoint="chat", status="400"),
            metric(http, "steerserve_tokens_total", arm="steered", kind="completion"),
            metric(http, "steerserve_tokens_total", arm="steered", kind="prompt"),
            metric(
                http, "steerserve_request_latency_seconds_count", endpoint="chat", arm="steered"
            ),
        )

    before = snap()
    r = chat(http, FR, steering=True, max_tokens=5)
    chat(http, EN, steering=False, max_tokens=5)
    http.post("/v1/chat/completions", json=chat_body(temperature="hot"))
    after = snap()
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1 and after[2] == before[2] + 1
    assert after[3] == before[3] + 5
    assert after[4] == before[4] + r["usage"]["prompt_tokens"]
    assert after[5] == before[5] + 1
    assert metric(http, "steerserve_queue_depth") == 0


# --- isolation under concurrency ----------------------------------------------------------------

MIX: list[Any] = [
    False,
    True,
    "auto",
    {"interventions": {"recall": 0.5}},
    {"interventions": {"translation": -1.5}},
    {"entries": [{"vector": "tiny/v1/translation", "layer": 0, "scale": 3.0}]},
]
PROMPTS = [EN, FR, DE, "Hauptstadt?", "日本の首都はどこですか", "abc def ghi", "Capital of Peru?"]


def _requests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for i in range(32):
        steering, prompt = MIX[i % len(MIX)], PROMPTS[i % len(PROMPTS)]
        kw = {"max_tokens": 6 + i % 5, "steering": steering}
        if i % 2:
            out.append(("/v1/chat/completions", chat_body(prompt, logprobs=True, **kw)))
        else:
            body = {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True}
            out.append(("/v1/completions", body | {"logprobs": 0, **kw}))
    return out


def _answer(r: httpx.Response) -> tuple[Any, ...]:
    assert r.status_code == 200, r.text
    j = r.json()
    c = j["choices"][0]
    if "message" in c:
        lps = [t["logprob"] for t in c["logprobs"]["content"]]
        return c["message"]["content"], j["steering"]["applied"], lps
    return c["text"], j["steering"]["applied"], c["logprobs"]["token_logprobs"]


def test_concurrent_mixed_requests_equal_solo(http: httpx.Client, server: Server) -> None:
    reqs = _requests()
    solo = [_answer(http.post(path, json=body)) for path, body in reqs]
    assert {s[1] for s in solo} == {True, False}

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.url, headers=AUTH, timeout=120, limits=limits
        ) as c:
            return await asyncio.gather(*(c.post(p, json=b) for p, b in reqs))

    together = [_answer(r) for r in asyncio.run(burst())]
    for i, (a, b) in enumerate(zip(solo, together, strict=True)):
        assert a[:2] == b[:2], (i, reqs[i], a, b)
        assert a[2] == pytest.approx(b[2], abs=1e-3), i


# --- steering vectors (admin) -------------------------------------------------------------------


def test_vectors_list_and_load(http: httpx.Client, vectors_dir: Path, tiny_llama: Path) -> None:
    listing = http.get("/v1/steering/vectors").json()
    assert listing["default"] == "tiny/v1"
    [art] = listing["data"]
    assert art["interventions"] == ["recall", "translation"]
    assert art["manifest"]["interventions"][0]["sha256"]
    for name in ("../tiny", "/etc/passwd", "tiny/../../x", "tiny/v1/recall", "a b", ""):
        r = http.post("/v1/steering/vectors", json={"name": name})
        assert r.status_code == 400 and r.json()["error"]["param"] == "name", name
    r = http.post("/v1/steering/vectors", json={"name": "tiny/v9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "artifact_not_found"
    r = http.post("/v1/steering/vectors", json={"path": str(vectors_dir)})
    assert r.status_code == 400
    # a new version appears on disk: load it at run time and make it the default
    make_artifact(vectors_dir, tiny_llama, "v2", seed=5)
    r = http.post("/v1/steering/vectors", json={"name": "tiny/v2", "default": True})
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == "tiny/v2" and r.json()["default"] == "tiny/v2"
    try:
        on = chat(http, EN, steering=True)
        assert {i["version"] for i in on["steering"]["interventions"]} == {"v2"}
        pinned = chat(http, EN, steering={"artifact": "tiny/v1"})
        assert {i["version"] for i in pinned["steering"]["interventions"]} == {"v1"}
        latest = chat(http, EN, steering={"artifact": "tiny"})  # a name alone: its latest
        assert {i["version"] for i in latest["steering"]["interventions"]} == {"v2"}
    finally:
        r = http.post("/v1/steering/vectors", json={"name": "tiny/v1", "default": True})
        assert r.status_code == 200 and r.json()["default"] == "tiny/v1"


@pytest.mark.parametrize(
    "host,key,open_admin,status",
    [
        ("0.0.0.0", None, False, 403),  # the image's default address, no key: refused
        ("::", None, False, 403),
        ("10.1.2.3", None, False, 403),
        ("0.0.0.0", None, True, 503),  # explicit opt-in: allowed (the engine is not loaded here)
        ("0.0.0.0", KEY, False, 503),  # a key guards it
        ("127.0.0.1", None, False, 503),  # loopback only
        ("localhost", None, False, 503),
        ("::1", None, False, 503),
    ],
)
def test_admin_refused_open_beyond_loopback(
    tiny_llama: Path, host: str, key: str | None, open_admin: bool, status: int
) -> None:
    """The admin endpoint (it changes what every client gets) refuses to run without an API key
    on a non-loopback address unless the operator opts in; the app is served without its engine
    (lifespan off), since the refusal comes first."""
    from steerserve.server import create_app

    settings = tiny_settings(tiny_llama, api_key=key, host=host, open_admin=open_admin)
    srv = Server(create_app(settings), lifespan="off")
    srv.listen()
    try:
        headers = AUTH if key else {}
        r = httpx.post(f"{srv.url}/v1/steering/vectors", json={"name": "tiny"}, headers=headers)
        assert r.status_code == status, r.text
        if status == 403:
            assert r.json()["error"]["code"] == "admin_disabled"
            assert "STEERSERVE_API_KEY" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_admin_load_names_the_refusal(
    http: httpx.Client, vectors_dir: Path, tiny_llama: Path, tiny_gemma: Path
) -> None:
    """An artifact that exists but cannot be loaded is a 422 with the reason, not a 404."""
    for kind in ("sha256", "truncated tensors", "manifest"):
        name = f"broken-{kind.split()[0]}"
        path = make_artifact(vectors_dir, tiny_llama, "v1", name=name)
        words = corrupt(path, kind)
        r = http.post("/v1/steering/vectors", json={"name": f"{name}/v1"})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "artifact_refused" and words in err["message"], err
        assert http.post("/v1/steering/vectors", json={"name": name}).status_code == 422
    make_artifact(vectors_dir, tiny_gemma, "v1", name="gemma-only")
    r = http.post("/v1/steering/vectors", json={"name": "gemma-only"})
    assert r.status_code == 422 and "different model" in r.json()["error"]["message"], r.text
    assert "broken-sha256/v1" not in http.get("/v1/steering/vectors").text


def test_a_hot_load_reads_only_the_artifact_it_loads(
    http: httpx.Client, vectors_dir: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hot-load verifies the versions of the name it loads, not every artifact in the folder
    (issue 33: a rescan hashing the whole folder took 28 s under load). The real loader runs,
    watched: it opens only the loaded name's versions (before, every artifact's)."""
    import steerserve.artifacts.store as artifacts  # where scan_artifacts calls it

    opened: list[str] = []
    real = artifacts.load_artifact

    def watched(path: Any, *a: Any, **kw: Any) -> Any:
        opened.append(Path(path).parent.name)
        return real(path, *a, **kw)

    monkeypatch.setattr(artifacts, "load_artifact", watched)
    make_artifact(vectors_dir, tiny_llama, "v1", name="another")
    make_artifact(vectors_dir, tiny_llama, "v1", name="quick")
    make_artifact(vectors_dir, tiny_llama, "v2", name="quick", seed=1)
    r = http.post("/v1/steering/vectors", json={"name": "quick"})
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == "quick/v2"
    assert opened == ["quick", "quick"], opened


@pytest.mark.parametrize(
    "steering,kind", [("auto", "sha256"), ("auto", "truncated tensors"), ("auto", "manifest"),
                      ("on", "sha256"), ("off", "sha256")],
)  # fmt: skip
def test_corrupt_artifact_refuses_start(
    tiny_llama: Path, tmp_path: Path, steering: str, kind: str
) -> None:
    """A corrupt artifact for the served model stops the start (before the engine loads) under
    every policy, naming the artifact and the reason: /ready says "failed" (the CLI exits 1).
    Before, ``auto`` came up ready with steering silently off."""
    from steerserve.server import create_app

    make_artifact(tmp_path, tiny_llama, "v1")
    words = corrupt(make_artifact(tmp_path, tiny_llama, "v2", seed=1), kind)
    # an engine that starts: without the check, the server would come up ready
    srv = Server(create_app(tiny_settings(tiny_llama, tmp_path, api_key=None, steering=steering)))
    try:
        with pytest.raises(RuntimeError) as e:
            srv.start(timeout=120)
        assert "failed verification" in str(e.value) and words in str(e.value)
        assert str(tmp_path / "tiny" / "v2") in str(e.value)
    finally:
        srv.stop()


# --- the request path ---------------------------------------------------------------------------

#: The server's modules, callers before callees: a request only ever calls downwards.
LAYERS = (
    "app", "guard", "pipeline", "streaming", "job", "flight", "enrolment", "state", "endpoints",
    "hosted", "policy", "backend", "drain", "capacity", "grammar", "experiment", "body",
    "protocol", "answers", "vllm_errors", "steering", "errors", "metrics", "defaults",
)  # fmt: skip


def _server_module(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name.rsplit(".", 1)[-1] if name.startswith("steerserve.server.") else None


def test_steered_chat_takes_one_path_through_the_server(server: Server, http: httpx.Client) -> None:
    """Trace the calls between server modules (in the server's event-loop thread) while a steered
    chat request is answered: app -> pipeline, which calls each stage's module; no module calls
    back into one above it."""
    import sys

    edges: list[tuple[str, str]] = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_back is not None:
            callee, caller = _server_module(frame), _server_module(frame.f_back)
            if callee and caller and caller != callee and (caller, callee) not in edges:
                edges.append((caller, callee))

    loop = server.server.servers[0].get_loop()
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: (sys.settrace(tracer), done.set()))
    assert done.wait(10)
    try:
        r = chat(http, FR, steering=True)
    finally:
        done.clear()
        loop.call_soon_threadsafe(lambda: (sys.settrace(None), done.set()))
        assert done.wait(10)
    assert r["steering"]["applied"]
    print("module calls, in order:", " ".join(f"{a}->{b}" for a, b in edges))
    # the first call out of app (the engine watch's state -> backend may come earlier)
    assert next(e for e in edges if e[0] == "app") == ("app", "pipeline")
    stages = {"pipeline", "body", "protocol", "endpoints", "policy", "backend"}
    assert {b for _, b in edges} >= stages
    assert {a for a, b in edges if b == "pipeline"} == {"app"}  # one way in
    for a, b in edges:  # one way down: never back into a module above
        assert LAYERS.index(a) < LAYERS.index(b), (a, b, edges)


def test_x_request_id_names_the_answer(http: httpx.Client) -> None:
    """As stock vLLM: the answer's id is named by the client's ``X-Request-Id`` (collected and
    streamed), which the answer's headers echo; an id that is no visible ASCII is a 400."""
    rid = {"X-Request-Id": "my-req-123"}
    r = http.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers=rid)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "chatcmpl-my-req-123" and r.headers["x-request-id"] == "my-req-123"
    body = chat_body(max_tokens=2) | {"stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=rid) as r:
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line[6:7] == "{"}
    assert ids == {"chatcmpl-my-req-123"} and r.headers["x-request-id"] == "my-req-123"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1},
                  headers=rid)  # fmt: skip
    assert r.json()["id"] == "cmpl-my-req-123", r.text
    r = http.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-Id": "a b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id", r.text
