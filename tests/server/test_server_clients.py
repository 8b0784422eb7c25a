"""The clients people point at an OpenAI-compatible server, against steerserve serving vLLM's own
OpenAI layer on a tiny random Llama: the ``openai`` SDK's structured outputs and tool calls,
LangChain's tools and structured output, lm-evaluation-harness' loglikelihood requests, each also
steered, and the A/B endpoint with ``response_format``.

A random model writes nonsense, so every check here rests on what constrained decoding guarantees
(the output parses against the schema, the tool call names the tool) and on steering being
applied (the ``steering`` echo, and a steered answer that differs from the unsteered one)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from _lm_eval import multiple_choice
from _server import KEY, MODEL, Server, make_artifact, tiny_server
from pydantic import BaseModel

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
        "strict": True,  # the arguments follow the schema (else any JSON: OpenAI's rule)
    },
}
STEERED = {"steering": True}  # the served artifact's interventions


class Verdict(BaseModel):
    """A schema a random model can finish within a few tokens (enums and a boolean)."""

    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("vectors")
    make_artifact(root, tiny_llama, "v1", seed=0)
    # compact JSON: a random model would otherwise fill its budget with whitespace
    grammar = {"backend": "xgrammar", "disable_any_whitespace": True}
    engine = {"extra": {"structured_outputs_config": grammar}}
    # hermes: the tiny template has no tool tags for "auto" to see
    with tiny_server(tiny_llama, root, engine, steering="off", tool_call_parser="hermes") as srv:
        yield srv


MESSAGES = [{"role": "user", "content": "Is Paris the capital of France?"}]


@pytest.fixture(scope="module")
def no_ws(http: httpx.Client) -> dict[str, int]:
    """``logit_bias`` keeping a random model from writing JSON whitespace, which a tool call's
    arguments allow (``disable_any_whitespace`` does not reach structural tags)."""
    body = {"model": MODEL, "prompt": " \t\n\r", "add_special_tokens": False}
    ids = http.post("/v1/tokenize", json=body).json()["tokens"]
    assert len(ids) == 4
    return {str(i): -100 for i in ids}


def _steering(extra: dict[str, Any] | None) -> bool:
    return bool(extra and extra.get("steering"))


@pytest.mark.parametrize("extra", [None, STEERED], ids=["unsteered", "steered"])
def test_sdk_parse_pydantic(oai: openai.OpenAI, extra: dict[str, Any] | None) -> None:
    """``chat.completions.parse(response_format=PydanticModel)``: schema-valid, parsed."""
    r = oai.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        response_format=Verdict,
        max_tokens=64,
        temperature=0,
        extra_body=extra,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Verdict), r.choices[0].message.content
    assert r.model_extra["steering"]["applied"] is _steering(extra)


def test_sdk_streamed_parse_and_json_object(oai: openai.OpenAI, http: httpx.Client) -> None:
    """The SDK's streamed parse, and ``json_object`` / vLLM's ``structured_outputs``."""
    with oai.chat.completions.stream(
        model=MODEL,
        messages=MESSAGES,
        response_format=Verdict,
        max_tokens=64,
        temperature=0,
        extra_body=STEERED,
    ) as s:
        final = s.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Verdict)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 48, "temperature": 0}
    choice = {"structured_outputs": {"choice": ["oui", "non"]}}
    r = http.post("/v1/chat/completions", json=body | choice | STEERED).json()
    assert r["choices"][0]["message"]["content"] in ("oui", "non") and r["steering"]["applied"]
    regex = {"structured_outputs": {"regex": "[0-9]{3}"}}
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "n:", **regex}).json()
    assert len(r["choices"][0]["text"]) == 3 and r["choices"][0]["text"].isdigit()


@pytest.mark.parametrize("extra", [None, STEERED], ids=["unsteered", "steered"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_sdk_tool_round_trip(
    oai: openai.OpenAI, extra: dict[str, Any] | None, choice: str, no_ws: dict[str, int]
) -> None:
    """``tool_choice`` required or named: a tool call whole and streamed (the same call at
    temperature 0), then the ``tool`` turn sent back and answered."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    tool_choice: Any = "required" if choice == "required" else named
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
        logit_bias=no_ws,
        extra_body=extra,
    )
    r = oai.chat.completions.create(**kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    assert r.model_extra["steering"]["applied"] is _steering(extra)
    name, args, finish = "", "", None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                name += d.function.name or "" if d.function else ""
                args += d.function.arguments or "" if d.function else ""
            finish = c.finish_reason or finish
    assert name == "get_weather" and json.loads(args) == json.loads(call.function.arguments)
    assert finish in ("tool_calls", "stop")
    follow = oai.chat.completions.create(
        model=MODEL,
        messages=[
            *MESSAGES,
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
        ],
        tools=[WEATHER],
        max_tokens=8,
        temperature=0,
        extra_body=extra,
    )
    assert follow.choices[0].finish_reason in ("length", "stop")


def test_bad_tools_and_structured_outputs(http: httpx.Client) -> None:
    """Bad input around the new fields: a 400 naming the field, never a 500 or an answer
    without the constraint."""
    base = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    unnamed = {"type": "function", "function": {"parameters": {}}}
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "schema",
        ),  # fmt: skip
        ({"tools": [unnamed]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),  # fmt: skip
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"echo": True}, "echo"),
        ({"vllm_xargs": {"steerserve": "[]"}}, "vllm_xargs.steerserve"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"request_id": "mine"}, "request_id"),
        ({"use_beam_search": True, "n": 2, **STEERED}, "use_beam_search"),
    ]
    for change, what in cases:
        r = http.post("/v1/chat/completions", json=base | change)
        assert r.status_code == 400, (change, r.text)
        err = r.json()["error"]
        assert what in err["message"] or what == err["param"], (change, err)
    ok = http.post("/v1/chat/completions", json=base | {"store": False, "metadata": {"a": "b"}})
    assert ok.status_code == 200, ok.text


def test_sampling_extras_reach_the_sampler(http: httpx.Client) -> None:
    """vLLM's sampling fields are honoured, steered too: ``logit_bias`` forces a token,
    ``allowed_token_ids`` confines the answer, ``min_tokens`` delays the end."""
    tok = http.post("/v1/tokenize", json={"model": MODEL, "prompt": "Z"}).json()["tokens"][-1]
    base = {"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0, **STEERED}
    r = http.post("/v1/completions", json=base | {"logit_bias": {str(tok): 100}}).json()
    assert r["choices"][0]["text"] == "ZZZZZZ" and r["steering"]["applied"]
    r = http.post("/v1/completions", json=base | {"allowed_token_ids": [tok]}).json()
    assert r["choices"][0]["text"] == "ZZZZZZ"
    for field in ({"top_k": 3, "temperature": 1.0, "seed": 1}, {"min_p": 0.1, "seed": 1},
                  {"repetition_penalty": 1.3}, {"min_tokens": 4}, {"stop_token_ids": [2]}):  # fmt: skip
        r = http.post("/v1/completions", json=base | field)
        assert r.status_code == 200, (field, r.text)
    beams = base | {"steering": False, "use_beam_search": True, "n": 2}
    r = http.post("/v1/completions", json=beams)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_tokenize_detokenize_version(server: Server, http: httpx.Client) -> None:
    r = http.post("/v1/tokenize", json={"model": MODEL, "prompt": "héllo"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    chat = http.post("/v1/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert chat["count"] > r["count"]
    back = http.post("/v1/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back["prompt"].endswith("héllo")
    assert httpx.get(f"{server.url}/version").json()["version"].startswith("0.")


def test_ab_with_response_format(http: httpx.Client) -> None:
    """The A/B endpoint takes the same fields: both arms schema-valid, streamed with arm tags."""
    schema = {"name": "verdict", "schema": Verdict.model_json_schema()}
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": schema},
    }
    r = http.post("/v1/chat/completions/ab", json=body).json()
    for arm in ("unsteered", "steered"):
        Verdict.model_validate_json(r[arm]["choices"][0]["message"]["content"])
    assert r["steered"]["steering"]["applied"] and not r["unsteered"]["steering"]["applied"]
    texts: dict[str, str] = {"unsteered": "", "steered": ""}
    with http.stream("POST", "/v1/chat/completions/ab", json=body | {"stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    texts[chunk["arm"]] += c["delta"].get("content") or ""
    assert texts == {a: r[a]["choices"][0]["message"]["content"] for a in texts}


def test_echo_logprobs_max_tokens_zero(http: httpx.Client) -> None:
    """What lm-eval's loglikelihood tasks send: ``echo`` + ``logprobs`` + ``max_tokens`` 0 or 1,
    steered too (steering at every position changes the prompt's logprobs)."""
    body = {"model": MODEL, "prompt": "The capital of France is Paris", "echo": True,
            "logprobs": 1, "temperature": 0}  # fmt: skip
    for max_tokens in (0, 1):
        r = http.post("/v1/completions", json=body | {"max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) >= 30
    entry = {"vector": "tiny/v1/recall", "layer": 1, "scale": 8.0, "positions": "all"}
    steered = http.post(
        "/v1/completions", json=body | {"max_tokens": 0, "steering": {"entries": [entry]}}
    ).json()
    plain = http.post("/v1/completions", json=body | {"max_tokens": 0}).json()
    assert steered["steering"]["applied"]
    a, b = (x["choices"][0]["logprobs"]["token_logprobs"][1:] for x in (steered, plain))
    assert a != b


def test_langchain_tools_and_structured_output(server: Server, no_ws: dict[str, int]) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        return "18"

    for extra in (None, STEERED):
        llm = ChatOpenAI(
            model=MODEL,
            base_url=f"{server.url}/v1",
            api_key=KEY,
            temperature=0,
            max_tokens=96,
            max_retries=0,
            logit_bias=no_ws,
            extra_body=extra,
        )
        bound = llm.bind_tools(
            [get_weather], tool_choice="required", strict=True, parallel_tool_calls=False
        )
        msg = bound.invoke("weather?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
        for method in ("json_schema", "function_calling"):
            out = llm.with_structured_output(Verdict, method=method, strict=True).invoke("Paris?")
            assert isinstance(out, Verdict), method


def test_lm_eval_loglikelihood(
    server: Server, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-evaluation-harness ``local-completions`` on a small local multiple-choice task: every
    request is ``echo`` + ``logprobs`` with ``max_tokens`` 1 (stock vLLM's shape), and each
    document gets an accuracy."""
    docs = [
        {"q": f"Question {i}: is {i} even?", "choices": ["yes", "no"], "gold": i % 2}
        for i in range(6)
    ]
    acc = multiple_choice(
        tmp_path, "steerserve_mc", docs, server.url, MODEL, tiny_llama, KEY, monkeypatch
    )
    assert 0.0 <= acc <= 1.0


def test_vllm_metrics_beside_ours(http: httpx.Client, server: Server) -> None:
    """/metrics carries vLLM's ``vllm:*`` names (what dashboards and autoscalers key on) beside
    ``steerserve_*``, counting the requests served."""
    http.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 2})
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:generation_tokens_total",
        "steerserve_requests_total",
    ):
        assert f"\n{name}" in text, name
    done = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in done) >= 1
    # labelled with the served name, never the host's path to the model
    names = {m for m in re.findall(r'^vllm:[^{]*\{[^}]*model_name="([^"]*)"', text, re.M)}
    assert names == {MODEL}, names


def test_compat_doc_lists_every_field() -> None:
    """docs/openai-compat.md has a row for every field of the installed vLLM's chat and
    completions requests (a new vLLM field must be looked at and given a status)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    doc = (Path(__file__).parents[2] / "docs" / "openai-compat.md").read_text()
    chat, _, rest = doc.partition("## Completions")
    for model, section in ((ChatCompletionRequest, chat), (CompletionRequest, rest)):
        missing = [f for f in model.model_fields if f"| `{f}` |" not in section]
        assert not missing, (model.__name__, missing)


def test_research_renders_chats_as_the_server_does(http: httpx.Client, tiny_llama: Path) -> None:
    """The research wing's ``chat_ids`` (what vectors are extracted and calibrated on) gives the
    ids vLLM's renderer gives the server's chat requests, token for token."""
    from transformers import AutoTokenizer

    from steerserve.models.chat import chat_ids

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for messages in (
        MESSAGES,
        [{"role": "system", "content": "Be brief."}, *MESSAGES],
        [*MESSAGES, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "和?"}],
    ):
        r = http.post("/v1/tokenize", json={"model": MODEL, "messages": messages}).json()
        assert r["tokens"] == chat_ids(tok, messages), messages
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        used = http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
        assert used == len(r["tokens"])


@pytest.mark.parametrize("extra", [None, STEERED], ids=["unsteered", "steered"])
def test_anthropic_sdk_messages(server: Server, extra: dict[str, Any] | None) -> None:
    """``POST /v1/messages`` through the unmodified Anthropic SDK (its ``x-api-key`` header),
    collected and streamed, steered and not: vLLM's Messages serving, our ``steering`` echoed."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    ask = {"model": MODEL, "max_tokens": 8, "messages": MESSAGES}
    extra = {"temperature": 0, **(extra or {})}  # greedy (this SDK has no temperature argument)
    m = client.messages.create(**ask, extra_body=extra)
    assert m.type == "message" and m.content[0].type == "text" and m.usage.output_tokens > 0
    assert m.model_extra["steering"]["applied"] is _steering(extra)
    with client.messages.stream(**ask, extra_body=extra) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text  # greedy: the same answer
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            **ask
        )
    with pytest.raises(anthropic.BadRequestError, match="stearing"):
        client.messages.create(**ask, extra_body={"stearing": True})


def test_invocations_route_by_body(http: httpx.Client) -> None:
    """SageMaker's ``/invocations`` as vLLM serves it: a chat body answers a chat completion, a
    completions body a completion, steered as on /v1; any other body is a 400."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    r = http.post("/invocations", json=chat | STEERED)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    assert r.json()["steering"]["applied"]
    r = http.post("/invocations", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = http.post("/invocations", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(str(http.base_url).rstrip("/") + "/invocations", json=chat)  # no key
    assert r.status_code == 401, r.text
