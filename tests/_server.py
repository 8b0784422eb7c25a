"""The test suite's server fixtures: the tiny server in a thread (:class:`Server`), its
settings, a tiny two-intervention artifact, clients' helpers (chat, metrics) and the texts."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EN = "What is the capital city of France? Please answer briefly."
FR = "Quelle est la capitale de la France ? Réponds brièvement, s'il te plaît."
DE = "Was ist die Hauptstadt von Frankreich? Bitte antworte kurz."
JA = "日本の首都はどこですか"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_artifact(root: Path, model: Path, version: str, seed: int = 0, name: str = "tiny") -> Path:
    """A two-intervention artifact for ``model`` (random directions, large enough to change
    greedy answers of the tiny model)."""
    from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact

    g = torch.Generator().manual_seed(seed)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    manifest = Manifest(
        name=name,
        version=version,
        model=binding_for_model(model),
        interventions=[
            Intervention(
                name="recall",
                tensor="recall",
                layer=1,
                scale=4.0,
                positions="last_prompt_and_generated",
            ),
            Intervention(
                name="translation", tensor="translation", layer=2, scale=2.0, positions="generated"
            ),
        ],
    )
    tensors = {k: torch.randn(hidden, generator=g) for k in ("recall", "translation")}
    path = root / name / version
    save_artifact(path, manifest, tensors)
    return path


def corrupt(path: Path, kind: str) -> str:
    """Damage the artifact at ``path``; the words its refusal names."""
    manifest = path / "manifest.json"
    if kind == "sha256":
        m = json.loads(manifest.read_text())
        m["interventions"][0]["sha256"] = "0" * 64
        manifest.write_text(json.dumps(m))
        return "sha256"
    if kind == "truncated tensors":
        data = (path / "vectors.safetensors").read_bytes()
        (path / "vectors.safetensors").write_bytes(data[: len(data) // 2])
        return "unreadable"
    manifest.write_text("{not json")
    return "invalid JSON"


class Server:
    """uvicorn serving ``create_app`` in a background thread, on a free loopback port."""

    def __init__(self, app: Any, **config: Any) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"log_level": "warning", **config}
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, **config)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 600.0) -> None:
        """Serve and wait until /ready answers 200, or says the engine failed (``timeout``: a
        bound for a machine busy with other work, not a speed target)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/ready", timeout=5)
                if r.status_code == 200:
                    return
                if r.json().get("status") == "failed":
                    raise RuntimeError(r.text)
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError("server not ready")

    def listen(self, timeout: float = 30.0) -> None:
        """Start and wait until it answers /health (the engine may still be loading)."""
        self.thread.start()
        assert wait_until(lambda: _answers(f"{self.url}/health"), timeout), "server not listening"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def tiny_settings(
    model: Path, vectors: Path | None = None, engine: dict[str, Any] | None = None, **settings: Any
) -> Any:
    """ServerSettings for the tiny Llama: float32, 512 tokens, 64 MiB of KV (``engine``: other
    EngineConfig fields), the test key, the artifacts of ``vectors``; ``settings``: more serve
    settings, validated as a start validates them (``api_key=None``: no key)."""
    from steerserve.engine.api import EngineConfig
    from steerserve.server import ServerSettings

    given = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
    cfg = EngineConfig(model=str(model), **given | (engine or {}))
    settings = {"api_key": KEY} | settings
    settings["api_key"] = settings["api_key"] or []
    if vectors is not None:
        settings["vectors_dir"] = str(vectors)
    return ServerSettings(engine=cfg, **settings)


@contextmanager
def tiny_server(
    model: Path, vectors: Path | None = None, engine: dict[str, Any] | None = None, **settings: Any
) -> Iterator[Server]:
    """A started server of :func:`tiny_settings`, stopped on exit."""
    from steerserve.server import create_app

    srv = Server(create_app(tiny_settings(model, vectors, engine, **settings)))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def tiny_http(model: Path, vectors: Path, **settings: Any) -> Iterator[httpx.Client]:
    """A client of a started :func:`tiny_server` with the tiny artifact written to ``vectors``."""
    make_artifact(vectors, model, "v1", seed=0)
    with (
        tiny_server(model, vectors, **settings) as srv,
        httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c,
    ):
        yield c


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


MODEL = "llama"  # the served name: the model folder's name


def chat_body(content: str = EN, **kw: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    return {**body, **kw}


def chat(http: httpx.Client, content: str = EN, **kw: Any) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json=chat_body(content, **kw))
    assert r.status_code == 200, r.text
    assert r.headers["x-steerserve-steering"] == steering_header(r.json()["steering"])
    return r.json()


def steering_header(steering: dict[str, Any]) -> str:
    if not steering["applied"]:
        return "off"
    return json.dumps({k: v for k, v in steering.items() if v is not None}, separators=(",", ":"))


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample over series matching ``labels``."""
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def wait_until(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def wrap_generate(
    monkeypatch: pytest.MonkeyPatch,
    backend: Any,
    on_first: Callable[[], None] = lambda: None,
    before_rest: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Wrap the backend's ``generate`` (the server's one way to the engine): ``on_first()`` runs
    when a request's first output comes, before the server gets it; ``before_rest()`` is awaited
    before the server may read the next. Closing the wrapper closes (aborts) the request."""
    real = backend.generate

    def generate(*args: Any, **kw: Any) -> AsyncIterator[Any]:
        gen = real(*args, **kw)

        async def wrapped() -> AsyncIterator[Any]:
            try:
                try:
                    first = await anext(gen)
                except StopAsyncIteration:
                    return
                on_first()
                yield first
                if before_rest is not None:
                    await before_rest()
                async for out in gen:
                    yield out
            finally:
                await gen.aclose()

        return wrapped()

    monkeypatch.setattr(backend, "generate", generate)
