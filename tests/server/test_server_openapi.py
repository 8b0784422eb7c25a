"""/openapi.json agrees with the server: schemathesis, every check, every operation, over real
HTTP on the tiny model, derandomized (the same cases every run), so a failure is a real mismatch.

Generation bodies carry generated model names, which the server answers 404 before the engine
runs: the document's request and error shapes are what is checked here; the engine path has its
own fuzz test (test_server_hardening.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from _server import AUTH, KEY, MODEL, Server, make_artifact, tiny_server

#: Cases per operation and phase: 150 took 280 s on two cores once the document held 20 POST
#: operations, 50 took 161 s of a 42-minute CI (2026-12-07); the bodies' wide search is the fuzz
#: test's (test_server_hardening).
EXAMPLES = 30
#: The one seed (with ``deterministic``): the same cases every run, so a failure is a mismatch.
SEED = 1
#: The routes whose bodies are vLLM's request models.
GENERATION_PATHS = r"^/(v1/(chat/completions(/ab)?|completions|responses|messages)|invocations)$"
TOKENIZE_PATHS = r"^(/v1)?/(tokenize|detokenize)$"
#: Checks that must have run (a config change that turned one off fails the test).
CHECKS = {
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "positive_data_acceptance",
    "negative_data_rejection",
    "unsupported_method",
    "allow_header_conformance",
    "ignored_auth",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Server]:
    """A server with every route live: an API key (so the document declares it), an A/B
    experiment with a decision log (feedback and the experiment reports answer)."""
    root = tmp_path_factory.mktemp("openapi")
    make_artifact(root / "vectors", tiny_llama, "v1")
    engine = {"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}
    ab = {"ab_split": 0.5, "ab_name": "openapi", "ab_log": str(root / "ab.jsonl")}
    with tiny_server(tiny_llama, root / "vectors", engine, **ab) as srv:
        yield srv


def _schema(server: Server) -> Any:
    """The served document, with the settings of ``schemathesis run --checks all``."""
    config = schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "workers": 1,
            "checks": {"enabled": True},  # every check: `--checks all`
            "auth": {"openapi": {"apiKey": {"bearer": KEY}}},
            "generation": {"max-examples": EXAMPLES, "deterministic": True, "database": "none"},
            "cache": {"enabled": False},  # nothing written into the checkout
            # vLLM's request models (hosted for chat, completions, tokenize) check far more
            # than their JSON Schema says (cross-field rules, the tokenizer, the template): a
            # schema-valid body may still be a 400 naming its field. Every other check runs.
            "operations": [
                {
                    "include-path-regex": GENERATION_PATHS,
                    "checks": {"positive_data_acceptance": {"enabled": False}},
                },
                # /tokenize and /detokenize refuse every body the document refuses (a wrong
                # `tool_calls` included, issue 44); like vLLM's they refuse more than it says
                # (ids outside the vocabulary, an empty conversation, harmony messages)
                {
                    "include-path-regex": TOKENIZE_PATHS,
                    "checks": {
                        "positive_data_acceptance": {"enabled": False},
                    },
                },
            ],
        }
    )
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


def test_the_document_agrees_with_the_server(server: Server) -> None:
    """Every phase schemathesis runs (examples, coverage: wrong methods, missing auth, edge
    values; fuzzing: valid and invalid bodies and parameters) and every check: no 5xx, and no
    status, content type, header or body that the document does not describe. (The pytest
    integration would do the same but does not run under pytest 9.2; this is the CLI's engine.)"""
    from schemathesis.engine import Status, events, from_schema

    schema = _schema(server)
    operations = {op.ok().label for op in schema.get_all_operations()}
    failures: list[str] = []
    tested: set[str] = set()
    statuses: Counter[int] = Counter()
    ran: set[str] = set()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished) and event.label:
            tested.add(event.label)
            statuses.update(
                i.response.status_code for i in event.recorder.interactions.values() if i.response
            )
            ran |= {c.name for checks in event.recorder.checks.values() for c in checks}
            failures += [
                f"{event.label}: {check.name}: {check.failure_info.failure.title}\n"
                f"{check.failure_info.failure.message}\n{check.failure_info.code_sample}"
                for checks in event.recorder.checks.values()
                for check in checks
                if check.status == Status.FAILURE and check.failure_info is not None
            ]
        elif isinstance(event, events.NonFatalError):
            failures.append(f"{event.label}: error: {event.value!r}")
        elif isinstance(event, events.FatalError):
            failures.append(f"fatal: {event.exception!r}")
    print(f"schemathesis: {sum(statuses.values())} calls, statuses {sorted(statuses.items())}")
    assert not failures, "\n\n".join(failures[:10])
    assert tested >= operations, operations - tested
    assert ran >= CHECKS, CHECKS - ran
    assert not [s for s in statuses if s >= 500], statuses
    assert sum(statuses.values()) >= 10 * len(operations), statuses


def test_openapi_publishes_json_schema_only(server: Server) -> None:
    """pydantic's own keywords (``ge``, ``le``) never leak into the document: a client reading
    it would not know a bound that the server enforces."""
    doc = httpx.get(f"{server.url}/openapi.json").json()
    leaked: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if where.rsplit("/", 1)[-1] != "properties":
                leaked.extend(f"{where}/{k}" for k in ("ge", "le", "gt", "lt") if k in node)
            for k, v in node.items():
                walk(v, f"{where}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{where}/{i}")

    walk(doc, "")
    assert not leaked, leaked


def test_options_names_every_method_of_a_path(server: Server) -> None:
    """``GET`` and ``POST /v1/steering/vectors`` are two routes: a 405 names both."""
    r = httpx.options(f"{server.url}/v1/steering/vectors", headers=AUTH)
    assert r.status_code == 405, r.text
    assert r.headers["allow"] == "GET, POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


def _usage(server: Server, path: str, body: dict[str, Any]) -> dict[str, int]:
    r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_completion_max_tokens_null_is_the_default_16(server: Server) -> None:
    """SDKs send unset fields as null: on /v1/completions that is OpenAI's default of 16, never
    a run to the context limit."""
    body = {"model": MODEL, "prompt": "The capital of France is", "ignore_eos": True}
    assert (
        _usage(server, "/v1/completions", {**body, "max_tokens": None})["completion_tokens"] == 16
    )
    assert _usage(server, "/v1/completions", body)["completion_tokens"] == 16


def test_chat_max_tokens_null_is_absent(server: Server) -> None:
    """On chat, null and absent both mean "up to the context limit" (OpenAI's and vLLM's
    reading); a long prompt keeps the run short."""
    long = " ".join(["word"] * 40)  # 218 tokens with the chat template
    body = {"model": MODEL, "messages": [{"role": "user", "content": long}], "ignore_eos": True}
    nulls = {"max_tokens": None, "max_completion_tokens": None}
    for sent in (body, {**body, **nulls}):
        usage = _usage(server, "/v1/chat/completions", sent)
        assert usage["prompt_tokens"] < 240, usage  # a short run, whatever the tokenizer
        assert usage["total_tokens"] == 256, (sent, usage)  # the context limit (max_model_len)
