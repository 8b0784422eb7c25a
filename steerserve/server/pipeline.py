"""The one path of every generation request (chat, completions, A/B; streamed or collected):

check -> steer -> sampling params -> submit -> collect or stream -> finish.

What differs between endpoints (schema, prompts, answer shapes) is in ``endpoints.py``. The rest
is written once here: the checks before the engine sees anything, language detection and policy,
admission, submission and the collected answer. Beside it, by job: ``flight.py`` settles a
submitted request whatever happens (the queue gauge, the client going away, engine errors,
closing engine requests, token and request metrics), ``streaming.py`` streams an answer, and
``enrolment.py`` puts a request under the A/B experiment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from steerserve.engine.api import UNSTEERED, Prepared
from steerserve.engine.spec import SteeringError
from steerserve.server.answers import ExperimentInfo, SteeringInfo, Usage, cached_tokens
from steerserve.server.backend import copies
from steerserve.server.defaults import seqs_per_request
from steerserve.server.endpoints import Endpoint, check_sequences
from steerserve.server.enrolment import decide, enrol
from steerserve.server.errors import ApiError
from steerserve.server.events import ArmOutput
from steerserve.server.flight import Call, Flight, finish, refused, until_disconnect
from steerserve.server.policy import OFF
from steerserve.server.protocol import read_request
from steerserve.server.steering import SteeringSpec
from steerserve.server.streaming import stream

if TYPE_CHECKING:
    from steerserve.server.state import ServerState

__all__ = ["Call", "finish", "handle", "refused"]  # the app's: counting refused requests

HEADER = "x-steerserve-steering"


@dataclass(frozen=True)
class Arm:
    """One steering arm of a request: what the engine gets and how the answer describes it."""

    label: str  # the metrics arm: steered | unsteered
    prepared: Prepared
    info: SteeringInfo
    suffix: str = ""  # of the response id (the A/B arms: -a, -b)


# --- the path -----------------------------------------------------------------------------------


async def handle(state: ServerState, request: Request, ep: Endpoint) -> Response:
    """Check -> steer -> sampling params -> submit -> collect or stream -> finish."""
    call = request.state.call = Call(ep.name)
    req = await read_request(request, ep.schema, state.settings.max_body_bytes)
    check(state, req.model)
    ep.admit(req)
    settings = state.settings
    check_sequences(
        ep, req, seqs_per_request(settings.engine.max_num_seqs, settings.max_seqs_per_request)
    )
    backend = state.backend
    backend.check_size(*ep.size(req))
    prompts = await backend.off_loop(ep.prompts, req, backend.tokenizer, backend.vocab_size)
    spec, call.experiment = enrol(state, request, req, ep)
    per_prompt = await steer_prompts(state, spec, prompts.language_texts, ep.ab)
    if call.experiment is not None:
        per_prompt = [[tagged(a, call.experiment.echo) for a in p] for p in per_prompt]
    arms = [summary([p[a] for p in per_prompt]) for a in range(len(per_prompt[0]))]
    call.arm = "ab" if ep.ab else arms[0].label
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    lp = ep.logprobs(req)
    params = [
        backend.sampling_params(req, len(ids), logprobs=lp, output_kind=kind) for ids in prompts.ids
    ]
    rid = f"{ep.id_prefix}-{uuid.uuid4().hex}"
    await decide(state, call.experiment, call.endpoint, rid, arms[0].info, prompts)
    gens = [
        [
            backend.generate(
                ids, sp, per_prompt[i][a].prepared, f"{rid}{arm.suffix}-{i}", copies(req)
            )
            for i, (ids, sp) in enumerate(zip(prompts.ids, params, strict=True))
        ]
        for a, arm in enumerate(arms)
    ]
    headers = {HEADER: arms[-1].info.header()}
    if req.stream:
        if ep.ab:  # one prompt, two arms: streamed like two prompts of the same ids
            labels, infos = [a.label for a in arms], [a.info for a in arms]
            units, prompts = [g for [g] in gens], dataclasses.replace(prompts, ids=prompts.ids * 2)
        else:
            labels, infos = [p[0].label for p in per_prompt], [p[0].info for p in per_prompt]
            units = gens[0]
        events = ep.events(req, prompts, rid, arms[-1].info, backend.tokens, infos)
        return await stream(state, call, request, labels, events, units, prompts, headers)
    every = [g for per_arm in gens for g in per_arm]
    async with Flight(state, call, request, every) as flight:
        outs = await until_disconnect(request, collect_all(gens), state.drain)
        for a, per_arm in enumerate(outs):
            for p, out in zip(per_prompt, per_arm, strict=True):
                u = _usage([out])
                flight.count(p[a].label, u.prompt_tokens, u.completion_tokens)
        if call.experiment is not None and call.experiment.replies is not None:
            for i, out in enumerate(outs[0]):
                call.experiment.replies.update({(i, c.index): c.text for c in out.outputs})
    if flight.status == 499:
        return Response(status_code=499)
    answers = [
        ArmOutput(rid + arm.suffix, arm.info, out, _usage(out), [p[a].info for p in per_prompt])
        for a, (arm, out) in enumerate(zip(arms, outs, strict=True))
    ]
    body = ep.answer(req, prompts, answers, backend.tokens)
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


def check(state: ServerState, model: str) -> None:
    """The served model, and an engine ready to take it (not one past its drain deadline)."""
    if state.drain.dropping:
        raise state.drain.error()
    if model != state.model_name:
        raise ApiError(
            f"The model {model!r} does not exist; this server serves {state.model_name!r}",
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


async def steer_prompts(
    state: ServerState, spec: SteeringSpec | None, texts: list[str], ab: bool
) -> list[list[Arm]]:
    """Per prompt, its arms: ``auto`` decides each prompt by its own language (a batch of an
    English and a French prompt steers the French one only); other steering decides once."""
    if not state.policy.detects(spec):
        return [await steer(state, spec, "", ab)] * len(texts)
    decided: dict[str, list[Arm]] = {}
    for text in texts:
        if text not in decided:
            decided[text] = await steer(state, spec, text, ab)
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


async def steer(state: ServerState, spec: SteeringSpec | None, text: str, ab: bool) -> list[Arm]:
    """The request's arms: detect the language when the steering is ``auto``, resolve the policy,
    admit its entries. A/B: the unsteered arm, then the steered one (which must be steered)."""
    lang = None
    if state.policy.detects(spec):
        try:
            lang = await asyncio.to_thread(state.detector.detect, text)
        except Exception:  # undetectable text: "unsure", which auto treats as English
            lang = None
    decision = state.policy.resolve(spec, language=lang, force=ab)
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


def tagged(arm: Arm, echo: ExperimentInfo) -> Arm:
    return dataclasses.replace(arm, info=arm.info.model_copy(update={"experiment": echo}))


async def collect_all(gens: list[list[AsyncGenerator]]) -> list[list[Any]]:
    """The final output of every engine request (FINAL_ONLY streams), per arm and prompt."""

    async def last(gen: AsyncGenerator) -> Any:
        final = None
        async for out in gen:
            final = out
        return final

    async with asyncio.TaskGroup() as tg:
        tasks = [[tg.create_task(last(g)) for g in per_arm] for per_arm in gens]
    return [[t.result() for t in per_arm] for per_arm in tasks]


def _usage(outputs: Sequence[Any]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage.of(prompt, completion, cached_tokens(outputs))
