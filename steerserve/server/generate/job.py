"""One generation request on its way through the path (``pipeline.py``): a :class:`Job` each
step reads and adds to, so the steps, the collected answer and the stream share one object
instead of long argument lists."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from steerserve.engine.api import Prepared
from steerserve.server.answers import SteeringInfo
from steerserve.server.generate.endpoints import Endpoint
from steerserve.server.generate.flight import Call
from steerserve.server.generate.hosted import Plan
from steerserve.server.guard import REQUEST_ID
from steerserve.server.presets import Preset

if TYPE_CHECKING:
    from steerserve.server.generate.context import Context

HEADER = "x-steerserve-steering"


@dataclass(frozen=True)
class Arm:
    """One steering arm of a request: what the engine gets and how the answer describes it."""

    label: str  # the metrics arm: steered | unsteered
    prepared: Prepared
    info: SteeringInfo
    suffix: str = ""  # of the response id (the A/B arms: -a, -b)


@dataclass
class Job:
    """A request and what the path has learned of it so far (set by the step named)."""

    state: Context
    request: Request
    ep: Endpoint
    call: Call
    body: bytes = b""  # read
    req: Any = None  # read: the endpoint's schema
    preset: Preset | None = None  # read: the preset named as the model
    grammar_field: str | None = None  # admit: the field a grammar came in
    texts: list[str] = field(default_factory=list)  # steer_arms: the prompts as rendered
    per_prompt: list[list[Arm]] = field(default_factory=list)  # steer_arms
    arms: list[Arm] = field(default_factory=list)  # steer_arms: one standing for all prompts
    hexid: str = ""  # plan: the answer's id
    copies: int = 1  # plan: n answered as copies of one greedy choice
    plans: list[Plan] = field(default_factory=list)  # plan: per arm
    gens: list[AsyncGenerator[Any, None]] = field(default_factory=list)  # the engine calls

    @property
    def infos(self) -> list[list[dict[str, Any]]]:
        """Per arm, each prompt's ``steering`` as the answer shows it."""
        return [
            [p[a].info.model_dump(mode="json") for p in self.per_prompt]
            for a in range(len(self.arms))
        ]

    @property
    def headers(self) -> dict[str, str]:
        """The answer's headers: its steering, and its id as the client named it (if it did)."""
        named = {} if self.call.request_id is None else {REQUEST_ID: self.call.request_id}
        return {HEADER: self.arms[-1].info.header(), **named}

    @property
    def labels(self) -> list[str | None]:
        """Each arm's ``arm`` in an A/B stream's chunks (None: not an A/B stream)."""
        return ["unsteered", "steered"] if self.ep.ab else [None]
