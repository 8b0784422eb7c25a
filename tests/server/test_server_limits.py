"""What one request or one artifact may cost everyone else, over real HTTP on the tiny Llama: the
cap on sequences per request (prompts x n, A/B arms twice) and the seats it leaves for others, and
steering vectors so large they would destroy the residual stream (refused at load; a degenerate
answer is an error, never a 200 with empty text)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from _server import AUTH, MODEL, Server, chat_body, make_artifact, tiny_server

SEATS = 8  # the engine's max_num_seqs here: at most SEATS // 2 = 4 sequences per request


@pytest.fixture(scope="module")
def vectors(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("vectors")
    make_artifact(root, tiny_llama, "v1")
    return root


@pytest.fixture(scope="module")
def server(tiny_llama: Path, vectors: Path) -> Iterator[Server]:
    engine = {"max_model_len": 1024, "max_num_seqs": SEATS}
    with tiny_server(tiny_llama, vectors, engine) as srv:
        yield srv


def _completion(prompts: int, **kw: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": ["abc"] * prompts, "max_tokens": 2, "temperature": 0.5}
    return body | kw


# --- sequences per request ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", _completion(3, n=2), "n", "3 prompts × n 2 = 6 sequences"),
        ("/v1/completions", _completion(5), "prompt", "5 prompts × n 1 = 5 sequences"),
        ("/v1/chat/completions", chat_body(n=5, temperature=0.5), "n", "n 5 = 5 sequences"),
        ("/v1/chat/completions/ab", chat_body(n=3), "n", "n 3 × 2 arms = 6 sequences"),
    ],
)
def test_more_sequences_than_the_cap_is_a_400_naming_the_fields(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    """prompts x n (x 2 arms for A/B) beyond the cap: refused before anything is tokenized, in
    OpenAI's format, naming the field to lower and the count."""
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "too_many_sequences"), err
    assert words in err["message"] and "at most 4" in err["message"], err["message"]


def test_requests_at_the_cap_are_answered(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=_completion(2, n=2))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    r = http.post("/v1/chat/completions/ab", json=chat_body(n=2, temperature=0.5, seed=1))
    assert r.status_code == 200, r.text
    assert [len(r.json()[a]["choices"]) for a in ("unsteered", "steered")] == [2, 2]


def test_a_later_request_is_answered_while_the_largest_allowed_one_runs(server: Server) -> None:
    """The scheduling rule: one request holds at most half the engine's seats, so a 1-token
    request sent while the largest allowed one generates 1000 tokens a sequence gets a free seat
    at the next engine step and is answered while the big one still runs (it needs ~1000 more
    steps; the small one two)."""
    big = _completion(4, max_tokens=1000, ignore_eos=True, temperature=1.0, seed=3, stream=True)
    small = chat_body("hi", max_tokens=1, steering=False)

    backend = server.app.state.steer.backend

    async def run() -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300) as c:
            async with c.stream("POST", "/v1/completions", json=big) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()  # held: a dropped iterator closes the stream (a 499)
                async for line in lines:
                    if line.startswith("data: {"):
                        break  # the big one is generating
                answer = await c.post("/v1/chat/completions", json=small)
                return answer.status_code, backend.in_flight()  # then hang up: aborted

    status, running = asyncio.run(run())
    assert status == 200
    assert running == 4, f"{running} in flight: the big request ended before the small one"


# --- steering vectors that destroy the residual stream ------------------------------------------


def extreme_artifact(root: Path, model: Path, value: float, name: str = "huge") -> Path:
    """A sound artifact (correct sha256 and norm) whose vectors are ``value`` everywhere."""
    from steerserve.artifacts import Intervention, Manifest, binding_for_model, save_artifact

    binding = binding_for_model(model)
    manifest = Manifest(
        name=name,
        version="v1",
        model=binding,
        interventions=[Intervention(name="recall", tensor="recall", layer=1, scale=64.0)],
    )
    path = root / name / "v1"
    save_artifact(path, manifest, {"recall": torch.full((binding.hidden_size,), value)})
    return path


def test_extreme_artifact_is_refused_at_start(tmp_path: Path, tiny_llama: Path) -> None:
    """Vetting at start (before the engine) refuses it, naming the intervention and the bound."""
    from steerserve.artifacts import scan_artifacts
    from steerserve.server.vetting import check_artifacts

    extreme_artifact(tmp_path, tiny_llama, 5e17)
    with pytest.raises(RuntimeError, match=r"intervention 'recall'.*norm") as e:
        check_artifacts(scan_artifacts(tmp_path, tiny_llama), 64.0)
    assert "token embeddings" in str(e.value)


def test_extreme_artifact_is_refused_by_the_admin_load(
    http: httpx.Client, vectors: Path, tiny_llama: Path
) -> None:
    """5e17 everywhere, correct sha256: a 422 naming the intervention, not a 200 and then every
    request answered with empty text; a large but sane vector still loads."""
    extreme_artifact(vectors, tiny_llama, 5e17)
    r = http.post("/v1/steering/vectors", json={"name": "huge/v1"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("name", "artifact_refused")
    assert "intervention 'recall'" in err["message"] and "norm" in err["message"]
    extreme_artifact(vectors, tiny_llama, 10.0, name="large")  # 64 x 80 = 5e3 x its embeddings
    r = http.post("/v1/steering/vectors", json={"name": "large/v1"})
    assert r.status_code == 200, r.text


def _register(server: Server, name: str, tensor: torch.Tensor) -> None:
    """Register a vector on the running engine directly, past the load-time vetting (as only a
    defect in it could)."""
    backend = server.app.state.steer.backend
    loop = server.server.servers[0].get_loop()
    asyncio.run_coroutine_threadsafe(backend.register(name, tensor), loop).result(60)


def test_a_degenerate_steered_answer_is_a_500_not_empty_text(
    server: Server, http: httpx.Client
) -> None:
    """A vector that overflows the residual stream (its norm squared is beyond float32) makes
    every next-token distribution uniform: a 500 naming steering, whether or not the client
    asked for logprobs; streamed, a 500 before the first token or an error event after it."""
    _register(server, "raw/huge", torch.full((64,), 5e17))
    entry = {"vector": "raw/huge", "layer": 1, "scale": 64.0, "positions": "all"}
    body = chat_body("hi", max_tokens=3, steering={"entries": [entry]})
    for extra in ({}, {"logprobs": True, "top_logprobs": 2}, {"temperature": 1.0, "seed": 1}):
        r = http.post("/v1/chat/completions", json=body | extra)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("steering", "steering_degenerate"), err
    r = http.post("/v1/chat/completions", json=body | {"stream": True})
    assert r.status_code == 500, r.text  # the first token fails: before the stream starts
    assert r.json()["error"]["code"] == "steering_degenerate"
    # The first token is sound, the second is not. Whether the stream has started when the
    # check fails is the engine's timing: vLLM hands a consumer that has not yet taken token 1
    # both tokens in one output (a slow CI machine did), so the check fails before anything
    # was sent. Either honest answer is checked in full; a 200 ending in [DONE] alone is not one.
    later = {"entries": [entry | {"positions": "generated"}]}
    with http.stream(
        "POST", "/v1/chat/completions", json=body | {"stream": True, "steering": later}
    ) as r:
        if r.status_code == 500:
            r.read()
            assert r.json()["error"]["code"] == "steering_degenerate"
            return
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "steering_degenerate"
    assert any(json.loads(e).get("choices") for e in events[:-2])  # the sound token came first


def test_steered_answers_carry_logprobs_only_when_asked(http: httpx.Client) -> None:
    """The check adds no logprobs (the worker flags a degenerate row; where it reads logprobs,
    Model Runner V2, they are dropped): a client that did not ask gets none, one that asked
    gets exactly its own."""
    plain = http.post("/v1/chat/completions", json=chat_body(steering=True)).json()
    assert plain["choices"][0]["logprobs"] is None
    asked = http.post(
        "/v1/chat/completions", json=chat_body(steering=True, logprobs=True, top_logprobs=0)
    ).json()
    assert [t["top_logprobs"] for t in asked["choices"][0]["logprobs"]["content"]] == [[]] * 8
    comp = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "steering": True}
    assert http.post("/v1/completions", json=comp).json()["choices"][0]["logprobs"] is None


def test_a_cap_above_the_engines_seats_is_refused() -> None:
    """Above --max-num-seqs one request could hold every seat: refused before anything starts."""
    from steerserve.server.options import OptionError, read, settings

    with pytest.raises(OptionError, match="between 1 and --max-num-seqs") as e:
        settings(read({"max_num_seqs": 8, "max_seqs_per_request": 9}))
    assert e.value.param == "--max-seqs-per-request"


def test_ops_per_layer_reaches_the_engine_and_is_bounded(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--ops-per-layer sizes the engine's edit slots (0: additive only); more than the op rows
    one request holds could never be used, and a negative count is no size: both refused."""
    from steerserve.server.options import OptionError, read, settings

    monkeypatch.setattr("os.environ", dict(os.environ))  # settings() binds the CPU threads
    model = str(tiny_llama)
    assert settings(read({"model": model, "ops_per_layer": 0})).engine.ops_per_layer == 0
    assert settings(read({"model": model})).engine.ops_per_layer == 2
    for bad in (-1, 5):
        with pytest.raises(OptionError, match="than or equal to") as e:
            read({"model": model, "ops_per_layer": bad})
        assert e.value.param == "--ops-per-layer"


def test_gemmas_reference_norm_counts_its_embedding_scale(
    tiny_llama: Path, tiny_gemma: Path
) -> None:
    """Gemma multiplies its embeddings by sqrt(hidden_size) (8 here) before the first block: the
    reference a vector is measured against does too (same random init, so about 8x Llama's)."""
    from steerserve.artifacts import embedding_norm

    ratio = embedding_norm(tiny_gemma) / embedding_norm(tiny_llama)
    assert 7 < ratio < 9, ratio


def test_embedded_quantization_chooses_the_4bit_checkpoint_or_says_why_not(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--embedded-quantization w4 serves a model's 4-bit checkpoint (in bfloat16, under the model's own
    name) or refuses, naming why; auto never fails to start: it falls back to full precision."""
    import shutil

    from transformers import AutoModelForCausalLM

    from steerserve.engine import cpu
    from steerserve.models import W4_DIR
    from steerserve.models import quantize as Q
    from steerserve.server.options import OptionError, read, settings

    def serve(**given: object):  # noqa: ANN202
        return settings(read(given))

    monkeypatch.setattr("os.environ", dict(os.environ))  # settings() binds the CPU threads
    if cpu.w4_missing():  # vLLM's AVX2 build: w4 refused, naming why; auto falls back
        with pytest.raises(OptionError, match="no 4-bit kernel"):
            serve(model=str(tiny_llama), embedded_quantization="w4")
    monkeypatch.setattr(cpu, "w4_missing", lambda on_gpu=False: None)  # the rules past it
    with pytest.raises(OptionError, match="no 4-bit checkpoint") as e:
        serve(model=str(tiny_llama), embedded_quantization="w4")
    assert e.value.param == "--embedded-quantization"
    assert serve(model=str(tiny_llama)).engine.model == str(tiny_llama)
    with pytest.raises(OptionError, match="'auto', 'none' or 'w4'"):
        read({"embedded_quantization": "int4"})

    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny_llama, model)
    full = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    Q.write_checkpoint(Q.quantize_state(full.state_dict(), 32), model, model / W4_DIR, 32)
    s = serve(model=str(model), embedded_quantization="w4")
    assert (s.engine.model, s.engine.dtype) == (str(model / W4_DIR), "bfloat16")
    assert s.served_model_names == ("tiny-chat",)
    assert serve(model=str(model), embedded_quantization="none").engine.model == str(model)
    # auto: full precision until 4-bit is measured faster on a CPU kind (none yet)
    assert serve(model=str(model)).engine.model == str(model)
    monkeypatch.setattr("steerserve.engine.cpu.W4_AUTO_FLAGS", ("amx_bf16",))
    monkeypatch.setattr("steerserve.engine.cpu.cpu_flags", lambda: {"amx_bf16"})
    assert serve(model=str(model)).engine.model == str(model / W4_DIR)
    assert (
        serve(model=str(model), embedded_quantization="w4", dtype="float16").engine.dtype
        == "float16"
    )
    with pytest.raises(OptionError, match="compute in bfloat16 or float16, not --dtype float32"):
        serve(model=str(model), embedded_quantization="w4", dtype="float32")
