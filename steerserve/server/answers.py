"""What the server answers: vLLM's chat and completion responses (whole and streamed), each with
the ``steering`` that was applied, and the listings of models and vectors."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesResponse as _VMessages
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse as _VChatResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse as _VCompletionResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponseChoice as _VCompletionChoice,
)
from vllm.entrypoints.openai.responses.protocol import ResponsesResponse as _VResponses

from steerserve.engine.spec import entry_fields


class _Named(BaseModel):
    """What the echo adds to an entry: where its vector comes from."""

    artifact: str | None
    version: str | None
    name: str
    sha256: str


#: An applied entry as a response names it: the entry's own fields (``engine/spec.py``, their
#: one declaration) and where its vector comes from.
AppliedIntervention = create_model(
    "AppliedIntervention", __base__=_Named, __module__=__name__, **entry_fields()
)


class ExperimentInfo(BaseModel):
    """A request's place in the server's A/B experiment (``--ab-split``)."""

    name: str
    arm: str = Field(description="steered | unsteered | unenrolled (no user, no subject header)")
    subject_hash: str | None = None


class SteeringInfo(BaseModel):
    applied: bool
    policy: str
    interventions: list[AppliedIntervention] = Field(default_factory=list)
    detected_language: str | None = None
    # only for "auto" with an artifact that gates it per language: the languages it steers
    auto_languages: list[str] | None = Field(None, exclude_if=lambda v: v is None)
    # only under an A/B experiment (``--ab-split``): answers are unchanged without one
    experiment: ExperimentInfo | None = Field(None, exclude_if=lambda v: v is None)
    # only for a request whose model is a steering preset: its id
    preset: str | None = Field(None, exclude_if=lambda v: v is None)

    def header(self) -> str:
        """``x-steerserve-steering``: compact ASCII JSON, or ``off`` (unsteered, no experiment)."""
        if not self.applied and self.experiment is None:
            return "off"
        return json.dumps(self.model_dump(exclude_none=True), separators=(",", ":"))


# --- the answers: vLLM's serving layer's shapes with our ``steering`` (documents and tests) ---------


class ChatCompletion(_VChatResponse):
    """vLLM's chat answer plus the ``steering`` that was applied."""

    steering: SteeringInfo


class CompletionChoice(_VCompletionChoice):
    # the steering of this choice's prompt (``auto`` decides each prompt by its own language;
    # the answer's ``steering`` sums them up); in a stream, on the choice's first chunk
    steering: SteeringInfo | None = None


class Completion(_VCompletionResponse):
    """vLLM's completions answer plus the ``steering`` that was applied (and each prompt's)."""

    choices: list[CompletionChoice]
    steering: SteeringInfo


class ResponsesResponse(_VResponses):
    """vLLM's Responses API answer plus the ``steering`` that was applied; a stream's
    ``response.created``, ``response.in_progress`` and ``response.completed`` events carry it
    in their ``response``."""

    steering: SteeringInfo


class MessagesResponse(_VMessages):
    """vLLM's Anthropic Messages answer, with the answer's ``steering``."""

    steering: SteeringInfo


class ABResponse(BaseModel):
    unsteered: ChatCompletion
    steered: ChatCompletion
    identical: bool


class ArtifactInfo(BaseModel):
    id: str
    name: str
    version: str
    default: bool
    interventions: list[str]
    manifest: dict[str, Any]


class VectorListing(BaseModel):
    """``GET /v1/steering/vectors``; ``POST`` adds what it ``loaded``."""

    object: Literal["list"] = "list"
    default: str | None
    policy: str
    data: list[ArtifactInfo]
    loaded: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "steerserve"
    root: str
    max_model_len: int | None
    # a steering preset (presets.py): its base model, as vLLM lists a LoRA adapter's
    parent: str | None = Field(None, exclude_if=lambda v: v is None)
    steering: Any = Field(None, exclude_if=lambda v: v is None, description="what it applies")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
