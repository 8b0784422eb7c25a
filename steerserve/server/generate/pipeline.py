"""The one path of every generation request (chat, completions, A/B; streamed or collected):"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from steerserve.engine.api import UNSTEERED
from steerserve.engine.spec import SteeringError, short_repr
from steerserve.server.answers import ExperimentInfo
from steerserve.server.body import parse_request, read_body
from steerserve.server.defaults import seqs_per_request
from steerserve.server.errors import ApiError
from steerserve.server.generate import grammar
from steerserve.server.generate.capacity import Budget, budget
from steerserve.server.generate.endpoints import Endpoint, check_sequences, copies, repeat
from steerserve.server.generate.enrolment import decide, enrol
from steerserve.server.generate.flight import Call, Flight, finish, refused, until_disconnect
from steerserve.server.generate.hosted import Plan
from steerserve.server.generate.job import Arm, Job
from steerserve.server.generate.policy import OFF
from steerserve.server.generate.streaming import stream
from steerserve.server.guard import REQUEST_ID
from steerserve.server.presets import Preset
from steerserve.server.steering import SteeringSpec
from steerserve.server.vllm_errors import answer_error, raised_error

if TYPE_CHECKING:
    from steerserve.server.generate.context import Context

__all__ = ["Call", "finish", "handle", "refused"]  # the app's: counting refused requests

# --- the path -----------------------------------------------------------------------------------


async def handle(
    state: Context, request: Request, ep: Endpoint, body: bytes | None = None
) -> Response:
    """Read -> admit -> steer -> plan -> vLLM's serving call -> collect or stream -> finish, each
    step a function of the request's :class:`Job` (what it reads, what it adds); ``body``: read
    already (``/invocations`` reads it to pick the endpoint)."""
    job = Job(state, request, ep, Call(ep.name), body=body or b"")
    request.state.call = job.call  # the app's error handlers count a refusal by it
    await read(job)
    await admit(job)
    await steer_arms(job)
    await plan(job)
    if job.req.stream:
        return await stream(job, serving(job))
    return await collect(job)


async def read(job: Job) -> None:
    """The body, parsed; a preset named as the model becomes the request's steering."""
    state, call = job.state, job.call
    call.request_id = request_id(job.request)
    job.body = job.body or await read_body(job.request, state.settings.max_body_bytes)
    req = job.req = parse_request(job.ep.schema, job.body)
    job.preset = preset = check(state, req.model)
    if preset is not None:
        if req.steering is not None:
            raise ApiError(
                f"steering: the model {short_repr(req.model)} is a steering preset; send 'steering' with "
                f"the base model {state.model_name!r}, or the preset without 'steering'",
                param="steering",
            )
        req.steering = preset.spec  # explicit steering from here on (never enrolled)
        call.preset = preset.id


async def admit(job: Job) -> None:
    """The checks before anything is rendered, then the request's seats (it may wait for them)."""
    state, ep, req = job.state, job.ep, job.req
    ep.admit(req)
    job.grammar_field = grammar.check(req)
    settings = state.settings
    sequences = check_sequences(
        ep, req, seqs_per_request(settings.engine.max_num_seqs, settings.max_seqs_per_request)
    )
    state.backend.check_size(*ep.size(req))
    client = client_of(job.request, len(state.api_keys))
    job.call.seats = await state.seats.take(client, sequences)


async def steer_arms(job: Job) -> None:
    """The prompts' texts, the request's A/B place, and per prompt its arms."""
    state, ep, req, call = job.state, job.ep, job.req, job.call
    backend = state.backend
    job.texts = await backend.off_loop(ep.texts, req, backend.tokenizer, backend.vocab_size)
    spec, call.experiment = enrol(state, job.request, req, ep)
    per_prompt = await steer_prompts(state, spec, job.texts, ep.ab, scores_prompt(req))
    if call.experiment is not None:
        per_prompt = [[tagged(a, call.experiment.echo) for a in p] for p in per_prompt]
    named = job.preset.id if job.preset else call.experiment and call.experiment.preset
    if named:  # the steered arms say which preset they serve
        per_prompt = [
            [named_by(a, named) if a.prepared.steered else a for a in p] for p in per_prompt
        ]
    job.per_prompt = per_prompt
    job.arms = [summary([p[a] for p in per_prompt]) for a in range(len(per_prompt[0]))]
    call.arm = "ab" if ep.ab else job.arms[0].label
    if getattr(req, "use_beam_search", False) and any(
        a.prepared.steered for p in per_prompt for a in p
    ):
        raise ApiError(
            "use_beam_search: beam search is not steered (vLLM builds each step's sampling "
            "anew); leave it out or turn steering off",
            param="use_beam_search",
        )


async def plan(job: Job) -> None:
    """The answer's id, the A/B decision, and per arm the plan its engine calls follow."""
    state, req, backend, settings = job.state, job.req, job.state.backend, job.state.settings
    job.hexid = answer_hexid(job.call)
    rid = job.ep.answer_id(job.hexid)
    # the last arm's steering: an A/B pair's steered one (other endpoints have one arm)
    await decide(state, job.call.experiment, job.call.endpoint, rid, job.arms[-1].info, job.texts)
    job.copies = copies(req)
    prompt_cap, scored_cap = budget(backend.max_model_len, backend.vocab_size)
    work = Budget(
        settings.max_prompt_tokens_per_request or prompt_cap,
        settings.max_scored_tokens_per_request or scored_cap,
    )
    job.plans = [
        Plan(
            [p[a].prepared for p in job.per_prompt],
            [p[a].label for p in job.per_prompt],
            req.token_budget(),
            backend.max_model_len,
            job.gens,
            job.call.experiment,
            work,
            job.grammar_field,
            job.ep.fields,
        )
        for a in range(len(job.arms))
    ]


def serving(job: Job) -> Callable[[], Awaitable[list[Any]]]:
    """The serving calls of every arm, run together; a refusal vLLM answered is raised."""
    state, ep, req, arms = job.state, job.ep, job.req, job.arms

    async def run(a: int) -> Any:
        # each arm its own request: vLLM's tool parsers adjust the one they get, and its
        # message parts are one-pass iterators (read up by the checks above)
        r = parse_request(ep.schema, job.body)
        r.seed, r.request_id = req.seed, ep.request_id(job.hexid) + arms[a].suffix
        r.model = state.model_name  # vLLM's serving layer knows the base model, not presets
        if job.copies > 1:
            r.n = 1
        try:
            return await ep.serve(state.serving.planned(job.plans[a]))(r, None)
        except Exception as e:
            raise (raised_error(e) or e) from None

    async def run_arms() -> list[Any]:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(run(a)) for a in range(len(arms))]
        results = [t.result() for t in tasks]
        for r in results:
            if (err := answer_error(r)) is not None:
                raise err
        return results

    return run_arms


async def collect(job: Job) -> Response:
    """The whole answer: every arm's, with its ``steering`` (the A/B endpoint's both arms)."""
    state, ep, req, request = job.state, job.ep, job.req, job.request
    async with Flight(state, job.call, request, job.gens) as flight:
        try:
            results = await until_disconnect(request, serving(job)(), state.drain)
        finally:
            for p in job.plans:
                for label, (prompt, completion) in p.tokens.items():
                    flight.count(label, prompt, completion)
    if flight.status == 499:
        return Response(status_code=499)
    bodies, infos = [], job.infos
    for a, (arm, result) in enumerate(zip(job.arms, results, strict=True)):
        body = ep.dump(result)
        body["model"] = req.model  # the preset's id when one was asked for
        body["steering"] = arm.info.model_dump(mode="json")
        repeat(body, job.copies)
        ep.echo(body, infos[a], getattr(req, "n", None) or 1)
        bodies.append(body)
    if ep.ab:
        texts_of = [[c["message"].get("content") for c in b["choices"]] for b in bodies]
        answer = {"unsteered": bodies[0], "steered": bodies[1]}
        answer["identical"] = texts_of[0] == texts_of[1]
    else:
        [answer] = bodies
    return JSONResponse(answer, headers=job.headers)


#: What an ``X-Request-Id`` may be: visible ASCII, no space, as an id goes into logs and records.
REQUEST_ID_TEXT = re.compile(r"[!-~]{1,128}")


def request_id(request: Request) -> str | None:
    """The client's ``X-Request-Id`` (vLLM's: the answer's id is named by it), checked."""
    given = request.headers.get(REQUEST_ID)
    if given is None:
        return None
    if not REQUEST_ID_TEXT.fullmatch(given):
        raise ApiError(
            "x-request-id: must be 1 to 128 visible ASCII characters, no spaces",
            param="x-request-id",
        )
    return given


def answer_hexid(call: Call) -> str:
    """The id an answer is named by: the client's ``X-Request-Id`` as vLLM does, else a fresh
    one; under the A/B experiment a client's id gets a suffix, since feedback joins one answer
    by it and clients reuse ids."""
    fresh = uuid.uuid4().hex
    if call.request_id is None:
        return fresh
    return call.request_id if call.experiment is None else f"{call.request_id}-{fresh[:8]}"


def client_of(request: Request, keys: int) -> str:
    """Who a request's seats count against (``capacity.Seats``): the API key it authenticated
    with where the server has several (``keys``), else its address (a forwarded one only from a
    proxy in ``--forwarded-allow-ips``). Never a value the client picks per request: the
    ``user`` field does not enter it, so rotating it gains no seats."""
    index = getattr(request.state, "key_index", None)
    if keys > 1 and index is not None:
        return f"key:{index}"
    return f"addr:{request.client.host if request.client else '?'}"


def check(state: Context, model: str) -> Preset | None:
    """The served model or one of its steering presets (returned), and an engine ready to take
    it (not one past its drain deadline)."""
    if state.drain.dropping:
        raise state.drain.error()
    preset = state.presets.get(model)
    if model not in state.model_names and preset is None:
        raise ApiError(
            f"The model {short_repr(model)} does not exist; this server serves "
            f"{state.model_name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    if not state.ready:
        raise ApiError(
            "the engine is still loading" if state.load_error is None else "the engine failed",
            status=503,
            type="service_unavailable",
        )
    return preset


def scores_prompt(req: Any) -> bool:
    """Whether the request reads its prompt's logprobs (``prompt_logprobs``, or a completion's
    ``echo`` with ``logprobs``: how lm-eval scores a continuation)."""
    if getattr(req, "prompt_logprobs", None) is not None:
        return True
    return bool(getattr(req, "echo", False)) and getattr(req, "logprobs", None) is not None


async def steer_prompts(
    state: Context, spec: SteeringSpec | None, texts: list[str], ab: bool, scoring: bool
) -> list[list[Arm]]:
    """Per prompt, its arms: ``auto`` decides each prompt by its own language (a batch of an
    English and a French prompt steers the French one only); other steering decides once."""
    if not state.policy.detects(spec):
        return [await steer(state, spec, "", ab, scoring)] * len(texts)
    decided: dict[str, list[Arm]] = {}
    for text in texts:
        if text not in decided:
            decided[text] = await steer(state, spec, text, ab, scoring)
    return [decided[t] for t in texts]


def summary(arms: list[Arm]) -> Arm:
    """One arm standing for the same arm of every prompt (labels, header and the answer's
    ``steering``): itself when all agree; otherwise steered when any prompt is, with the
    interventions of a steered prompt and no single detected language."""
    first = arms[0]
    if all(a.info == first.info for a in arms):
        return first
    steered = [a for a in arms if a.prepared.steered]
    model = steered[0] if steered else first
    info = model.info.model_copy(update={"detected_language": None})
    return dataclasses.replace(model, info=info)


async def steer(
    state: Context, spec: SteeringSpec | None, text: str, ab: bool, scoring: bool = False
) -> list[Arm]:
    """The request's arms: detect the language when the steering is ``auto``, resolve the policy
    (``scoring``: a request that reads its prompt's logprobs, steered at every position),
    admit its entries. A/B: the unsteered arm, then the steered one (which must be steered)."""
    lang = None
    if state.policy.detects(spec):
        try:
            lang = await asyncio.to_thread(state.detector.detect, text)
        except Exception:  # undetectable text: "unsure", which auto treats as English
            lang = None
    decision = state.policy.resolve(spec, language=lang, force=ab)
    if scoring:
        decision = state.policy.scoring(decision)
    try:
        prepared = state.backend.prepare(decision.entries or None, decision.field)
    except SteeringError as e:
        raise ApiError(str(e), param=e.field) from None
    if ab and not prepared.steered:
        raise ApiError("steering: the steered arm would not be steered", param="steering")
    label = "steered" if prepared.steered else "unsteered"
    arm = Arm(label, prepared, decision.info(prepared.steered))
    if not ab:
        return [arm]
    return [
        Arm("unsteered", UNSTEERED, OFF.info(False), "-a"),
        dataclasses.replace(arm, suffix="-b"),
    ]


def named_by(arm: Arm, preset: str) -> Arm:
    return dataclasses.replace(arm, info=arm.info.model_copy(update={"preset": preset}))


def tagged(arm: Arm, echo: ExperimentInfo) -> Arm:
    return dataclasses.replace(arm, info=arm.info.model_copy(update={"experiment": echo}))
