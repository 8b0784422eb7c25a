"""What differs between chat, completions and the A/B endpoint: the request schema, how prompts
become token ids, and how engine outputs become OpenAI answers or SSE events. The path every
request takes (``pipeline.py``) is shared."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from steerserve.chat import chat_ids
from steerserve.server import protocol as P
from steerserve.server.protocol import ApiError
from steerserve.server.tokens import Tokens

MAX_PROMPTS = 128


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
    info: P.SteeringInfo  # of the whole answer
    outputs: list[Any]
    usage: P.Usage
    infos: list[P.SteeringInfo]  # per prompt (``auto`` decides each prompt by its language)

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


# --- logprobs ------------------------------------------------------------------------------------


def _logprob(lp: Any) -> float:
    return max(lp.logprob, -9999.0)  # JSON has no -inf


def _tokens(
    token_ids: list[int], logprobs: list[dict[int, Any]], top: int
) -> Iterator[tuple[int, Any, list[tuple[int, Any]]]]:
    """Per generated token: its id, its ``Logprob`` and the ``top`` best (id, ``Logprob``), most
    likely first."""
    for tid, lps in zip(token_ids, logprobs, strict=False):
        ranked = sorted(lps.items(), key=lambda kv: kv[1].rank or 0)[:top] if top else []
        yield tid, lps[tid], ranked


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Any]] | None, top: int, tokens: Tokens
) -> P.ChatLogprobs | None:
    """OpenAI chat ``logprobs.content`` from vLLM's per-token ``{token_id: Logprob}``; ``bytes``
    are the token's own bytes."""
    if logprobs is None:
        return None

    def entry(tid: int, lp: Any) -> dict[str, Any]:
        return {
            "token": tokens.text(tid),
            "logprob": _logprob(lp),
            "bytes": list(tokens.bytes(tid)),
        }

    content = [
        P.TokenLogprob(**entry(tid, chosen), top_logprobs=[P.TopLogprob(**entry(*t)) for t in best])
        for tid, chosen, best in _tokens(token_ids, logprobs, top)
    ]
    return P.ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Any]] | None,
    top: int,
    tokens: Tokens,
    offset: int = 0,
) -> P.CompletionLogprobs | None:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).
    ``top_logprobs`` is keyed by token text, and distinct tokens have distinct texts (see
    :mod:`tokens`); only tokens with identical bytes share a key, which keeps the likelier."""
    if logprobs is None:
        return None
    out = P.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    done = b""
    for tid, chosen, best in _tokens(token_ids, logprobs, top):
        out.tokens.append(tokens.text(tid))
        out.token_logprobs.append(_logprob(chosen))
        top_lps: dict[str, float] = {}
        for t, lp in best:
            top_lps.setdefault(tokens.text(t), _logprob(lp))
        out.top_logprobs.append(top_lps)
        out.text_offset.append(offset + len(done.decode("utf-8", "ignore")))
        done += tokens.bytes(tid)
    return out


class Events:
    """A streamed answer as SSE events: ``head()``, ``step(i, out)`` per engine output of prompt
    i, ``tail(usage)``; the pipeline adds ``[DONE]`` and errors."""

    chunk: type[P.ChatCompletionChunk] | type[P.Completion]

    def __init__(
        self,
        req: Any,
        prompts: Prompts,
        rid: str,
        info: P.SteeringInfo,
        tokens: Tokens,
        infos: list[P.SteeringInfo],
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

    def tail(self, usage: P.Usage) -> Iterator[str]:
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._chunk([], usage=usage, steering=self.info)


class ChatEvents(Events):
    """Chat chunks: the role, then content/logprob deltas, then usage if asked for."""

    chunk = P.ChatCompletionChunk

    def head(self) -> Iterator[str]:
        role = P.Delta(role="assistant", content="")
        choices = [P.ChunkChoice(index=i, delta=role) for i in range(self.req.n)]
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
                delta = P.Delta(content=o.text) if o.text else P.Delta()
                c = P.ChunkChoice(
                    index=o.index, delta=delta, logprobs=lp, finish_reason=o.finish_reason
                )
                yield self._chunk([c])


class ArmEvents(ChatEvents):
    """One arm's chat chunks in a streamed A/B answer, each naming its ``arm``."""

    chunk = P.ABChunk

    def __init__(self, arm: str, *args: Any) -> None:
        super().__init__(*args)
        self.arm = arm

    def _chunk(self, choices: list[Any], **kw: Any) -> str:
        return super()._chunk(choices, arm=self.arm, **kw)


class ABEvents(Events):
    """A streamed A/B answer: both arms' chat chunks interleaved as they are generated (the
    pipeline streams the arms like two prompts: step ``i`` is arm ``i``), with each arm's own
    usage at the end when asked for, so a client can show both answers growing side by side."""

    def __init__(
        self,
        req: Any,
        prompts: Prompts,
        rid: str,
        info: P.SteeringInfo,
        tokens: Tokens,
        infos: list[P.SteeringInfo],
    ) -> None:
        super().__init__(req, prompts, rid, info, tokens, infos)
        self.arms = [
            ArmEvents(arm, req, prompts, rid + suffix, i, tokens, [i])
            for arm, suffix, i in zip(("unsteered", "steered"), ("-a", "-b"), infos, strict=True)
        ]
        self.completion = [0, 0]

    def head(self) -> Iterator[str]:
        for arm in self.arms:
            yield from arm.head()

    def step(self, i: int, out: Any) -> Iterator[str]:
        self.completion[i] += sum(len(o.token_ids) for o in out.outputs)
        yield from self.arms[i].step(0, out)

    def tail(self, usage: P.Usage) -> Iterator[str]:
        prompt = len(self.prompts.ids[0])
        for arm, n in zip(self.arms, self.completion, strict=True):
            yield from arm.tail(P.Usage.of(prompt, n))


class CompletionEvents(Events):
    """Completion chunks of several prompts merged as they come (choice index = prompt * n +
    sample), echoed prompts first if asked for, then usage if asked for. The first chunk carries
    the answer's steering, each choice's first chunk its prompt's."""

    chunk = P.Completion

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.offsets: dict[int, int] = {}
        self.first = True
        self.told: set[int] = set()  # choices whose steering was sent

    def _choice(self, i: int, idx: int, **kw: Any) -> P.CompletionChoice:
        steering = None if idx in self.told else self.infos[i]
        self.told.add(idx)
        return P.CompletionChoice(index=idx, steering=steering, **kw)

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


class Endpoint:
    """What an endpoint defines; ``pipeline.handle`` does the rest."""

    name: str  # the metrics endpoint label
    schema: type[P.ChatCompletionRequest] | type[P.CompletionRequest]
    id_prefix: str
    ab = False  # two arms, unsteered and steered

    def admit(self, req: Any) -> None:
        """Refusals and defaults of this endpoint, before anything is tokenized."""

    def size(self, req: Any) -> tuple[int, int, str]:
        """(characters of text, token ids) of the largest prompt, and its field: checked
        against the context before anything is tokenized."""
        raise NotImplementedError

    def prompts(self, req: Any, tokenizer: Any, vocab_size: int) -> Prompts:
        raise NotImplementedError

    def logprobs(self, req: Any) -> int | None:
        """``SamplingParams.logprobs``."""
        raise NotImplementedError

    def answer(
        self, req: Any, prompts: Prompts, arms: list[ArmOutput], tokens: Tokens
    ) -> BaseModel:
        """The response body from the final outputs of every arm."""
        raise NotImplementedError

    events: type[Events]  # of a streamed answer


class Chat(Endpoint):
    """``POST /v1/chat/completions``."""

    name = "chat"
    schema = P.ChatCompletionRequest
    id_prefix = "chatcmpl"
    events = ChatEvents

    def size(self, req: P.ChatCompletionRequest) -> tuple[int, int, str]:
        return sum(len(m.text()) for m in req.messages), 0, "messages"

    def prompts(self, req: P.ChatCompletionRequest, tokenizer: Any, vocab_size: int) -> Prompts:
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in req.messages
        ]
        try:
            ids = chat_ids(tokenizer, messages)
        except Exception as e:  # a template that refuses the conversation (e.g. role order)
            raise ApiError(
                f"messages: the chat template refused them: {e}", param="messages"
            ) from None
        user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return Prompts([ids], [user], [user])

    def logprobs(self, req: P.ChatCompletionRequest) -> int | None:
        return (req.top_logprobs or 0) if req.logprobs else None

    def completion(
        self, req: P.ChatCompletionRequest, arm: ArmOutput, tokens: Tokens
    ) -> P.ChatCompletion:
        [out] = arm.outputs
        choices = [
            P.ChatChoice(
                index=o.index,
                message=P.AssistantMessage(content=o.text),
                logprobs=chat_logprobs(
                    list(o.token_ids), o.logprobs, req.top_logprobs or 0, tokens
                ),
                finish_reason=o.finish_reason,
            )
            for o in sorted(out.outputs, key=lambda o: o.index)
        ]
        return P.ChatCompletion(choices=choices, **arm.fields(req.model))

    def answer(
        self, req: P.ChatCompletionRequest, prompts: Prompts, arms: list[ArmOutput], tokens: Tokens
    ) -> BaseModel:
        [arm] = arms
        return self.completion(req, arm, tokens)


class ABChat(Chat):
    """``POST /v1/chat/completions/ab``: the unsteered and the steered arm with one seed."""

    name = "ab"
    ab = True
    events = ABEvents

    def admit(self, req: P.ChatCompletionRequest) -> None:
        if req.seed is None:
            req.seed = random.randrange(2**31)  # both arms sample with the same seed

    def answer(
        self, req: P.ChatCompletionRequest, prompts: Prompts, arms: list[ArmOutput], tokens: Tokens
    ) -> BaseModel:
        un, st = (self.completion(req, arm, tokens) for arm in arms)
        texts = [[c.message.content for c in r.choices] for r in (un, st)]
        return P.ABResponse(unsteered=un, steered=st, identical=texts[0] == texts[1])


# --- completions ---------------------------------------------------------------------------------


class Completions(Endpoint):
    """``POST /v1/completions``: one or several prompts (text or token ids), ``n`` samples each."""

    name = "completions"
    schema = P.CompletionRequest
    id_prefix = "cmpl"
    events = CompletionEvents

    def admit(self, req: P.CompletionRequest) -> None:
        if req.echo and req.logprobs is not None:
            raise ApiError("echo: cannot be combined with logprobs", param="echo")

    def size(self, req: P.CompletionRequest) -> tuple[int, int, str]:
        p = _prompt_list(req)
        chars = max((len(x) for x in p if isinstance(x, str)), default=0)
        return chars, max((len(x) for x in p if isinstance(x, list)), default=0), "prompt"

    def prompts(self, req: P.CompletionRequest, tokenizer: Any, vocab_size: int) -> Prompts:
        """Token ids and texts of ``prompt`` (a string, strings, ids or lists of ids); ids are
        checked against the vocabulary before anything decodes them."""
        p = _prompt_list(req)
        if not p:
            raise ApiError("prompt: must not be empty", param="prompt")
        if len(p) > MAX_PROMPTS:
            raise ApiError(f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")
        if isinstance(p[0], str):
            try:
                ids = [list(tokenizer.encode(t)) for t in p]
            except Exception as e:  # e.g. a lone surrogate the tokenizer cannot encode
                raise ApiError(f"prompt: cannot be tokenized: {e}", param="prompt") from None
            return Prompts(ids, list(p), list(p))
        ids = [list(x) for x in p]
        for x in ids:
            _check_ids(x, vocab_size)
        texts = [tokenizer.decode(x) for x in ids]
        return Prompts(ids, texts, texts)

    def logprobs(self, req: P.CompletionRequest) -> int | None:
        return req.logprobs

    def answer(
        self, req: P.CompletionRequest, prompts: Prompts, arms: list[ArmOutput], tokens: Tokens
    ) -> BaseModel:
        [arm] = arms
        choices = []
        for i, out in enumerate(arm.outputs):
            echo = prompts.texts[i] if req.echo else ""
            for o in sorted(out.outputs, key=lambda o: o.index):
                lp = completion_logprobs(list(o.token_ids), o.logprobs, req.logprobs or 0, tokens)
                choices.append(
                    P.CompletionChoice(
                        index=i * req.n + o.index,
                        text=echo + o.text,
                        logprobs=lp,
                        finish_reason=o.finish_reason,
                        steering=arm.infos[i],
                    )
                )
        return P.Completion(choices=choices, **arm.fields(req.model))


def _prompt_list(req: P.CompletionRequest) -> list[Any]:
    """``prompt`` as a list of prompts (strings or lists of ids)."""
    p: Any = req.prompt
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        return [p]
    return list(p)


def _check_ids(ids: list[int], vocab: int) -> None:
    if not ids:
        raise ApiError("prompt: the prompt is empty", param="prompt")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt"
        )


#: The endpoints :func:`steerserve.server.pipeline.handle` serves.
CHAT, AB, COMPLETIONS = Chat(), ABChat(), Completions()
