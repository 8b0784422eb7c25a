"""What a request's steps may read of the server: a narrow view, so that the steps import nothing
above them (the server's state satisfies it; a test gives a small fake)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from steerserve.server.ab.experiment import Decisions, Experiment
    from steerserve.server.backend import Backend
    from steerserve.server.drain import Drain
    from steerserve.server.generate.capacity import Seats
    from steerserve.server.generate.hosted import Serving
    from steerserve.server.generate.policy import LanguageDetector, SteeringPolicy
    from steerserve.server.metrics import Metrics
    from steerserve.server.presets import Preset
    from steerserve.server.runtime import ServerSettings


class Context(Protocol):
    settings: ServerSettings
    backend: Backend
    policy: SteeringPolicy
    detector: LanguageDetector
    metrics: Metrics
    seats: Seats
    drain: Drain
    decisions: Decisions
    experiment: Experiment | None
    serving: Serving | None
    presets: dict[str, Preset]
    model_name: str
    model_names: frozenset[str]
    api_keys: tuple[str, ...]
    stopping: bool
    load_error: BaseException | None

    @property
    def ready(self) -> bool: ...
