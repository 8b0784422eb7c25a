"""generate/'s steps (read, admit, steer, plan; a request's flight) against a small context, no
engine: the server's own parts (settings, backend admission, policy, detector, seats, metrics)
over a tiny model's config and tokenizer, an engine stand-in that only reports its limits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from _server import KEY, make_artifact
from starlette.requests import Request

from steerserve.artifacts import scan_artifacts
from steerserve.engine.api import EngineConfig
from steerserve.server.ab.experiment import DecisionLog, Decisions
from steerserve.server.backend import Backend
from steerserve.server.drain import Drain
from steerserve.server.errors import ApiError
from steerserve.server.generate import endpoints, pipeline, streaming
from steerserve.server.generate.capacity import Seats
from steerserve.server.generate.flight import Call, ClientGone, Flight, until_disconnect
from steerserve.server.generate.job import Job
from steerserve.server.generate.policy import LanguageDetector, SteeringPolicy
from steerserve.server.metrics import Metrics
from steerserve.server.presets import Preset
from steerserve.server.runtime import ServerSettings
from steerserve.server.steering import parse_steering

FR = "La capitale de la France est une ville célèbre pour la tour Eiffel et le musée du Louvre."
EN = "The capital of France is a city famous for the Eiffel Tower and the Louvre museum."


@dataclass
class Context:
    """:class:`steerserve.server.generate.context.Context` without an engine: the real parts,
    an engine stand-in with the limits the steps read."""

    settings: ServerSettings
    backend: Backend
    policy: SteeringPolicy
    detector: LanguageDetector
    metrics: Metrics = field(default_factory=Metrics)
    seats: Seats = field(default_factory=lambda: Seats(8, 4))
    drain: Drain = field(default_factory=Drain)
    decisions: Decisions = field(default_factory=lambda: Decisions(DecisionLog(None)))
    experiment: Any = None
    serving: Any = None
    presets: dict[str, Preset] = field(default_factory=dict)
    model_name: str = "llama"
    model_names: frozenset[str] = frozenset({"llama"})
    api_keys: tuple[str, ...] = (KEY,)
    stopping: bool = False
    load_error: BaseException | None = None
    ready: bool = True


@pytest.fixture
def ctx(tiny_llama: Path, tmp_path: Path, detector: LanguageDetector) -> Context:
    from transformers import AutoTokenizer

    make_artifact(tmp_path, tiny_llama, "v1")
    cfg = EngineConfig(model=str(tiny_llama), max_model_len=256)
    settings = ServerSettings(engine=cfg, vectors_dir=str(tmp_path), steering="auto")
    backend = Backend(cfg)
    backend.llm = SimpleNamespace(  # what the steps read of an engine: its limits
        errored=False,
        model_config=SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 300),
    )
    backend.tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    backend.max_token_chars = 4
    policy = SteeringPolicy(backend.registry, "auto", cfg.max_abs_scale)
    [found] = scan_artifacts(str(tmp_path), str(tiny_llama))
    art = found.artifact
    for iv in art.manifest.interventions:
        backend.registry.add(art.manifest.vector_name(iv), art.tensors[iv.tensor])
    policy.add(art)
    return Context(settings, backend, policy, detector)


def request(
    body: dict[str, Any], headers: dict[str, str] | None = None, gone: asyncio.Event | None = None
) -> Request:
    """A request whose body arrives at once and whose client then waits, as a socket does,
    hanging up once ``gone`` is set (never, without one)."""
    data = [json.dumps(body).encode()]

    async def receive() -> dict[str, Any]:
        if data:
            return {"type": "http.request", "body": data.pop(), "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    given = {"content-type": "application/json", **(headers or {})}
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(k.encode(), v.encode()) for k, v in given.items()],
        "client": ("10.0.0.1", 5000),
        "state": {},
    }
    return Request(scope, receive)


def chat(content: str = EN, **kw: Any) -> dict[str, Any]:
    return {"model": "llama", "messages": [{"role": "user", "content": content}], **kw}


def job(ctx: Context, body: dict[str, Any], ep: Any = endpoints.CHAT, **headers: str) -> Job:
    return Job(ctx, request(body, headers), ep, Call(ep.name))  # type: ignore[arg-type]


def refused(step: Any, j: Job) -> ApiError:
    with pytest.raises(ApiError) as e:
        asyncio.run(step(j))
    return e.value


def test_read_checks_the_model_the_engine_and_the_request_id(ctx: Context) -> None:
    """An unknown model is a 404 naming ``model``; a preset becomes the steering and refuses
    another; a loading or failed engine is a 503; an ``X-Request-Id`` must be visible ASCII."""
    e = refused(pipeline.read, job(ctx, chat(model="gpt-4")))
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    ctx.presets["llama:half"] = Preset("llama:half", parse_steering(True), True, "--preset")
    j = job(ctx, chat(model="llama:half"))
    asyncio.run(pipeline.read(j))
    assert j.call.preset == "llama:half" and j.req.steering == parse_steering(True)
    e = refused(pipeline.read, job(ctx, chat(model="llama:half", steering=False)))
    assert (e.status, e.param) == (400, "steering")
    e = refused(pipeline.read, job(ctx, chat(), **{"x-request-id": "has space"}))
    assert (e.status, e.param) == (400, "x-request-id")
    ctx.ready, ctx.load_error = False, RuntimeError("boom")
    e = refused(pipeline.read, job(ctx, chat()))
    assert (e.status, e.message) == (503, "the engine failed")
    ctx.load_error = None
    assert refused(pipeline.read, job(ctx, chat())).message == "the engine is still loading"


def test_admit_takes_seats_within_the_caps(ctx: Context) -> None:
    """Seats are taken per client by the sequences a request runs; more sequences than a
    request may run, or a prompt that cannot fit the context, are refused before any seat."""
    j = job(ctx, chat(n=2))
    asyncio.run(pipeline.read(j))
    asyncio.run(pipeline.admit(j))
    assert ctx.seats.in_use == 2 and ctx.seats.by_client == {"addr:10.0.0.1": 2}
    j = job(ctx, chat(n=64))
    asyncio.run(pipeline.read(j))
    assert (refused(pipeline.admit, j).param, ctx.seats.in_use) == ("n", 2)
    j = job(ctx, chat("x" * 8000))
    asyncio.run(pipeline.read(j))
    e = refused(pipeline.admit, j)
    assert (e.code, e.param, ctx.seats.in_use) == ("context_length_exceeded", "messages", 2)


def prepared(ctx: Context, body: dict[str, Any], ep: Any = endpoints.CHAT) -> Job:
    j = job(ctx, body, ep)
    for step in (pipeline.read, pipeline.admit, pipeline.steer_arms, pipeline.plan):
        asyncio.run(step(j))
    return j


def test_auto_steers_each_prompt_by_its_own_language(ctx: Context) -> None:
    """A completions batch of an English and a French prompt under ``auto``: only the French
    one is steered; the answer's arm says steered; one plan carries both prompts' arms."""
    j = prepared(ctx, {"model": "llama", "prompt": [EN, FR]}, endpoints.COMPLETIONS)
    assert [p[0].label for p in j.per_prompt] == ["unsteered", "steered"]
    assert [p[0].info.detected_language for p in j.per_prompt] == ["en", "fr"]
    assert j.call.arm == "steered" and j.arms[0].info.detected_language is None
    [plan] = j.plans
    assert plan.labels == ["unsteered", "steered"]
    assert [p[0].prepared.steered for p in j.per_prompt] == [False, True]


def test_the_ab_endpoint_plans_an_unsteered_and_a_steered_arm(ctx: Context) -> None:
    j = prepared(ctx, chat(EN, steering=True), endpoints.AB)
    assert [(a.label, a.suffix) for a in j.arms] == [("unsteered", "-a"), ("steered", "-b")]
    assert len(j.plans) == 2 and j.call.arm == "ab"
    j = job(ctx, chat(EN, steering=False), endpoints.AB)
    for step in (pipeline.read, pipeline.admit):
        asyncio.run(step(j))
    assert refused(pipeline.steer_arms, j).param == "steering"


def test_steering_that_cannot_apply_is_refused_naming_its_field(ctx: Context) -> None:
    """Beam search with steering, an entry past the model's layers: 400s naming the field."""
    j = job(ctx, {"model": "llama", "prompt": FR, "use_beam_search": True, "steering": True},
            endpoints.COMPLETIONS)  # fmt: skip
    for step in (pipeline.read, pipeline.admit):
        asyncio.run(step(j))
    assert refused(pipeline.steer_arms, j).param == "use_beam_search"
    entry = {"vector": "tiny/v1/recall", "layer": 99, "scale": 1.0}
    j = job(ctx, chat(FR, steering={"entries": [entry]}))
    for step in (pipeline.read, pipeline.admit):
        asyncio.run(step(j))
    assert refused(pipeline.steer_arms, j).param.startswith("steering")


async def _engine(tokens: int, fail: BaseException | None = None) -> AsyncGenerator[int, None]:
    """An engine request's stream: ``tokens`` outputs, then ``fail`` raised, if given."""
    for i in range(tokens):
        await asyncio.sleep(0)
        yield i
    if fail is not None:
        raise fail


def _value(ctx: Context, sample: str, **labels: str) -> float | None:
    """A sample of the context's registry, read as ``/load`` reads it (app.py)."""
    return ctx.metrics.registry.get_sample_value(sample, labels)


def test_a_flight_settles_once_and_closes_its_engine_requests(ctx: Context) -> None:
    """Collected in full: 200, tokens counted per arm, seats back, the queue gauge at 0 again;
    an engine error (a ValueError: the caller's) is the API error it maps to, every engine
    stream closed all the same and the request counted with that status."""
    call = Call("chat", arm="steered")
    gens = [_engine(3), _engine(3)]  # the second never read: closed by the flight all the same

    async def collected() -> None:
        call.seats = await ctx.seats.take("addr:10.0.0.1", 2)
        async with Flight(ctx, call, request(chat()), gens) as f:
            assert _value(ctx, "steerserve_queue_depth") == 1
            async for _ in gens[0]:
                f.count("steered", 0, 1)
            f.count("steered", 5, 0)

    asyncio.run(collected())
    assert call.done and call.tokens == (5, 3) and ctx.seats.in_use == 0
    assert _value(ctx, "steerserve_queue_depth") == 0
    assert _value(ctx, "steerserve_tokens_total", arm="steered", kind="completion") == 3
    assert (
        _value(ctx, "steerserve_requests_total", endpoint="chat", arm="steered", status="200") == 1
    )
    assert [g.ag_frame for g in gens] == [None, None]  # both closed

    call, gens = Call("chat"), [_engine(1, ValueError("temperature must be >= 0"))]

    async def failing() -> None:
        async with Flight(ctx, call, request(chat()), gens):
            async for _ in gens[0]:
                pass

    with pytest.raises(ApiError) as e:
        asyncio.run(failing())
    assert (e.value.status, e.value.message) == (400, "temperature must be >= 0")
    assert _value(ctx, "steerserve_requests_total", endpoint="chat", arm="none", status="400") == 1
    assert gens[0].ag_frame is None and _value(ctx, "steerserve_queue_depth") == 0


def test_a_client_that_hangs_up_is_a_499_and_its_work_is_cancelled(ctx: Context) -> None:
    """``until_disconnect`` cancels the engine work when the client goes (ClientGone), and the
    flight counts it as 499 and swallows it (the caller answers nobody)."""
    cancelled = []

    async def work() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def hang_up() -> bool:
        gone = asyncio.Event()
        req = request(chat(), gone=gone)
        asyncio.get_running_loop().call_later(0.01, gone.set)
        async with Flight(ctx, call, req, []):
            await until_disconnect(req, work(), ctx.drain)
        return True

    call = Call("chat")
    assert asyncio.run(hang_up()) and cancelled == [True]
    assert _value(ctx, "steerserve_requests_total", endpoint="chat", arm="none", status="499") == 1
    with pytest.raises(ClientGone):
        asyncio.run(until_disconnect(request(chat(), gone=_set()), work(), ctx.drain))


def test_the_drain_drops_work_in_flight_as_503(ctx: Context) -> None:
    """Past the drain deadline, work still running is cancelled and answered the drain's 503
    (counted), not left to finish."""

    async def dropped() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, ctx.drain.drop, "test")
        await until_disconnect(request(chat()), asyncio.sleep(3600), ctx.drain)

    ctx.drain = Drain()
    with pytest.raises(ApiError) as e:
        asyncio.run(dropped())
    assert e.value.status == 503 and ctx.drain.count == 1


def _chunk(*indices: int, model: str = "llama") -> str:
    """A completion chunk in vLLM's shape, written with spaces (our ``sse`` writes none): a chunk
    written again is a different string."""
    choices = [{"index": i, "text": " a", "logprobs": None, "finish_reason": None} for i in indices]
    return "data: " + json.dumps({"id": "cmpl-1", "model": model, "choices": choices}) + "\n\n"


def _streamed(ctx: Context, body: dict[str, Any], events: list[str]) -> list[str]:
    """What ``streaming._events`` sends for one arm whose engine stream writes ``events``."""
    j = prepared(ctx, {"model": "llama", "prompt": FR, "stream": True, **body},
                 endpoints.COMPLETIONS)  # fmt: skip

    async def rest() -> AsyncGenerator[str, None]:
        for e in events[1:]:
            yield e

    async def sent() -> list[str]:
        return [e async for e in streaming._events(j, [rest()], [events[0]])]

    return asyncio.run(sent())


def test_a_plain_stream_sends_later_chunks_as_vllm_wrote_them(ctx: Context) -> None:
    """One choice of the model asked for: after the first chunk, vLLM's events go out as they
    are (not parsed and written again: the front end's main cost per token), the first and the
    usage chunk still carrying the answer's steering; a preset's id, or two choices, and every
    chunk is written again with its model and each choice's first chunk its steering."""
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    tail = "data: " + json.dumps({"id": "cmpl-1", "model": "llama", "choices": [],
                                  "usage": usage}) + "\n\n"  # fmt: skip
    events = [_chunk(0), _chunk(0), _chunk(0), tail, "data: [DONE]\n\n"]
    out = _streamed(ctx, {"steering": True}, events)
    assert len(out) == 5 and out[1] is events[1] and out[2] is events[2]
    first, last = json.loads(out[0][6:]), json.loads(out[3][6:])
    assert first["steering"]["applied"] and first["choices"][0]["steering"]["applied"]
    assert last["steering"] == first["steering"] and last["usage"] == usage
    assert out[-1] == "data: [DONE]\n\n"

    ctx.presets["llama:half"] = Preset("llama:half", parse_steering(True), True, "--preset")
    out = _streamed(ctx, {"model": "llama:half"}, events)
    assert [json.loads(e[6:])["model"] for e in out[:4]] == ["llama:half"] * 4
    events = [_chunk(0), _chunk(1), _chunk(0, 1), "data: [DONE]\n\n"]
    out = [json.loads(e[6:]) for e in _streamed(ctx, {"n": 2, "temperature": 1.0}, events)[:3]]
    said = [[("steering" in c) for c in o["choices"]] for o in out]
    assert said == [[True], [True], [False, False]]


def _set() -> asyncio.Event:
    gone = asyncio.Event()
    gone.set()
    return gone
