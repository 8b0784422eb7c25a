"""Steering presets served as model ids (``<model>:<preset>``), over real HTTP on a tiny Llama
with a tiny artifact: chosen by ``model`` alone with the ``openai`` SDK and lm-eval, listed in
``/v1/models`` with their ``parent``, refused when combined with ``steering``, checked at start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _lm_eval import multiple_choice
from _server import (
    AUTH,
    FR,
    KEY,
    MODEL,
    Server,
    make_artifact,
    metric,
    tiny_server,
    tiny_settings,
)

ON = f"{MODEL}:steering-on"
AUTO = f"{MODEL}:steering-auto"
HALF = f"{MODEL}:half"  # --preset half={"interventions": {"recall": 0.5}}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("vectors")
    make_artifact(root, tiny_llama, "v1", seed=0)
    return root


@pytest.fixture(scope="module")
def server(tiny_llama: Path, root: Path) -> Iterator[Server]:
    with tiny_server(tiny_llama, root, preset=('half={"interventions": {"recall": 0.5}}',)) as srv:
        yield srv


def _ask(oai: openai.OpenAI, model: str, content: str = FR) -> Any:
    return oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
    )


def test_models_lists_presets_with_parent(http: httpx.Client) -> None:
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, ON, AUTO, HALF}
    for pid in (ON, AUTO, HALF):
        assert cards[pid]["parent"] == MODEL and cards[pid]["root"] == MODEL
    assert cards[ON]["steering"] is True and cards[AUTO]["steering"] == "auto"
    assert cards[HALF]["steering"] == {"interventions": {"recall": 0.5}}
    assert "parent" not in cards[MODEL]


def test_sdk_chooses_steering_by_model(oai: openai.OpenAI, http: httpx.Client) -> None:
    """The preset answers steered (its echo names it), the base id unsteered; in one mixed
    batch of concurrent requests, each unsteered row equals its solo answer."""
    solo = _ask(oai, MODEL).choices[0].message.content
    steered = _ask(oai, ON)
    assert steered.model == ON
    echo = steered.model_extra["steering"]
    assert echo["applied"] and echo["preset"] == ON
    assert steered.choices[0].message.content != solo
    before = metric(http, "steerserve_preset_requests_total", preset=ON, status="200")
    with ThreadPoolExecutor(6) as pool:
        rows = list(pool.map(lambda m: _ask(oai, m), [MODEL, ON, MODEL, HALF, MODEL, ON]))
    for model, r in zip([MODEL, ON, MODEL, HALF, MODEL, ON], rows, strict=True):
        assert r.model == model
        if model == MODEL:
            assert r.choices[0].message.content == solo
            assert not r.model_extra["steering"]["applied"]
        else:
            assert r.model_extra["steering"]["preset"] == model
    after = metric(http, "steerserve_preset_requests_total", preset=ON, status="200")
    assert after - before == 2


def test_preset_on_completions_stream_and_ab(http: httpx.Client) -> None:
    body = {"model": ON, "prompt": FR, "max_tokens": 4, "temperature": 0}
    r = http.post("/v1/completions", json=body).json()
    assert r["model"] == ON and r["steering"]["preset"] == ON
    assert r["choices"][0]["steering"]["applied"]
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert {c["model"] for c in chunks} == {ON} and chunks[0]["steering"]["preset"] == ON
    ab = {"model": HALF, "messages": [{"role": "user", "content": FR}], "max_tokens": 4}
    r = http.post("/v1/chat/completions/ab", json=ab).json()
    assert r["steered"]["steering"]["preset"] == HALF
    assert [iv["scale"] for iv in r["steered"]["steering"]["interventions"]] == [2.0]
    assert not r["unsteered"]["steering"]["applied"]


def test_preset_with_steering_or_unknown_model(http: httpx.Client) -> None:
    body = {"model": ON, "messages": [{"role": "user", "content": FR}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body | {"steering": False})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "steering"
    assert ON in err["message"] and "steering" in err["message"]
    r = http.post("/v1/chat/completions", json=body | {"model": f"{MODEL}:nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_lm_eval_runs_steered_by_model_id(
    server: Server, http: httpx.Client, tiny_llama: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """lm-eval's loglikelihood requests with ``model=<preset>``: every one is steered (the
    steered counter rises by lm-eval's request count)."""
    docs = [{"q": f"Q{i}?", "choices": ["yes", "no"], "gold": i % 2} for i in range(3)]
    steered = {"endpoint": "completions", "arm": "steered", "status": "200"}
    before = metric(http, "steerserve_requests_total", **steered)
    multiple_choice(tmp_path, "preset_mc", docs, server.url, ON, tiny_llama, KEY, monkeypatch)
    assert metric(http, "steerserve_requests_total", **steered) - before == 6  # 3 docs x 2


def test_bad_presets_refuse_to_start(tiny_llama: Path, root: Path) -> None:
    """A SPEC that is not a steering value, or a NAME outside the preset-name rule (a whole
    model id among them), is refused with the options; one naming a missing vector, or a name
    that collides, fails the start with the reason."""
    import asyncio

    from steerserve.server.options import OptionError, read, settings
    from steerserve.server.state import ServerState

    for bad in ("nospec", "x={not json", 'x={"interventions": {}}', f"{MODEL}:steering-on=on"):
        with pytest.raises(OptionError) as e:
            settings(read({"model": str(tiny_llama), "preset": [bad]}))
        assert e.value.param == "--preset"
    for presets, why in (
        (('x={"interventions": {"nope": 1}}',), "nope"),
        (("steering-on=on",), "taken"),
    ):
        state = ServerState(tiny_settings(tiny_llama, root, preset=presets))
        try:
            asyncio.run(state.load())
            assert state.load_error is not None and why in str(state.load_error), presets
        finally:
            asyncio.run(state.backend.shutdown())


def test_ab_preset_is_the_experiments_steered_arm(
    tiny_llama: Path, root: Path, tmp_path: Path
) -> None:
    """``--ab-preset``: enrolled users on the steered arm get the preset (echo and decision log
    name it); the unsteered arm stays unsteered."""
    from steerserve.server import create_app

    log = tmp_path / "ab.jsonl"
    settings = tiny_settings(
        tiny_llama,
        root,
        preset=('half={"interventions": {"recall": 0.5}}',),
        ab_split=0.5,
        ab_name="presets",
        ab_log=str(log),
        ab_preset="half",
    )
    srv = Server(create_app(settings))
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
            arms = {}
            for i in range(12):
                body = {"model": MODEL, "messages": [{"role": "user", "content": FR}],
                        "max_tokens": 2, "user": f"user-{i}"}  # fmt: skip
                echo = c.post("/v1/chat/completions", json=body).json()["steering"]
                arms[echo["experiment"]["arm"]] = echo
        assert set(arms) == {"steered", "unsteered"}
        assert arms["steered"]["preset"] == HALF and arms["steered"]["applied"]
        assert "preset" not in arms["unsteered"] and not arms["unsteered"]["applied"]
    finally:
        srv.stop()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r.get("preset") for r in records if r.get("arm") == "steered"} == {HALF}
    assert all("preset" not in r for r in records if r.get("arm") == "unsteered")
