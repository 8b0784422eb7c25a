"""Issue 44's outside probe (item 5) over real HTTP on the tiny Llama: preset names follow one
rule, no client string is echoed whole in an error, and each body the probe found refused though
the published schema allowed it is now either served or refused by the document too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from _server import MODEL, Server, make_artifact, tiny_server

from steerserve.server.errors import MAX_PARAM
from steerserve.server.presets import (
    DEFAULTS,
    PRESET_NAME_RULE,
    check_name,
    parse_option,
    preset_id,
)

HALF = f"{MODEL}:half"
#: An error body that quotes a client string stays under this many bytes, whatever was sent.
SMALL = 2048
HUGE = "m" * 300_000
USER = [{"role": "user", "content": "hi"}]
HUGE_ENTRY = {"vector": HUGE, "layer": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("probe")
    make_artifact(root, tiny_llama, "v1")
    engine = {"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}
    presets = ('half={"interventions": {"recall": 0.5}}',)
    with tiny_server(tiny_llama, root, engine, preset=presets) as srv:
        yield srv


@pytest.fixture(scope="module")
def doc(http: httpx.Client) -> dict[str, Any]:
    return http.get("/openapi.json").json()


# --- 1. preset names ---------------------------------------------------------------------------

LOOK_ALIKE = "steering-\u043en"  # a Cyrillic о: looks like steering-on


@pytest.mark.parametrize(
    ("name", "why"),
    [
        (LOOK_ALIKE, "'\u043e' (U+043E)"),
        ("../../etc", "'/' (U+002F)"),
        (":", "':' (U+003A)"),
        (f"{MODEL}:steering-on", "':' (U+003A)"),
        ("Steering-On", "'S' (U+0053)"),
        ("x" * 3000, "3000 characters"),
        ("-on", "starts with '-'"),
        ("a\x00b", "'\\x00' (U+0000)"),
    ],
)
def test_preset_names_follow_one_rule(name: str, why: str, tiny_llama: Path) -> None:
    """``--preset NAME=SPEC``: a name outside the rule is refused naming the option, the rule
    and what broke it (a look-alike's character by its code point), never echoed whole."""
    from steerserve.server.options import OptionError, read, settings

    with pytest.raises(ValueError) as e:
        parse_option(f"{name}=on")
    message = str(e.value)
    assert why in message and PRESET_NAME_RULE in message, message
    assert len(message) < 400, len(message)
    with pytest.raises(OptionError) as o:
        settings(read({"model": str(tiny_llama), "preset": [f"{name}=on"]}))
    assert o.value.param == "--preset" and PRESET_NAME_RULE in str(o.value)
    with pytest.raises(OptionError) as o:  # --ab-preset: the same rule, said the same way
        settings(read({"model": str(tiny_llama), "ab_preset": name}))
    assert o.value.param == "--ab-preset" and PRESET_NAME_RULE in str(o.value)
    assert len(str(o.value)) < 400


def test_the_built_in_and_ordinary_preset_names_pass() -> None:
    for name in [*DEFAULTS, "half", "v2.1_low-scale", "a", "9" * 63]:
        assert parse_option(f"{name}=on") == (name, True)
        assert check_name(name) == name
    for bad in ("9" * 64, "../x", ""):
        with pytest.raises(ValueError):
            check_name(bad)
        with pytest.raises(ValueError):  # --ab-preset's model id too
            preset_id(MODEL, bad)


@pytest.mark.parametrize(
    "model",
    [f"{MODEL}:{LOOK_ALIKE}", f"{MODEL}:../../etc/passwd", f"{MODEL}:", ":", f"{MODEL}:HALF",
     f"{MODEL}:half\x00", f"{MODEL}:" + "x" * 3000],
)  # fmt: skip
def test_a_client_model_id_is_looked_up_never_parsed(http: httpx.Client, model: str) -> None:
    """A model id naming no preset is the 404 it always was, on generation and tokenize alike,
    and a short one."""
    for path, body in [
        ("/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 1}),
        ("/v1/tokenize", {"model": model, "prompt": "hi"}),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 404, (path, r.text[:200])
        assert r.json()["error"]["code"] == "model_not_found" and len(r.content) < SMALL
    assert http.post("/v1/chat/completions", json={"model": HALF, "messages": USER,
                     "max_tokens": 1}).status_code == 200  # fmt: skip


# --- 2. errors that quote a client string --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", {"model": HUGE, "messages": USER}, 404),
        ("/v1/chat/completions/ab", {"model": HUGE, "messages": USER}, 404),
        ("/v1/completions", {"model": HUGE, "prompt": "hi"}, 404),
        ("/v1/tokenize", {"model": HUGE, "prompt": "hi"}, 404),
        ("/v1/detokenize", {"model": HUGE, "tokens": [1]}, 404),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, HUGE: 1}, 400),
        ("/v1/chat/completions",
         {"model": MODEL, "messages": USER, "steering": {"interventions": {HUGE: 1}}}, 400),
        ("/v1/chat/completions",
         {"model": MODEL, "messages": USER, "steering": {"entries": [HUGE_ENTRY]}}, 400),
        ("/v1/chat/completions",
         {"model": MODEL, "messages": USER, "steering": {"artifact": HUGE}}, 400),
    ],
)  # fmt: skip
def test_an_error_never_echoes_a_client_string_whole(
    http: httpx.Client, path: str, body: dict[str, Any], status: int
) -> None:
    """A 300,000-character model id, field name or vector name: the refusal is a few hundred
    bytes, its start (the field) and end (what the server serves) kept."""
    r = http.post(path, json=body)
    assert r.status_code == status, r.text[:300]
    assert len(r.content) < SMALL, len(r.content)
    err = r.json()["error"]
    assert err["param"] is None or len(err["param"]) <= MAX_PARAM
    if status == 404:
        assert err["message"].startswith("The model 'mmm") and err["message"].endswith(f"'{MODEL}'")


# --- 3. the published schema and the server agree -------------------------------------------------


def _schema_allows(doc: dict[str, Any], path: str, body: dict[str, Any]) -> bool:
    """Whether ``body`` is valid against the request schema ``/openapi.json`` publishes for
    ``path`` (what a client or a fuzzer validates against before sending)."""
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**ref, "components": doc["components"]})
    return validator.is_valid(body)


SALT = {"model": MODEL, "messages": USER, "max_tokens": 1}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # cache_salt: vLLM refuses past 128 characters (its own schema said 1,024) and '@ / \ NUL'
        ("/v1/chat/completions", {**SALT, "cache_salt": "s" * 129}, "cache_salt"),
        ("/v1/chat/completions/ab", {**SALT, "cache_salt": "s" * 129}, "cache_salt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                             "cache_salt": "s" * 129}, "cache_salt"),
        ("/v1/chat/completions", {**SALT, "cache_salt": "a/b"}, "cache_salt"),
        ("/v1/chat/completions", {**SALT, "cache_salt": "s" * 128}, None),
        ("/v1/chat/completions/ab", {**SALT, "cache_salt": "s" * 128}, None),
        # an empty prompt, at any level, is refused (it was served in a list)
        ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi", ""], "max_tokens": 1}, "prompt[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1], []], "max_tokens": 1}, "prompt[1]"),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi"], "max_tokens": 1}, None),
        ("/v1/detokenize", {"model": MODEL, "tokens": []}, "tokens"),
        ("/v1/detokenize", {"model": MODEL, "tokens": [1]}, None),
        # a chat template in the body is never run (not published, refused with the reason)
        ("/v1/tokenize", {"model": MODEL, "messages": USER, "chat_template": "{{ 1 }}"},
         "chat_template"),
        ("/v1/chat/completions", {**SALT, "chat_template": "{{ 1 }}"}, "chat_template"),
        # tool_calls, on any message: null or OpenAI's function tool calls
        ("/v1/tokenize", {"messages": [{**USER[0], "tool_calls": "abc"}]},
         "messages[0].tool_calls"),
        ("/v1/tokenize", {"messages": [{**USER[0], "tool_calls": [1, 2]}]},
         "messages[0].tool_calls[0]"),
        ("/v1/tokenize", {"messages": [{"role": "assistant", "content": "x",
                                        "tool_calls": [{**CALL, "id": 1}]}]},
         "messages[0].tool_calls[0].id"),
        ("/v1/chat/completions", {**SALT, "messages": [*USER, {"role": "assistant",
                                  "content": "x", "tool_calls": "abc"}]},
         "messages[1].tool_calls"),
        ("/v1/tokenize", {"messages": [{"role": "assistant", "content": None,
                                        "tool_calls": [CALL]}]}, None),
        ("/v1/tokenize", {"messages": [{**USER[0], "tool_calls": None}]}, None),
    ],
)  # fmt: skip
def test_the_document_says_what_the_server_does(
    http: httpx.Client, doc: dict[str, Any], path: str, body: dict[str, Any], param: str | None
) -> None:
    """Each body the probe found refused though schema-valid, and its neighbours: a body the
    document allows is served (200); one it refuses is a 400 naming the field."""
    r = http.post(path, json=body)
    if param is None:
        assert r.status_code == 200, r.text[:300]
        assert _schema_allows(doc, path, body)
    else:
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == param, r.text[:300]
        assert not _schema_allows(doc, path, body)
