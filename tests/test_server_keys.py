"""Several ``--api-key`` values and ``--served-model-name`` aliases, as in vLLM: any key
authenticates; the first name is the one reported, the others are accepted as ``model``. The app
runs without its engine (no lifespan): an admitted request is the 503 of an engine loading."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from test_server import tiny_settings


def test_any_key_authenticates_and_aliases_name_the_model(tiny_llama: Path) -> None:
    from steerserve.server import create_app

    settings = tiny_settings(tiny_llama, api_key=("k1", "k2"), served_model_name=("tiny", "alias"))
    client = TestClient(create_app(settings))  # no `with`: the engine is never started

    def chat(model: str, key: str) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        auth = {"Authorization": f"Bearer {key}"}
        return client.post("/v1/chat/completions", json=body, headers=auth).status_code

    assert [chat(m, k) for m in ("tiny", "alias") for k in ("k1", "k2")] == [503] * 4
    assert chat("tiny", "k3") == 401
    assert chat("other", "k1") == 404
