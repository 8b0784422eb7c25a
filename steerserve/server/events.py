"""A request's prompts, an arm's final outputs, and a streamed answer as server-sent events
(chat, A/B and completions): the shapes the pipeline and the endpoints pass between them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from steerserve.server import answers as A
from steerserve.server.logprobs import chat_logprobs, completion_logprobs
from steerserve.server.tokens import Tokens


@dataclass
class Prompts:
    """A request's prompts: token ids, their texts (echo) and, per prompt, the text ``auto``
    detects the language of."""

    ids: list[list[int]]
    texts: list[str]
    language_texts: list[str]


@dataclass(frozen=True)
class ArmOutput:
    """The final engine outputs of one steering arm, one per prompt."""

    rid: str  # the response id
    info: A.SteeringInfo  # of the whole answer
    outputs: list[Any]
    usage: A.Usage
    infos: list[A.SteeringInfo]  # per prompt (``auto`` decides each prompt by its language)

    def fields(self, model: str) -> dict[str, Any]:
        """The fields of the answer besides its choices."""
        return {
            "id": self.rid,
            "created": int(time.time()),
            "model": model,
            "usage": self.usage,
            "steering": self.info,
        }


def sse(model: BaseModel | dict[str, Any]) -> str:
    """One server-sent event."""
    if isinstance(model, BaseModel):
        return f"data: {model.model_dump_json(exclude_none=True)}\n\n"
    import json

    return f"data: {json.dumps(model, separators=(',', ':'))}\n\n"


class Events:
    """A streamed answer as SSE events: ``head()``, ``step(i, out)`` per engine output of prompt
    i, ``tail(usage)``; the pipeline adds ``[DONE]`` and errors."""

    chunk: type[A.ChatCompletionChunk] | type[A.Completion]

    def __init__(
        self,
        req: Any,
        prompts: Prompts,
        rid: str,
        info: A.SteeringInfo,
        tokens: Tokens,
        infos: list[A.SteeringInfo],
    ) -> None:
        self.req, self.prompts, self.rid, self.info, self.tok = req, prompts, rid, info, tokens
        self.infos = infos  # per prompt
        self.created = int(time.time())

    def _chunk(self, choices: list[Any], **kw: Any) -> str:
        return sse(
            self.chunk(
                id=self.rid, created=self.created, model=self.req.model, choices=choices, **kw
            )
        )

    def head(self) -> Iterator[str]:
        return iter(())

    def step(self, i: int, out: Any) -> Iterator[str]:
        raise NotImplementedError

    def tail(self, usage: A.Usage) -> Iterator[str]:
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._chunk([], usage=usage, steering=self.info)


class ChatEvents(Events):
    """Chat chunks: the role, then content/logprob deltas, then usage if asked for."""

    chunk = A.ChatCompletionChunk

    def head(self) -> Iterator[str]:
        role = A.Delta(role="assistant", content="")
        choices = [A.ChunkChoice(index=i, delta=role) for i in range(self.req.n)]
        yield self._chunk(choices, steering=self.info)

    def step(self, i: int, out: Any) -> Iterator[str]:
        top = self.req.top_logprobs or 0
        for o in out.outputs:
            lp = (
                chat_logprobs(list(o.token_ids), o.logprobs, top, self.tok)
                if self.req.logprobs
                else None
            )
            if o.text or lp or o.finish_reason:
                delta = A.Delta(content=o.text) if o.text else A.Delta()
                c = A.ChunkChoice(
                    index=o.index, delta=delta, logprobs=lp, finish_reason=o.finish_reason
                )
                yield self._chunk([c])


class ArmEvents(ChatEvents):
    """One arm's chat chunks in a streamed A/B answer, each naming its ``arm``."""

    chunk = A.ABChunk

    def __init__(self, arm: str, *args: Any) -> None:
        super().__init__(*args)
        self.arm = arm

    def _chunk(self, choices: list[Any], **kw: Any) -> str:
        return super()._chunk(choices, arm=self.arm, **kw)


class ABEvents(Events):
    """A streamed A/B answer: both arms' chat chunks interleaved as they are generated (the
    pipeline streams the arms like two prompts: step ``i`` is arm ``i``), with each arm's own
    usage at the end when asked for, so a client can show both answers growing side by side."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.arms = [
            ArmEvents(arm, self.req, self.prompts, self.rid + suffix, i, self.tok, [i])
            for arm, suffix, i in zip(
                ("unsteered", "steered"), ("-a", "-b"), self.infos, strict=True
            )
        ]
        self.completion = [0, 0]
        self.cached = [0, 0]

    def head(self) -> Iterator[str]:
        for arm in self.arms:
            yield from arm.head()

    def step(self, i: int, out: Any) -> Iterator[str]:
        self.completion[i] += sum(len(o.token_ids) for o in out.outputs)
        self.cached[i] = max(self.cached[i], A.cached_tokens([out]))
        yield from self.arms[i].step(0, out)

    def tail(self, usage: A.Usage) -> Iterator[str]:
        prompt = len(self.prompts.ids[0])
        for arm, n, cached in zip(self.arms, self.completion, self.cached, strict=True):
            yield from arm.tail(A.Usage.of(prompt, n, cached))


class CompletionEvents(Events):
    """Completion chunks of several prompts merged as they come (choice index = prompt * n +
    sample), echoed prompts first if asked for, then usage if asked for. The first chunk carries
    the answer's steering, each choice's first chunk its prompt's."""

    chunk = A.Completion

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.offsets: dict[int, int] = {}
        self.first = True
        self.told: set[int] = set()  # choices whose steering was sent

    def _choice(self, i: int, idx: int, **kw: Any) -> A.CompletionChoice:
        steering = None if idx in self.told else self.infos[i]
        self.told.add(idx)
        return A.CompletionChoice(index=idx, steering=steering, **kw)

    def _chunk(self, choices: list[Any], **kw: Any) -> str:
        if self.first:
            kw.setdefault("steering", self.info)
            self.first = False
        return super()._chunk(choices, **kw)

    def head(self) -> Iterator[str]:
        if self.req.echo:
            for i, text in enumerate(self.prompts.texts):
                for j in range(self.req.n):
                    yield self._chunk(
                        [self._choice(i, i * self.req.n + j, text=text)], steering=self.info
                    )

    def step(self, i: int, out: Any) -> Iterator[str]:
        for o in out.outputs:
            idx = i * self.req.n + o.index
            lp = None
            if self.req.logprobs is not None:
                offset = self.offsets.get(idx, 0)
                lp = completion_logprobs(
                    list(o.token_ids), o.logprobs, self.req.logprobs, self.tok, offset
                )
                self.offsets[idx] = offset + len(o.text)
            if o.text or lp or o.finish_reason or idx not in self.told:
                choice = self._choice(
                    i, idx, text=o.text, logprobs=lp, finish_reason=o.finish_reason
                )
                yield self._chunk([choice])
