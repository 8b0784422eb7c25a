"""What the server answers: OpenAI's chat and completion responses (whole and streamed), each
with the ``steering`` that was applied, and the listings of models and vectors."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, Field


class AppliedIntervention(BaseModel):
    artifact: str | None
    version: str | None
    name: str
    vector: str
    sha256: str
    layer: int
    scale: float
    positions: str
    op: str = Field(description="the operation applied (engine/ops.py): add, ablate, ...")


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

    def header(self) -> str:
        """``x-steerserve-steering``: compact ASCII JSON, or ``off`` (unsteered, no experiment)."""
        if not self.applied and self.experiment is None:
            return "off"
        return json.dumps(self.model_dump(exclude_none=True), separators=(",", ":"))


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache, as vLLM's server reports them


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int | None = None) -> Usage:
        details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=details,
        )


def cached_tokens(outputs: Iterable[Any]) -> int:
    """Prompt tokens the engine read from its prefix cache, over ``RequestOutput``s."""
    return sum(o.num_cached_tokens or 0 for o in outputs if o is not None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class _Answer(BaseModel):
    """The fields (in their order) every answer and chunk has; subclasses narrow them."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None
    steering: SteeringInfo | None = None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    steering: SteeringInfo


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # the steering of this choice's prompt (``auto`` decides each prompt by its own language;
    # the answer's ``steering`` sums them up); in a stream, on the choice's first chunk
    steering: SteeringInfo | None = None


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ABResponse(BaseModel):
    unsteered: ChatCompletion
    steered: ChatCompletion
    identical: bool


class ABChunk(ChatCompletionChunk):
    """A streamed A/B answer's chunk: a chat chunk of one arm (its id ends in -a or -b, as in
    :class:`ABResponse`), which it names, since both arms are interleaved as they are generated."""

    arm: Literal["unsteered", "steered"]


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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
