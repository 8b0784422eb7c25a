"""The A/B experiment as the server runs it: the experiment its settings describe (created or
joined in the registry at start), the checks that need the loaded artifacts and presets, and the
feedback and preference requests (each refusal an API error naming its field; nothing written
when refused).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING, Any

from steerserve.server.ab.design import (
    STEERED,
    Arm,
    Design,
    DesignError,
    parse_allocation,
    parse_arm,
    two_arms,
)
from steerserve.server.ab.experiment import (
    MAX_FEEDBACK_PER_ID,
    MAX_PREFERENCES_PER_PAIR,
    PAIR,
    DecisionLog,
    DecisionNotLogged,
    Experiment,
    FeedbackLimit,
    LogUnwritable,
    StoreUnavailable,
    WrongKind,
)
from steerserve.server.ab.metrics import CHOICES, PREFERENCE
from steerserve.server.errors import ApiError

if TYPE_CHECKING:
    from steerserve.server.ab.experiment import Decisions
    from steerserve.server.ab.registry import Registry
    from steerserve.server.ab.store.writer import Writer
    from steerserve.server.presets import Preset

#: How long a client should wait before asking again for an answer another replica may still be
#: writing (a backlog after an outage drains at thousands of records a second).
RETRY_AFTER_SECONDS = 2


def design_of(
    split: float,
    name: str,
    arms: tuple[str, ...] | list[str],
    allocation: tuple[str, ...] | list[str],
    control: str | None,
    preset: str | None,
    steering: str,
) -> tuple[Design, dict[str, float]] | None:
    """The experiment the settings describe (None: none), or a DesignError naming the flag:
    ``--ab-arm`` (two or more) with ``--ab-allocation``, or the two-arm ``--ab-split``
    (its steered arm ``auto``, ``on`` under ``--steering on``, or ``--ab-preset``)."""
    if arms and split:
        raise DesignError(
            "give --ab-split (two arms) or --ab-arm (each arm), not both", "--ab-split"
        )
    if not arms:
        for flag, given in (("--ab-allocation", allocation), ("--ab-control", control)):
            if given:
                raise DesignError("needs the arms: --ab-arm NAME=SPEC (two or more)", flag)
        if not split:
            return None
        steered = Arm(STEERED, True if steering == "on" else "auto")
        if preset is not None:
            steered = Arm(STEERED, None, preset)
        return two_arms(name, split, steered)
    if preset is not None:
        raise DesignError(
            "with --ab-arm, name a preset as an arm (NAME=preset:PRESET)", "--ab-preset"
        )
    parsed = tuple(parse_arm(a) for a in arms)
    design = Design(name, parsed, control or parsed[0].name)
    return design, parse_allocation(allocation, design)


def check_arms(design: Design) -> None:
    """Each arm's steering a value the API accepts (its vectors are checked once the artifacts
    are loaded), as a DesignError naming ``--ab-arm``."""
    from steerserve.server.steering import parse_steering

    for arm in design.arms:
        if arm.preset is None:
            try:
                parse_steering(arm.steering)
            except ApiError as e:
                raise DesignError(f"{arm.name}={arm.spec}: {e.message}", "--ab-arm") from None


def by() -> str:
    """Who changes the registry from this process, as a phase's ``why`` says it."""
    return f"serve on {socket.gethostname()}:{os.getpid()}"


def open_experiment(
    settings: Any, log: DecisionLog, writer: Writer | None
) -> tuple[Experiment | None, Registry | None]:
    """The server's experiment, created or joined in its registry (the store, else the log),
    followed while the server runs; ValueError (naming the option) when it cannot be."""
    from steerserve.server.ab.registry import Registry

    got = design_of(
        settings.ab_split,
        settings.ab_name,
        settings.ab_arm,
        settings.ab_allocation,
        settings.ab_control,
        settings.ab_preset,
        settings.steering,
    )
    if got is None:
        return None, None
    design, allocation = got
    check_arms(design)
    exp = Experiment(design=design, allocation=allocation, note=settings.ab_note or "")
    registry = Registry(exp, writer, log, by())
    registry.join()
    registry.start()
    return exp, registry


def flag_of(exp: Experiment) -> str:
    """The option an experiment came from, as an error at start names it."""
    names = exp.design.names
    return "--ab-split" if set(names) == {"steered", "unsteered"} else "--ab-arm"


def check_loaded(exp: Experiment | None, artifacts: bool, vectors_dir: str | None) -> None:
    """Before the engine: an experiment whose arms steer needs an artifact to steer with."""
    if exp is None or artifacts:
        return
    if any(a.preset is not None or a.steering not in (False, "off") for a in exp.design.arms):
        flag = flag_of(exp)
        what = f"{flag} {exp.split:g}" if flag == "--ab-split" else flag
        raise RuntimeError(
            f"{what}: no steering artifact for this model under "
            f"{vectors_dir!r}, so the steered arm would not be steered"
        )


def check_presets(exp: Experiment | None, presets: dict[str, Preset], model: str) -> None:
    """Once the presets are known: each arm's preset is one (RuntimeError naming the flag)."""
    from steerserve.server.presets import preset_id

    if exp is None:
        return
    for arm in exp.design.arms:
        if arm.preset is not None and preset_id(model, arm.preset) not in presets:
            flag = "--ab-preset" if flag_of(exp) == "--ab-split" else f"--ab-arm {arm.name}"
            raise RuntimeError(f"{flag}: no such preset {arm.preset!r}")


# --- feedback and preferences ---------------------------------------------------------------------


async def feedback_joined(
    decisions: Decisions, rid: str, score: float, metric: str = "feedback"
) -> dict[str, Any]:
    """:func:`feedback` off the event loop. With a store, an id it does not know yet is asked
    again for a moment (the replica that answered may still be writing it), without holding a
    thread while waiting; while another replica reports records still queued, a retryable 503
    (``Retry-After``), never a 404."""
    from steerserve.server.ab.store.writer import FEEDBACK_GRACE_SECONDS

    writer = decisions.store
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (FEEDBACK_GRACE_SECONDS if writer else 0)
    while True:
        try:
            return await asyncio.to_thread(feedback, decisions, rid, score, metric)
        except ApiError as e:
            if e.code != "decision_not_found" or writer is None:
                raise
            backlog = await asyncio.to_thread(_backlog, writer)
            if backlog:
                raise pending(rid, backlog) from None
            if loop.time() >= deadline:
                raise
        await asyncio.sleep(0.05)


def _backlog(writer: Writer) -> list[str]:
    try:
        return writer.backlog()
    except Exception:  # the store unreachable now: the 404 stands on what was read
        return []


def pending(rid: str, backlog: list[str]) -> ApiError:
    return ApiError(
        f"id: {rid!r} is not in the experiment store yet, and {len(backlog)} other replica(s) "
        f"still hold records for it ({', '.join(backlog[:3])}): retry after "
        f"{RETRY_AFTER_SECONDS} s",
        status=503,
        param="id",
        type="service_unavailable",
        code="decision_pending",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def feedback(
    decisions: Decisions, rid: str, score: float, metric: str = "feedback"
) -> dict[str, Any]:
    """``POST /v1/steering/feedback`` (and a preference, ``metric`` ``preference``): a score
    joined to the arm of the answer ``rid`` (an enrolled request this server, or one before it
    or another replica, answered)."""
    if not decisions.enabled:
        raise ApiError(
            "feedback needs a decision log or an experiment store: start the server with "
            "--ab-store (STEERSERVE_AB_STORE) or --ab-log (STEERSERVE_AB_LOG)",
            status=409,
            code="no_decision_log",
        )
    try:
        known = decisions.feedback(rid, score, metric)
    except KeyError:
        raise ApiError(
            f"id: {rid!r} is not an answer of the A/B experiment",
            status=404,
            param="id",
            code="decision_not_found",
        ) from None
    except DecisionNotLogged:  # 409, not 503: a retry cannot bring the lost decision back
        raise ApiError(
            f"id: {rid!r} was answered, but its decision line could not be written to the "
            "decision log (a full disk), so a score for it could never be joined",
            status=409,
            param="id",
            code="decision_not_logged",
        ) from None
    except WrongKind as e:
        raise ApiError(str(e), param="id", code="wrong_kind") from None
    except ValueError as e:  # the metric's registry names the field
        raise ApiError(str(e), param=getattr(e, "param", "score")) from None
    except FeedbackLimit:
        raise _limit(rid, metric) from None
    except LogUnwritable:
        raise ApiError(
            "the decision log could not be written: the score was not recorded",
            status=503,
            type="service_unavailable",
            code="decision_log_unwritable",
        ) from None
    except StoreUnavailable:
        raise ApiError(
            "the experiment store is unreachable and this server did not give the answer "
            f"{rid!r}: the score was not recorded; retry",
            status=503,
            type="service_unavailable",
            code="experiment_store_unavailable",
        ) from None
    out = {"object": "steering.feedback", "id": rid, "score": float(score), **known}
    return out if metric == "feedback" else out | {"metric": metric}


def _limit(rid: str, metric: str) -> ApiError:
    if metric == PREFERENCE:
        return ApiError(
            f"id: {rid!r} was judged already (a pair takes {MAX_PREFERENCES_PER_PAIR} "
            "preference; the first stands)",
            status=409,
            param="id",
            code="preference_limit",
        )
    return ApiError(
        f"id: {rid!r} was scored {MAX_FEEDBACK_PER_ID} times already (the last score counts)",
        status=429,
        param="id",
        type="rate_limit_error",
        code="feedback_limit",
    )


def pair_id(rid: str) -> str:
    """A pair's id from the id of either of its answers (``…-a``: A, the unsteered one;
    ``…-b``: B, the steered one) or the pair's own."""
    return rid[:-2] if rid.endswith(("-a", "-b")) else rid


async def preference(decisions: Decisions, rid: str, choice: str) -> dict[str, Any]:
    """``POST /v1/steering/preference``: which answer of the pair ``rid`` was better."""
    pid = pair_id(rid)
    got = await feedback_joined(decisions, pid, CHOICES[choice], PREFERENCE)
    return {
        "object": "steering.preference",
        "id": pid,
        "preference": choice,
        "score": CHOICES[choice],
        "experiment": got.get("experiment"),
        "language": got.get("language"),
    }


__all__ = ["PAIR", "feedback", "feedback_joined", "open_experiment", "preference"]
