"""The vectors endpoints (``/v1/steering/vectors``): what the server steers with, listed, and an
artifact loaded by name at run time, so the state keeps only what every request needs."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from steerserve.server.admin import check_ref
from steerserve.server.errors import ApiError
from steerserve.server.vetting import loadable

if TYPE_CHECKING:
    from steerserve.server.state import ServerState

logger = logging.getLogger("steerserve.server")


def listing(state: ServerState) -> dict[str, Any]:
    """``GET /v1/steering/vectors``: the loaded artifacts, the default, the policy."""
    policy = state.policy
    return {
        "object": "list",
        "default": policy.default_artifact,
        "policy": policy.default,
        "data": [
            {
                "id": key,
                "name": a.manifest.name,
                "version": a.manifest.version,
                "default": key == policy.default_artifact,
                "interventions": sorted(iv.name for iv in a.manifest.interventions),
                # the languages "auto" steers (null: every non-English one)
                "auto_languages": a.manifest.auto_languages(),
                "manifest": a.manifest.model_dump(mode="json"),
            }
            for key, a in policy.artifacts.items()
        ],
    }


async def load_named(state: ServerState, ref: str, make_default: bool) -> dict[str, Any]:
    """``POST /v1/steering/vectors``: load ``name[/version]`` (its newest version when omitted)
    from the vectors directory; never a path (the route checks ``state.admin``)."""
    if not state.ready:
        raise ApiError("the engine is still loading", status=503, type="service_unavailable")
    check_ref(ref)
    if not state.backend.cfg.steering:
        raise ApiError("this server was built without the steering plugin", param="name")
    found = await asyncio.to_thread(state.scan, {ref.split("/")[0]})
    settings = state.settings
    art = loadable(found, ref, settings.engine.max_abs_scale, settings.vectors_dir)  # 404, 422
    try:
        loaded = await state.add_artifact(art, make_default=make_default)
    except ValueError as e:  # same name/version, other data: artifacts are immutable
        raise ApiError(str(e), status=409, param="name", code="conflict") from None
    logger.info("loaded artifact %s (default: %s)", loaded.key, state.policy.default_artifact)
    return {"loaded": loaded.key, **listing(state)}
