"""The server's state: settings, the backend, the steering policy, metrics and readiness, and the
artifacts it loads at start (by name at run time: ``vectors.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from steerserve.artifacts import Artifact, Scanned, newest_first, scan_artifacts
from steerserve.engine.spec import SteeringError
from steerserve.server.ab import service as ab_service
from steerserve.server.ab.experiment import DecisionLog, Decisions
from steerserve.server.admin import AdminGate
from steerserve.server.backend import Backend
from steerserve.server.defaults import seqs_per_request
from steerserve.server.drain import Drain
from steerserve.server.errors import ApiError
from steerserve.server.generate import hosted
from steerserve.server.generate.capacity import Seats
from steerserve.server.generate.policy import LanguageDetector, SteeringPolicy
from steerserve.server.metrics import Metrics
from steerserve.server.presets import DEFAULTS, Preset, parse_option, preset_id
from steerserve.server.runtime import ServerSettings
from steerserve.server.steering import MODES, Off
from steerserve.server.vetting import check_artifacts

logger = logging.getLogger("steerserve.server")


class ServerState:
    """The app's state: settings, backend, policy, language detector, metrics, readiness."""

    def __init__(self, settings: ServerSettings) -> None:
        if settings.steering not in MODES:
            raise ValueError(f"steering: {settings.steering!r} is not one of {', '.join(MODES)}")
        self.settings = settings
        names = settings.served_model_names or (Path(settings.engine.model).name,)
        self.model_name = names[0]  # reported; the others are accepted as 'model' too
        self.model_names = frozenset(names)
        # any of them authenticates (app.require_key); the admin keys, where set, alone open the
        # admin endpoints (app.require_admin)
        self.admin_keys = settings.admin_keys
        self.api_keys = settings.api_keys + self.admin_keys
        engine = dataclasses.replace(settings.engine, served_model_name=self.model_name)
        self.backend = Backend(engine, settings.drain_seconds)
        self.policy = SteeringPolicy(
            self.backend.registry, settings.steering, settings.engine.max_abs_scale
        )
        self.detector = LanguageDetector()
        self.metrics = Metrics()
        self.metrics.engine_requests.set_function(self.backend.in_flight)
        log = DecisionLog(
            settings.ab_log, settings.ab_log_content, self.metrics.ab_log_failures.inc
        )
        store = None
        if settings.ab_store:
            from steerserve.server.ab.store import open_writer

            store = open_writer(settings.ab_store, settings.ab_store_spill, self.metrics)
        self.decisions = Decisions(log, store)
        # created or joined in its registry (ab/service.py); ValueError naming the option
        self.experiment, self.decisions.registry = ab_service.open_experiment(settings, log, store)
        cfg = settings.engine
        self.seats = Seats(
            cfg.max_num_seqs, seqs_per_request(cfg.max_num_seqs, settings.max_seqs_per_request)
        )
        self.load_error: BaseException | None = None
        self.engine_died = False
        self.stopping = False  # set on SIGINT/SIGTERM: the engine may stop, it did not die
        self.drain = Drain()  # past the drain deadline: requests in flight are answered 503
        self.created = int(time.time())
        self.loaded = False
        self.serving: hosted.Serving | None = None  # vLLM's serving layer, once the engine is up
        self.presets: dict[str, Preset] = {}  # model id -> preset, once the artifacts are loaded
        self._preset_options = [parse_option(p) for p in settings.preset]  # ValueError
        # who may load vectors and read the experiment (the app's require_admin asks it)
        self.admin = AdminGate(settings.host, bool(self.api_keys), settings.open_admin)
        if self.admin.refusal:
            logger.warning("POST /v1/steering/vectors is disabled: %s", self.admin.refusal)

    @property
    def ready(self) -> bool:
        return self.loaded and self.backend.ready

    @property
    def failed(self) -> bool:
        """The engine failed to load or died: the process should exit non-zero."""
        return self.load_error is not None or self.engine_died

    async def run(self) -> None:
        """Load, then watch the engine until the app shuts down (the lifespan cancels this)."""
        await self.load()
        if self.loaded:
            await self.watch()

    async def watch(self, every: float = 0.2) -> None:
        """An engine that dies (EngineCore killed or crashed) fails /health at once and, from the
        CLI, stops the process with a non-zero status so that a supervisor restarts it."""
        while self.backend.ready:
            await asyncio.sleep(every)
        if self.stopping:  # EngineCore drained and stopped on the same signal as this process
            return
        self.engine_died = True
        self.metrics.ready.set(0)
        logger.critical("the engine died; failing /health%s", self._exit())

    def _exit(self) -> str:
        """Stop the process (draining HTTP) when it runs from the CLI; say so for the log."""
        if not self.settings.exit_on_failure:
            return ""
        os.kill(os.getpid(), signal.SIGTERM)
        return " and exiting"

    async def load(self) -> None:
        """Start the engine, register the artifacts made for this model (the first of
        :func:`newest_first` becomes the default), fall back to ``off`` without one."""
        try:
            found = await asyncio.to_thread(self.scan) if self.backend.cfg.steering else []
            # before the engine: a refusal costs no engine start
            check_artifacts(found, self.settings.engine.max_abs_scale)
            ab_service.check_loaded(
                self.experiment, any(s.artifact for s in found), self.settings.vectors_dir
            )
            # The language detector (auto's and the A/B log's) loads its models, ~2 s and
            # ~0.3 GB, while the engine loads (the front end idles meanwhile), not after it.
            warming = None
            if any(s.artifact for s in found):
                warming = asyncio.ensure_future(asyncio.to_thread(self.detector.warm))
                warming.add_done_callback(_retrieved)
            await self.backend.start()
            self.serving = hosted.build(
                self.backend,
                self.model_name,
                tool_call_parser=self.settings.tool_call_parser,
                enable_auto_tool_choice=self.settings.enable_auto_tool_choice,
                chat_template=self.settings.chat_template,
            )
            for art in newest_first(s.artifact for s in found if s.artifact is not None):
                await self.add_artifact(art)
            if self.policy.default_artifact is None and self.policy.default != "off":
                if self.policy.default == "on":
                    raise RuntimeError(
                        f"--steering on, but no artifact for this model under "
                        f"{self.settings.vectors_dir!r}"
                    )
                logger.warning("no steering artifact for this model: default policy is off")
                self.policy.default = "off"
            self._add_presets()
            if warming is not None:  # an artifact was found, so one is the default now
                await warming
            self.loaded = True
            self.metrics.ready.set(1)
            logger.info(
                "ready: model %s, artifacts %s (default %s), policy %s",
                self.model_name,
                list(self.policy.artifacts),
                self.policy.default_artifact,
                self.policy.default,
            )
            if (exp := self.experiment) is not None:
                logger.info(
                    "A/B experiment %r (%s): arms %s, decision log %s, store %s",
                    exp.name,
                    exp.status,
                    ", ".join(f"{a.name}={a.spec}" for a in exp.design.arms),
                    self.settings.ab_log,
                    store.store.shown if (store := self.decisions.store) is not None else None,
                )
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            if self.stopping:  # a signal stopped EngineCore's start too: a stop, not a failure
                logger.info("stopped while the engine was loading (%s)", e)
                return
            self.load_error = e
            logger.exception("engine failed to load%s", self._exit())

    def _add_presets(self) -> None:
        """The served artifact's presets and ``--preset``'s, each admitted as a request would
        be (a missing vector, or a name taken by the model or another preset, stops the start)."""
        from steerserve.server.steering import parse_steering

        wanted: list[tuple[str, Any, str]] = []
        if self.policy.default_artifact is not None:
            wanted += [(k, v, "artifact") for k, v in DEFAULTS.items()]
        wanted += [(name, raw, "--preset") for name, raw in self._preset_options]
        for name, raw, source in wanted:
            pid = preset_id(self.model_name, name)
            if pid == self.model_name or pid in self.presets:
                raise RuntimeError(f"--preset {name}: the model id {pid!r} is taken")
            try:
                spec = parse_steering(raw)
                force = not isinstance(spec, Off)  # auto: check what it steers with
                decision = self.policy.resolve(spec, force=force)
                self.backend.prepare(decision.entries or None, decision.field)
            except (ApiError, SteeringError) as e:
                raise RuntimeError(f"--preset {name}: {e}") from None
            self.presets[pid] = Preset(pid, spec, raw, source)
        ab_service.check_presets(self.experiment, self.presets, self.model_name)

    def scan(self, names: Collection[str] | None = None) -> list[Scanned]:
        """The artifact directories under the vectors directory (of ``names`` only, when given),
        verified for this model."""
        root = self.settings.vectors_dir
        if root is None or not Path(root).is_dir():
            return []
        return scan_artifacts(root, self.settings.engine.model, names)

    async def add_artifact(self, art: Artifact, make_default: bool = False) -> Artifact:
        m = art.manifest
        for iv in m.interventions:  # each digest verified at load: the registry does not rehash
            tensor = art.tensors[iv.tensor]
            await self.backend.register(m.vector_name(iv), tensor, str(art.path), iv.sha256)
        self.policy.add(art, make_default)
        return art


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a background task's outcome as seen: a start that fails before awaiting it (the
    engine's error is the one reported) must not also log "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()
