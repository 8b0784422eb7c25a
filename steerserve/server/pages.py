"""The two pages people look at: ``/compare`` (both arms of one question, streamed and judged) and
``/experiments`` (the live A/B experiment)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from steerserve.engine.spec import short_repr
from steerserve.server.ab import analysis as ab_report
from steerserve.server.ab import service as ab_service
from steerserve.server.ab.design import RUNNING, STOPPED, DesignError
from steerserve.server.ab.experiment import StoreUnavailable
from steerserve.server.ab.store import StoreError
from steerserve.server.errors import ApiError, ErrorResponse
from steerserve.server.openapi import ERRORS as BODY_ERRORS

if TYPE_CHECKING:
    from steerserve.server.ab.store import Store
    from steerserve.server.ab.store.writer import Writer
    from steerserve.server.state import ServerState

PAGES = {"/compare": "compare.html", "/experiments": "experiments.html"}
ASSETS = {
    "common.js": "text/javascript; charset=utf-8",
    "compare.js": "text/javascript; charset=utf-8",
    "experiments.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
#: No inline script, nothing from elsewhere: a reply that slipped into markup still could not run.
HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' blob: data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
#: Replies shown on /experiments with --ab-log-content (read from the end of the log).
RECENT, RECENT_BYTES = 20, 256 << 10


@functools.cache
def _static(name: str) -> bytes:
    return (resources.files("steerserve.server") / "static" / name).read_bytes()


def pages_router() -> APIRouter:
    """The pages and their scripts: no auth, as they hold no data."""
    r = APIRouter(include_in_schema=False)

    def page(name: str) -> Any:
        async def serve() -> Response:
            return Response(_static(name), media_type="text/html; charset=utf-8", headers=HEADERS)

        return serve

    for path, name in PAGES.items():
        r.add_api_route(path, page(name), methods=["GET"])

    @r.get("/ui/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise ApiError(f"no such file: {short_repr(name)}", status=404, code="not_found")
        return Response(_static(name), media_type=ASSETS[name], headers=HEADERS)

    return r


#: What the OpenAPI document says of the experiment routes' answers beyond 200 (and 400, 401).
REFUSED = {403: {"model": ErrorResponse, "description": "refused where the vectors admin is"}}
REPORT = {
    200: {
        "description": "the report as ab-report --out writes it",
        "content": {media.split(";")[0]: {} for media in ab_report.FORMATS.values()},
    },
    404: {"model": ErrorResponse, "description": "fmt is not one of md, json, png"},
    409: {"model": ErrorResponse, "description": "the server keeps no decision log or store"},
    **REFUSED,
}


def experiments_router() -> APIRouter:
    """``/v1/steering/experiments`` and its report downloads (the app adds the key and admin
    checks)."""
    r = APIRouter(prefix="/v1/steering")

    @r.get("/experiments", response_model=None, responses=REFUSED)
    async def experiments(request: Request) -> dict[str, Any]:
        """The A/B experiment: its settings, the report of its experiment store (every
        replica's records) or decision log, requests by arm and status since this process
        started, and (with --ab-log-content) recent replies. The winner threshold is the
        server's (``analysis.MIN_SCORED``): a viewer cannot lower it."""
        return await asyncio.to_thread(snapshot, _state(request))

    @r.get("/experiments/report.{fmt}", response_model=None, responses=REPORT)
    async def download(request: Request, fmt: str) -> Response:
        """``steerserve ab-report --out``'s report.md, report.json or report.png, now."""
        if fmt not in ab_report.FORMATS:
            raise ApiError(f"format: one of {', '.join(ab_report.FORMATS)}", status=404)
        state = _state(request)
        source = _source(state)
        if source is None:
            raise ApiError(
                "no decision log: start the server with --ab-store (STEERSERVE_AB_STORE) or "
                "--ab-log (STEERSERVE_AB_LOG)",
                status=409,
                code="no_decision_log",
            )
        try:
            rep = await asyncio.to_thread(_report, source)
        except (StoreUnavailable, StoreError) as e:
            raise ApiError(
                f"the experiment store cannot be read now: {e}",
                status=503,
                type="service_unavailable",
                code="experiment_store_unavailable",
            ) from None
        body = await asyncio.to_thread(ab_report.render, rep, fmt)
        headers = {"content-disposition": f'attachment; filename="report.{fmt}"'}
        return Response(body, media_type=ab_report.FORMATS[fmt], headers=headers)

    controls(r)
    return r


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PreferenceRequest(_Body):
    id: str = Field(
        min_length=1,
        max_length=200,
        description="the pair's id: the id of either answer of an A/B request (…-a, …-b) or "
        "their common prefix",
    )
    preference: Literal["a", "b", "tie"] = Field(
        description="a: answer A (the unsteered one) is better; b: answer B (the steered one) "
        "is better; tie"
    )


class PhaseRequest(_Body):
    allocation: dict[str, float] = Field(
        description="each arm's share of the subjects, summing to 1 (a treatment grows only "
        "into the control's share)"
    )
    why: str = Field("", max_length=500, description="why the allocation changes (the phase's)")


class StatusRequest(_Body):
    why: str = Field("", max_length=500, description="why it stops or starts again")


def _body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` inline as the JSON body (parsed by the route)."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


CONTROL = {
    **BODY_ERRORS,
    **REFUSED,
    404: {"model": ErrorResponse, "description": "this server runs no experiment of that name"},
    409: {"model": ErrorResponse, "description": "the allocation or phase change is refused"},
    503: {"model": ErrorResponse, "description": "the experiment store is unreachable"},
}


def controls(r: APIRouter) -> None:
    """The experiment's start, stop and allocation (a new phase), on ``r`` (admin-gated)."""

    @r.post("/experiments/{name}/stop", response_model=None, openapi_extra=_body(StatusRequest),
            responses=CONTROL)  # fmt: skip
    async def stop(request: Request, name: str) -> dict[str, Any]:
        """Stop the experiment on every replica: its phase ends; requests are served as
        without an experiment until it starts again."""
        return await _control(request, name, StatusRequest, STOPPED)

    @r.post("/experiments/{name}/start", response_model=None, openapi_extra=_body(StatusRequest),
            responses=CONTROL)  # fmt: skip
    async def start(request: Request, name: str) -> dict[str, Any]:
        """Start a stopped experiment again: a new phase, the last one's arms and allocation."""
        return await _control(request, name, StatusRequest, RUNNING)

    @r.post("/experiments/{name}/phases", response_model=None, openapi_extra=_body(PhaseRequest),
            responses=CONTROL)  # fmt: skip
    async def phase(request: Request, name: str) -> dict[str, Any]:
        """A new allocation: a new phase (analysed apart from the ones before)."""
        return await _control(request, name, PhaseRequest, None)


async def _control(
    request: Request, name: str, model: type[BaseModel], status: str | None
) -> dict[str, Any]:
    from steerserve.server.body import read_request

    state = _state(request)
    registry = state.decisions.registry
    if registry is None or registry.experiment.name != name:
        raise ApiError(
            f"name: this server runs no experiment {short_repr(name)}",
            status=404,
            param="name",
            code="experiment_not_found",
        )
    req: Any = await read_request(request, model, state.settings.max_body_bytes)
    who = f"an admin via {request.url.path} on {ab_service.by().removeprefix('serve on ')}"
    try:
        if status is None:
            await asyncio.to_thread(registry.change, req.allocation, req.why, who)
        else:
            await asyncio.to_thread(registry.set_status, status, req.why, who)
    except DesignError as e:
        raise ApiError(f"{e.param}: {e.reason}", status=409, param=e.param,
                       code="phase_refused") from None  # fmt: skip
    except (StoreUnavailable, StoreError) as e:
        raise ApiError(
            f"the experiment store cannot take the change now: {e}",
            status=503,
            type="service_unavailable",
            code="experiment_store_unavailable",
        ) from None
    return {"object": "steering.experiment", **registry.describe()}


PREFERENCE = {
    **BODY_ERRORS,
    404: {"model": ErrorResponse, "description": "no pair of the experiment has this id"},
    409: {"model": ErrorResponse, "description": "judged already, or no decision log"},
    503: {"model": ErrorResponse, "description": "the store is unreachable, or still writing"},
}


def preference_router() -> APIRouter:
    """``POST /v1/steering/preference`` (the app adds the key check)."""
    r = APIRouter()

    @r.post("/v1/steering/preference", response_model=None, openapi_extra=_body(PreferenceRequest),
            responses=PREFERENCE)  # fmt: skip
    async def preference(request: Request) -> dict[str, Any]:
        """Judge the pair of an A/B answer: A (unsteered) better, B (steered) better, or a tie.
        One preference per pair; the report tests them per subject, always valid."""
        from steerserve.server.body import read_request
        from steerserve.server.generate import pipeline

        state = _state(request)
        call = request.state.call = pipeline.Call("preference")
        req = await read_request(request, PreferenceRequest, state.settings.max_body_bytes)
        out = await ab_service.preference(state.decisions, req.id, req.preference)
        pipeline.finish(state, call, 200, timed=False)
        return out

    return r


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.steer
    return state


def _log_path(state: ServerState) -> Path | None:
    path = state.decisions.log.path
    return path if path is not None and path.is_file() else None


def _source(state: ServerState) -> Path | Store | None:
    """What the report reads: the experiment store (every replica's records) when the server
    has one, else its own decision log."""
    writer = state.decisions.store
    return writer.store if writer is not None else _log_path(state)


def _report(source: Path | Store) -> dict[str, Any]:
    """The report of the log or the store as it is now (recomputed only when the file, or the
    store's counts, changed). The phases' allocations are in the records: nothing to pass."""
    if isinstance(source, Path):
        st = source.stat()
        return _report_of(str(source), (st.st_size, st.st_mtime_ns))
    return _store_report(source, source.stamp())


@functools.lru_cache(maxsize=4)
def _report_of(path: str, stamp: tuple[int, int]) -> dict[str, Any]:
    return ab_report.report(path)


@functools.lru_cache(maxsize=4)
def _store_report(store: Store, stamp: tuple[float, ...]) -> dict[str, Any]:
    return ab_report.report(store)


#: The last report each server read (its time too): shown, with its age, while the store is down.
_last: dict[int, tuple[dict[str, Any], float]] = {}
_last_lock = threading.Lock()


def snapshot(state: ServerState) -> dict[str, Any]:
    """What ``/experiments`` shows; while the store cannot be read, the last report read and
    when it was read (``report_read_at``), said as such."""
    log, writer = state.decisions.log, state.decisions.store
    registry = state.decisions.registry
    path = _log_path(state)
    source = _source(state)
    rep, unread, read_at = None, None, time.time()
    try:
        rep = None if source is None else _report(source)
        if writer is None:
            recent_rows = recent(path) if path is not None and log.content else []
        else:
            recent_rows = writer.store.recent(RECENT) if log.content else []
        if rep is not None:
            with _last_lock:
                _last[id(state)] = (rep, read_at)
    except (StoreUnavailable, StoreError) as e:  # the page says so, shows the last, tries again
        unread, recent_rows = str(e), []
        with _last_lock:
            rep, read_at = _last.get(id(state), (None, read_at))
    return {
        "object": "steering.experiments",
        "experiment": None if registry is None else registry.describe(),
        "log": {"enabled": log.enabled, "content": log.content, "write_failures": log.failures},
        "store": None if writer is None else store_state(writer) | {"read_error": unread},
        "served": served(state),
        "report": rep,
        "report_read_at": read_at if rep is not None else None,
        "report_stale": unread is not None and rep is not None,
        "recent": recent_rows,
    }


def store_state(writer: Writer) -> dict[str, Any]:
    """This process's side of the experiment store: reachable, written, queued, dropped."""
    return {
        "url": writer.store.shown,
        "up": writer.up,
        "written": writer.written,
        "queued": writer.queued,
        "dropped": writer.dropped,
    }


def served(state: ServerState) -> dict[str, dict[str, dict[str, int]]]:
    """Requests under the experiment since this process started, by experiment, arm and HTTP
    status (failures too, which the decision log does not keep), from the metrics."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for metric in state.metrics.ab_requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                exp, arm = s.labels["experiment"], s.labels["arm"]
                out.setdefault(exp, {}).setdefault(arm, {})[s.labels["status"]] = int(s.value)
    return out


def recent(path: Path, n: int = RECENT) -> list[dict[str, Any]]:
    """The last ``n`` logged replies with their prompts and scores (only kept in the log with
    --ab-log-content); read from the end of the log, so a long log costs no more."""
    with open(path, "rb") as f:
        start = max(0, f.seek(0, 2) - RECENT_BYTES)
        f.seek(start)
        lines = f.read().decode("utf-8", "replace").splitlines()[1 if start else 0 :]
    rows: dict[str, dict[str, Any]] = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or "id" not in rec:
            continue
        if rec.get("type") == "decision" and "reply" in rec:
            keep = ("id", "ts", "experiment", "arm", "language", "prompt", "reply")
            rows[str(rec["id"])] = {k: rec.get(k) for k in keep} | {"score": None}
        elif rec.get("type") == "feedback" and str(rec["id"]) in rows and "metric" not in rec:
            rows[str(rec["id"])]["score"] = rec.get("score")
    return list(rows.values())[-n:][::-1]
