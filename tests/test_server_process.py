"""``steerserve serve`` as a user runs it: a subprocess configured by STEERSERVE_* variables, vLLM in
its default multi-process mode; liveness before readiness, and SIGTERM drains in-flight work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from test_server import FR, free_port, make_artifact

KEY = "proc-key"


def test_cli_serve_multiprocess_sigterm_drains(tiny_llama: Path, tmp_path: Path) -> None:
    vectors = tmp_path / "vectors"
    make_artifact(vectors, tiny_llama, "v1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # production mode: EngineCore + worker processes
        "STEERSERVE_MODEL": str(tiny_llama),
        "STEERSERVE_VECTORS_DIR": str(vectors),
        "STEERSERVE_PORT": str(port),
        "STEERSERVE_DTYPE": "float32",
        "STEERSERVE_MAX_MODEL_LEN": "512",
        "STEERSERVE_KV_CACHE_BYTES": str(64 << 20),
        "STEERSERVE_API_KEY": KEY,
        "STEERSERVE_STEERING": "on",
        "STEERSERVE_SERVED_MODEL_NAME": "tiny",
        "STEERSERVE_LOG_LEVEL": "warning",
    }
    log_path = tmp_path / "serve.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "steerserve", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        # liveness comes first, readiness once the engine is loaded
        saw_loading, deadline = False, time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, _tail(log_path)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    ready = httpx.get(f"{url}/ready", timeout=2)
                    if ready.status_code == 200:
                        break
                    assert ready.status_code == 503 and ready.json()["status"] == "loading"
                    saw_loading = True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("not ready in time:\n" + _tail(log_path))
        assert saw_loading

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        resp = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": FR}],
            max_tokens=5,
            temperature=0,
        )
        steering = resp.model_extra["steering"]
        assert steering["applied"] and steering["policy"] == "on"  # STEERSERVE_STEERING=on

        # SIGTERM while a stream is in flight: it completes, new connections are refused
        result: dict[str, object] = {}
        first = threading.Event()

        def stream() -> None:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            lines = []
            headers = {"Authorization": f"Bearer {KEY}"}
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()
            result["lines"] = lines

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        refused = False
        for _ in range(50):
            try:
                httpx.get(f"{url}/health", timeout=1)
            except httpx.TransportError:
                refused = True
                break
            time.sleep(0.1)
        t.join(120)
        assert proc.wait(120) == 0, _tail(log_path)
        assert refused
        lines = result["lines"]
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][6:])["usage"]
        assert usage["completion_tokens"] == 400
        assert "Traceback" not in _tail(log_path, 100_000)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:]
