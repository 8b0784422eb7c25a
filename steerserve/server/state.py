"""The server's state: settings, the engine, the steering policy, metrics, readiness, and the
per-request checks every endpoint runs before the engine sees anything."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steerserve.engine.api import EngineConfig, Prepared
from steerserve.server.engine import ServingEngine, load_artifacts
from steerserve.server.metrics import Metrics
from steerserve.server.policy import MODES, Decision, LoadedArtifact, SteeringPolicy
from steerserve.server.protocol import ApiError

logger = logging.getLogger("steerserve.server")


@dataclass
class ServerSettings:
    """What ``steerserve serve`` configures (see ``cli.py`` for the options and variables)."""

    engine: EngineConfig
    vectors_dir: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    steering: str = "auto"  # default policy: off | on | auto
    max_body_bytes: int = 1 << 20
    exit_on_load_failure: bool = False  # the CLI: a server that cannot load should not idle


@dataclass
class Call:
    """Per-request bookkeeping read by the error handlers (metrics need endpoint and arm)."""

    endpoint: str
    arm: str = "none"
    t0: float = field(default_factory=time.perf_counter)


class ServerState:
    """The app's state: settings, engine, policy, metrics, readiness."""

    def __init__(self, settings: ServerSettings) -> None:
        if settings.steering not in MODES:
            raise ValueError(f"steering: {settings.steering!r} is not one of {', '.join(MODES)}")
        self.settings = settings
        self.engine = ServingEngine(settings.engine)
        self.policy = SteeringPolicy(
            self.engine.registry, settings.steering, settings.engine.max_abs_scale
        )
        self.metrics = Metrics()
        self.model_name = settings.served_model_name or Path(settings.engine.model).name
        self.load_error: BaseException | None = None
        self.created = int(time.time())
        self.loaded = False

    @property
    def ready(self) -> bool:
        return self.loaded and self.engine.ready

    # --- startup -----------------------------------------------------------------------------

    async def load(self) -> None:
        try:
            await self.engine.start()
            if self.engine.cfg.steering:
                arts = await asyncio.to_thread(
                    load_artifacts, self.settings.vectors_dir, self.settings.engine.model
                )
                for art in default_first(arts):
                    await self.add_artifact(art)
            if self.policy.default_artifact is None and self.policy.default != "off":
                if self.policy.default == "on":
                    raise RuntimeError(
                        f"--steering on, but no artifact for this model under "
                        f"{self.settings.vectors_dir!r}"
                    )
                logger.warning("no steering artifact for this model: default policy is off")
                self.policy.default = "off"
            if self.policy.default_artifact is not None:
                await asyncio.to_thread(self.policy.detector.warm)
            self.loaded = True
            self.metrics.ready.set(1)
            logger.info(
                "ready: model %s, artifacts %s (default %s), policy %s",
                self.model_name,
                list(self.policy.artifacts),
                self.policy.default_artifact,
                self.policy.default,
            )
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.load_error = e
            logger.exception("engine failed to load")
            if self.settings.exit_on_load_failure:
                os.kill(os.getpid(), signal.SIGTERM)

    def finish(self, call: Call, status: int, timed: bool = True) -> None:
        """Count a finished request and log it (one structured line per request)."""
        seconds = time.perf_counter() - call.t0
        self.metrics.observe(call.endpoint, call.arm, status, seconds if timed else None)
        logger.info(
            "request endpoint=%s arm=%s status=%d ms=%.1f",
            call.endpoint,
            call.arm,
            status,
            seconds * 1e3,
        )

    async def add_artifact(self, art: Any, make_default: bool = False) -> LoadedArtifact:
        m = art.manifest
        for iv in m.interventions:
            await self.engine.register(m.vector_name(iv), art.tensors[iv.tensor], str(art.path))
        loaded = LoadedArtifact.from_artifact(art)
        self.policy.add(loaded, make_default)
        return loaded

    # --- per request -------------------------------------------------------------------------

    def check(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        if not self.ready:
            raise ApiError(
                "the engine is still loading" if self.load_error is None else "the engine failed",
                status=503,
                type="service_unavailable",
            )

    async def steer(self, raw: Any, text: str, force: bool = False) -> tuple[Decision, Prepared]:
        lang = None
        if self.policy.mode_of(raw) == "auto":
            try:
                lang = await asyncio.to_thread(self.policy.detector.detect, text)
            except Exception:  # undetectable text: "unsure", which auto treats as English
                lang = None
        decision = self.policy.resolve(raw, language=lang, force=force)
        try:
            prepared = self.engine.prepare(list(decision.entries) or None)
        except ValueError as e:
            msg = str(e)
            if decision.policy == "entries":
                msg = msg.replace("steering[", "steering.entries[", 1)
            param = msg.split(":", 1)[0] if ":" in msg else "steering"
            raise ApiError(msg, param=param) from None
        if force and not prepared.steered:
            raise ApiError("steering: the steered arm would not be steered", param="steering")
        return decision, prepared


def default_first(arts: list[Any]) -> list[Any]:
    """Load order: by name, latest version first; the first one becomes the default."""
    from steerserve.artifacts import _version_key

    newest = sorted(arts, key=lambda a: _version_key(a.manifest.version), reverse=True)
    return sorted(newest, key=lambda a: a.manifest.name)
