"""The server on the embedded Gemma 3 270M (`steerserve serve --model gemma-3-270m`) and the
artifact shipped for it in vectors/ (slow: the real model, ~1 min to start on 2 CPU cores). The
default chat model is served in test_server_chat_model.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _server import Server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "vectors"


@pytest.fixture(scope="module")
def default_server() -> Iterator[Server]:
    from steerserve.engine.api import EngineConfig
    from steerserve.models import resolve_model
    from steerserve.server import ServerSettings, create_app

    if not any(VECTORS.glob("gemma-3-270m/*/manifest.json")):
        pytest.skip("no shipped artifact for the default model in vectors/")
    cfg = EngineConfig(model=str(resolve_model("gemma-3-270m")), kv_cache_memory_bytes=256 << 20)
    srv = Server(create_app(ServerSettings(engine=cfg, vectors_dir=str(VECTORS))))
    srv.start(timeout=600)
    yield srv
    srv.stop()


def test_default_model_and_shipped_artifact(default_server: Server) -> None:
    with httpx.Client(base_url=default_server.url, timeout=300) as c:
        models = c.get("/v1/models").json()["data"]
        base = "gemma-3-270m"  # then its artifact's steering presets
        assert [m["id"] for m in models] == [base, f"{base}:steering-on", f"{base}:steering-auto"]
        listing = c.get("/v1/steering/vectors").json()
        assert listing["default"].startswith("gemma-3-270m/")
        assert set(listing["data"][0]["interventions"]) == {"recall", "translation"}
        assert listing["policy"] == "off"  # no shipped vector is confirmed: steering is opt-in

        fewshot = "Q: What is the capital of Italy?\nA: Rome\nQ: What is the capital of France?\nA:"
        body = {"model": "gemma-3-270m", "prompt": fewshot, "max_tokens": 4, "temperature": 0}
        en = c.post("/v1/completions", json=body | {"steering": "auto"}).json()
        assert "Paris" in en["choices"][0]["text"]
        assert en["steering"] == {
            "applied": False,
            "policy": "auto",
            "interventions": [],
            "detected_language": "en",
        }

        fr = "Q : Quelle est la capitale de l'Italie ?\nR : Rome\nQ : Quelle est la capitale de la France ?\nR :"
        chat = {
            "model": "gemma-3-270m",
            "messages": [{"role": "user", "content": fr}],
            "max_tokens": 4,
            "temperature": 0,
        }
        default = c.post("/v1/chat/completions", json=chat).json()["steering"]
        assert default["applied"] is False and default["policy"] == "off"
        r = c.post("/v1/chat/completions", json=chat | {"steering": "auto"})
        assert r.status_code == 200, r.text
        steering = r.json()["steering"]
        assert steering["applied"] and steering["detected_language"] == "fr"
        assert {i["name"] for i in steering["interventions"]} == {"recall", "translation"}
        assert json.loads(r.headers["x-steerserve-steering"]) == steering

        ab = c.post("/v1/chat/completions/ab", json=chat).json()
        assert ab["unsteered"]["steering"]["applied"] is False
        assert ab["steered"]["steering"]["applied"] is True
        assert isinstance(ab["identical"], bool)
