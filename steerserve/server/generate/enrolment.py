"""A generation request under the server's A/B experiment: who is enrolled in which arm
(:func:`enrol`), the decision the log gets (:func:`decide`), and, once the request is settled,
its metrics and log line (:func:`settle_experiment`). An answer of the A/B endpoint is recorded
as a pair (both arms at once), which a person or a client then judges with a preference.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request

from steerserve.server.ab.design import bucket
from steerserve.server.ab.experiment import (
    PAIR,
    SUBJECT_HEADER,
    UNENROLLED,
    Enrolled,
    header_subject,
)
from steerserve.server.answers import ExperimentInfo, SteeringInfo
from steerserve.server.errors import ApiError
from steerserve.server.generate.endpoints import Endpoint
from steerserve.server.presets import preset_id
from steerserve.server.steering import SteeringSpec

if TYPE_CHECKING:
    from steerserve.server.generate.context import Context


def enrol(
    state: Context, request: Request, req: Any, ep: Endpoint
) -> tuple[SteeringSpec | None, Enrolled | None]:
    """The steering under the A/B experiment, and the request's place in it: a request without
    ``steering`` and with a subject (its ``user``, else the subject header) gets its arm's; one
    without a subject is served as before, marked un-enrolled. Explicit steering is left alone
    (no place), and so is every request while the experiment is stopped. An answer of the A/B
    endpoint is a pair, recorded where decisions are kept."""
    exp = state.experiment
    if ep.ab:
        return req.steering, pair(state, request, req)
    if exp is None or not exp.running or req.steering is not None:
        return req.steering, None
    subject = _subject(request, req)
    if not subject:
        return None, Enrolled(ExperimentInfo(name=exp.name, arm=UNENROLLED))
    a = exp.assign(subject)
    enrolled = Enrolled(ExperimentInfo(**a.echo()), phase=a.phase)
    arm = exp.design.arm(a.arm)
    if arm.preset is not None:
        preset = state.presets[preset_id(state.model_name, arm.preset)]
        enrolled.preset = preset.id
        return preset.spec, enrolled
    return exp.spec(a.arm), enrolled


def _subject(request: Request, req: Any) -> str | None:
    """Who the split assigns: OpenAI's ``user``, Anthropic's ``metadata.user_id``, else the
    subject header."""
    subject = getattr(req, "user", None)
    meta = getattr(req, "metadata", None)
    if subject is None and isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        subject = meta["user_id"]
    if not subject and (raw := request.headers.get(SUBJECT_HEADER)):
        try:
            subject = header_subject(raw)
        except ValueError as e:
            raise ApiError(str(e), param=SUBJECT_HEADER) from None
    return subject or None


def pair(state: Context, request: Request, req: Any) -> Enrolled | None:
    """An A/B answer's place: a pair of the server's experiment (its name even while it is
    stopped, or ``--ab-name``), its subject hashed as the experiment's would be; None where no
    decisions are kept (a preference could never be joined)."""
    if not state.decisions.enabled:
        return None
    exp = state.experiment
    name = exp.name if exp is not None else state.settings.ab_name
    subject = _subject(request, req)
    digest = bucket(name, subject)[1] if subject else None
    return Enrolled(ExperimentInfo(name=name, arm=PAIR, subject_hash=digest), pair=True)


async def decide(
    state: Context,
    ab: Enrolled | None,
    endpoint: str,
    rid: str,
    info: SteeringInfo,
    texts: list[str],
) -> None:
    """An enrolled request's decision (``info``: its arm's steering), logged when it is
    answered. The language is detected for both arms (``auto`` already did for the steered
    one), so the report compares like with like."""
    if ab is None or ab.echo.arm == UNENROLLED:
        return
    text = "\n".join(texts)
    lang = info.detected_language
    if lang is None:
        try:
            lang = await asyncio.to_thread(state.detector.detect, text)
        except Exception:  # undetectable text
            lang = None
    ab.rid = rid
    # collected for the reply's metrics; logged only with --ab-log-content (a pair's two
    # answers are judged, not measured)
    ab.replies = None if ab.pair else {}
    ab.decision = {
        "experiment": ab.echo.name,
        "arm": ab.echo.arm,
        "subject_hash": ab.echo.subject_hash,
        "endpoint": endpoint,
        "model": state.model_name,
        "language": lang,
        "applied": info.applied,
        **({"preset": ab.preset} if ab.preset else {}),
        **({} if ab.phase is None else {"phase": ab.phase}),
        **({"treatment": treatment(info)} if ab.pair else {}),
        "vectors": [iv.vector for iv in info.interventions],
        "prompt": texts,  # dropped unless --ab-log-content
    }


def treatment(info: SteeringInfo) -> str:
    """A pair's steered answer in words: its preset, or each intervention and its scale (two
    multipliers of one vector are two treatments)."""
    if info.preset:
        return info.preset
    parts = [f"{iv.vector}x{iv.scale:.3g}" for iv in info.interventions]
    return " + ".join(parts) or info.policy


def settle_experiment(
    state: Context, ab: Enrolled, status: int, seconds: float | None, tokens: tuple[int, int]
) -> None:
    """Metrics by experiment and arm; an answered enrolled request goes to the decision log (a
    failed write is counted there, never the request's failure). ``tokens``: prompt,
    completion."""
    state.metrics.observe_ab(ab.echo.name, ab.echo.arm, status, seconds, tokens)
    if ab.decision is None or status != 200:
        return
    if ab.pair:
        state.decisions.record(ab.rid, {**ab.decision, "latency_ms": _ms(seconds)})
        return
    keys = sorted(ab.replies or {})
    record = {
        **ab.decision,
        "latency_ms": _ms(seconds),
        "prompt_tokens": tokens[0],
        "completion_tokens": tokens[1],
        # what the automatic metrics (ab/metrics.py) are computed from, for both arms alike
        "reply_language": [reply_language(state, ab.replies[k]) for k in keys],  # type: ignore[index]
        "finish_reason": [ab.finished.get(k) for k in keys],
    }
    if state.decisions.log.content:
        record["reply"] = [ab.replies[k] for k in keys]  # type: ignore[index]
    state.decisions.record(ab.rid, record)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def reply_language(state: Context, text: str) -> str | None:
    """The reply's language, by the detector that read the prompt's (its last 2,000 characters:
    0.1-0.5 ms on the event loop for a reply of a few hundred); None when unsure."""
    try:
        return state.detector.detect(text)
    except Exception:  # undetectable text
        return None
