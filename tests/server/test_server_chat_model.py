"""The server on the embedded chat model (Qwen2.5-Coder-1.5B-Instruct, what `steerserve serve`
runs by default) over real HTTP: chat through the ``openai`` SDK, steering off / on / auto, the A/B
endpoint (slow: the real model, about a minute to start on 2 CPU cores, seconds per reply).

It starts from the shipped artifacts for the model (``vectors/qwen2.5-coder-1.5b-instruct/``), as
``steerserve serve`` does, with its default policy ``off``: the newest (v1.1, v1's vectors with
``auto`` gated off for every language) is the default artifact, a Japanese chat without
``steering`` is not steered, with ``"auto"`` it is answered unsteered (no language's
confirmation supports steering), and with ``true`` it gets the interventions
(``test_the_shipped_artifact_is_off_by_default_and_steers_on_request``). Without one (the state
before the chat model's vectors were made), asking for steering is refused. Then an artifact with a random direction is written and loaded through the admin
path (``POST /v1/steering/vectors``), which exercises the steered paths on the real model with a
vector large enough to change answers; the shipped one stays selectable by name. One server for
the whole module: each test here costs seconds of generation, a second server start a minute.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from _server import Server

from steerserve.server.presets import DEFAULTS as PRESETS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NAME = "qwen2.5-coder-1.5b-instruct"
SHIPPED = ROOT / "vectors" / NAME
KEY = "chat-model-key"
JA = "フランスの首都はどこですか？"
EN = "What is the capital of France? Answer with the name of the city only."
#: The probe artifact: a random direction at the middle layer, about four times the residual
#: stream's norm there (~40), so that it changes greedy answers.
PROBE_LAYER, PROBE_NORM = 14, 160.0


def shipped() -> bool:
    return any(SHIPPED.glob("*/manifest.json"))


def newest_shipped() -> str:
    """``name/version`` of the shipped artifact the server serves by default (the newest)."""
    from steerserve.artifacts import version_key

    versions = [p.parent.name for p in SHIPPED.glob("*/manifest.json")]
    return f"{NAME}/{max(versions, key=version_key)}"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from steerserve.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="module")
def vectors_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vectors")
    if shipped():
        shutil.copytree(SHIPPED, root / NAME)
    return root


@pytest.fixture(scope="module")
def server(model_dir: Path, vectors_dir: Path) -> Iterator[Server]:
    from steerserve.engine.api import EngineConfig
    from steerserve.server import ServerSettings, create_app

    # float32: what `steerserve serve` computes in on a CPU without native bfloat16 (faster
    # there; docs/benchmarks.md, "Chat model").
    cfg = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=8,
    )
    settings = ServerSettings(engine=cfg, vectors_dir=str(vectors_dir), api_key=KEY)
    srv = Server(create_app(settings))
    srv.start(timeout=900)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=600) as c:
        yield c


def chat(http: httpx.Client, content: str, status: int = 200, **kw: Any) -> dict[str, Any]:
    body = {"model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0}
    r = http.post("/v1/chat/completions", json=body | {"max_tokens": 12} | kw)
    assert r.status_code == status, r.text
    return r.json()


def text(resp: dict[str, Any]) -> str:
    return resp["choices"][0]["message"]["content"]


def test_a_japanese_chat_through_the_openai_sdk(server: Server) -> None:
    """A chat turn in Japanese gets a Japanese answer that ends the turn (<|im_end|>)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    # the base model, then the shipped artifact's steering presets (test_server_presets.py)
    assert [m.id for m in client.models.list().data] == [NAME, *(f"{NAME}:{p}" for p in PRESETS)]
    resp = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": JA}],
        max_tokens=16,
        temperature=0,
        extra_body={"steering": False},
    )
    answer = resp.choices[0].message.content
    assert "パリ" in answer, answer
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 16
    assert resp.model_extra["steering"]["applied"] is False


def test_english_and_the_default_policy(http: httpx.Client) -> None:
    resp = chat(http, EN)
    assert "Paris" in text(resp)
    assert resp["steering"]["applied"] is False
    listing = http.get("/v1/steering/vectors").json()
    assert listing["policy"] == "off"  # the server's default: steering is opt-in
    if not shipped():
        assert listing["data"] == [] and listing["default"] is None
    else:
        assert listing["default"] == newest_shipped()


@pytest.mark.skipif(not shipped(), reason=f"no artifact for the chat model under {SHIPPED}")
def test_the_shipped_artifact_is_off_by_default_and_steers_on_request(http: httpx.Client) -> None:
    """Served as `steerserve serve` serves it (the shipped artifacts, the default policy, nothing
    else loaded yet): a Japanese chat without a ``steering`` field is not steered (v1's vectors
    are harmful on held-out facts); ``"auto"`` answers it unsteered too, because the default
    artifact's gate lets no language through, and says so (``auto_languages: []``, in the reply
    and the listing); ``true`` still applies the interventions at their calibrated layers,
    scales and positions, with a reply."""
    from steerserve.artifacts import load_artifact

    default_key = newest_shipped()
    manifest = load_artifact(SHIPPED / default_key.split("/")[1]).manifest
    assert manifest.version == "v1.1" and manifest.auto_languages() == [], manifest.languages
    listing = http.get("/v1/steering/vectors").json()
    by_id = {a["id"]: a for a in listing["data"]}
    assert listing["default"] == default_key and by_id[default_key]["auto_languages"] == []
    assert by_id[f"{NAME}/v1"]["auto_languages"] is None  # v1 itself is ungated, not default

    default = chat(http, JA, max_tokens=4)["steering"]
    assert default["applied"] is False and default["policy"] == "off", default
    resp = chat(http, JA, steering="auto")
    info = resp["steering"]
    assert info == {
        "applied": False,
        "policy": "auto",
        "interventions": [],
        "detected_language": "ja",
        "auto_languages": [],
    }, info
    assert text(resp) == text(chat(http, JA, steering=False)), "auto must answer unsteered"

    on = chat(http, JA, steering=True)
    info = on["steering"]
    assert info["applied"] and info["policy"] == "on" and info["detected_language"] is None, info
    got = [
        (i["artifact"], i["version"], i["name"], i["layer"], i["scale"], i["positions"])
        for i in info["interventions"]
    ]
    want = [
        (NAME, manifest.version, iv.name, iv.layer, iv.scale, iv.positions)
        for iv in manifest.interventions
    ]
    assert got == want, info
    assert text(on).strip(), on


@pytest.mark.skipif(shipped(), reason="an artifact for the chat model is shipped")
def test_without_an_artifact_steering_is_refused_not_dropped(http: httpx.Client) -> None:
    """Asking for steering that cannot be applied is a 400, never a silently unsteered reply."""
    for steering in (True, "auto", {"interventions": {"recall": 1.0}}):
        err = chat(http, JA, status=400, steering=steering)["error"]
        assert err["code"] == "no_artifact" and err["param"] == "steering", err
    assert chat(http, EN, steering="auto")["steering"]["applied"] is False  # English: not needed
    body = {"model": NAME, "messages": [{"role": "user", "content": JA}], "max_tokens": 4}
    r = http.post("/v1/chat/completions/ab", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_artifact", r.text


def write_probe(vectors_dir: Path, model_dir: Path) -> str:
    from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact

    binding = binding_for_model(model_dir)
    v = torch.randn(binding.hidden_size, generator=torch.Generator().manual_seed(0))
    manifest = Manifest(
        name="probe",
        version="v1",
        model=binding,
        interventions=[
            Intervention(
                name="recall",
                tensor="recall",
                layer=PROBE_LAYER,
                scale=1.0,
                positions="last_prompt_and_generated",
            )
        ],
    )
    save_artifact(vectors_dir / "probe" / "v1", manifest, {"recall": v / v.norm() * PROBE_NORM})
    return manifest.vector_name("recall")


@pytest.fixture(scope="module")
def probe(http: httpx.Client, vectors_dir: Path, model_dir: Path) -> str:
    """A random-direction artifact, written now and loaded through the admin path."""
    vector = write_probe(vectors_dir, model_dir)
    r = http.post("/v1/steering/vectors", json={"name": "probe", "default": True})
    assert r.status_code == 200, r.text
    assert r.json()["loaded"] == "probe/v1" and r.json()["default"] == "probe/v1"
    return vector


def test_steering_on_auto_and_entries(http: httpx.Client, probe: str) -> None:
    plain = chat(http, JA, steering=False)
    on = chat(http, JA, steering=True)
    assert on["steering"]["applied"] is True and on["steering"]["policy"] == "on"
    [iv] = on["steering"]["interventions"]
    assert (iv["artifact"], iv["vector"], iv["layer"]) == ("probe", probe, PROBE_LAYER)
    assert text(on) != text(plain), "a vector 4x the residual norm changed nothing"
    auto = chat(http, JA, steering="auto")
    assert auto["steering"]["applied"] and auto["steering"]["detected_language"] == "ja"
    assert text(auto) == text(on)
    en = chat(http, EN, steering="auto")
    assert en["steering"]["applied"] is False and en["steering"]["detected_language"] == "en"
    entries = {"entries": [{"vector": probe, "layer": PROBE_LAYER, "scale": 1.0}]}
    explicit = chat(http, JA, steering=entries)
    assert explicit["steering"]["applied"] and explicit["steering"]["policy"] == "entries"
    zero = chat(http, JA, steering={"interventions": {"recall": 0.0}})
    assert text(zero) == text(plain), "scale 0 must equal unsteered"


def test_ab_endpoint(http: httpx.Client, probe: str) -> None:
    body = {"model": NAME, "messages": [{"role": "user", "content": JA}], "max_tokens": 12}
    r = http.post("/v1/chat/completions/ab", json=body | {"temperature": 0})
    assert r.status_code == 200, r.text
    ab = r.json()
    assert ab["unsteered"]["steering"]["applied"] is False
    assert ab["steered"]["steering"]["applied"] is True
    assert ab["identical"] is False
    assert text(ab["unsteered"]) == text(chat(http, JA, steering=False))
    assert [i["vector"] for i in ab["steered"]["steering"]["interventions"]] == [probe]


@pytest.mark.skipif(not shipped(), reason=f"no artifact for the chat model under {SHIPPED}")
def test_the_shipped_artifact(http: httpx.Client) -> None:
    """The shipped vectors load for the converted model and apply on request."""
    listing = http.get("/v1/steering/vectors").json()
    keys = [a["id"] for a in listing["data"] if a["name"] != "probe"]
    assert keys, listing
    resp = chat(http, JA, steering={"artifact": keys[0]})
    assert resp["steering"]["applied"] and resp["steering"]["interventions"]
