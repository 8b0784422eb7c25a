"""What differs between chat, completions and the A/B endpoint: the request schema, how prompts
become token ids, how final engine outputs become an OpenAI answer, and which events stream
one (``events.py``). The path every request takes (``pipeline.py``) is shared."""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel

from steerserve.chat import chat_ids
from steerserve.server import answers as A
from steerserve.server import protocol as P
from steerserve.server.errors import ApiError
from steerserve.server.events import (
    ABEvents,
    ArmOutput,
    ChatEvents,
    CompletionEvents,
    Events,
    Prompts,
)
from steerserve.server.logprobs import chat_logprobs, completion_logprobs
from steerserve.server.tokens import Tokens

MAX_PROMPTS = 128


class Endpoint:
    """What an endpoint defines; ``pipeline.handle`` does the rest."""

    name: str  # the metrics endpoint label
    schema: type[P.ChatCompletionRequest] | type[P.CompletionRequest]
    id_prefix: str
    ab = False  # two arms, unsteered and steered

    def admit(self, req: Any) -> None:
        """Refusals and defaults of this endpoint, before anything is tokenized."""

    def sequences(self, req: Any) -> tuple[int, str, str]:
        """How many sequences the request runs, the product that gives it, and the field to
        lower: checked against the server's cap before anything is tokenized."""
        return req.n, f"n {req.n}", "n"

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
    ) -> A.ChatCompletion:
        [out] = arm.outputs
        choices = [
            A.ChatChoice(
                index=o.index,
                message=A.AssistantMessage(content=o.text),
                logprobs=chat_logprobs(
                    list(o.token_ids), o.logprobs, req.top_logprobs or 0, tokens
                ),
                finish_reason=o.finish_reason,
            )
            for o in sorted(out.outputs, key=lambda o: o.index)
        ]
        return A.ChatCompletion(choices=choices, **arm.fields(req.model))

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

    def sequences(self, req: P.ChatCompletionRequest) -> tuple[int, str, str]:
        return 2 * req.n, f"n {req.n} × 2 arms", "n"

    def answer(
        self, req: P.ChatCompletionRequest, prompts: Prompts, arms: list[ArmOutput], tokens: Tokens
    ) -> BaseModel:
        un, st = (self.completion(req, arm, tokens) for arm in arms)
        texts = [[c.message.content for c in r.choices] for r in (un, st)]
        return A.ABResponse(unsteered=un, steered=st, identical=texts[0] == texts[1])


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
        p = _prompt_list(req)
        if not p:
            raise ApiError("prompt: must not be empty", param="prompt")
        if len(p) > MAX_PROMPTS:
            raise ApiError(f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")

    def sequences(self, req: P.CompletionRequest) -> tuple[int, str, str]:
        count = len(_prompt_list(req))
        return count * req.n, f"{count} prompts × n {req.n}", "n" if req.n > 1 else "prompt"

    def size(self, req: P.CompletionRequest) -> tuple[int, int, str]:
        p = _prompt_list(req)
        chars = max((len(x) for x in p if isinstance(x, str)), default=0)
        return chars, max((len(x) for x in p if isinstance(x, list)), default=0), "prompt"

    def prompts(self, req: P.CompletionRequest, tokenizer: Any, vocab_size: int) -> Prompts:
        """Token ids and texts of ``prompt`` (a string, strings, ids or lists of ids); ids are
        checked against the vocabulary before anything decodes them."""
        p = _prompt_list(req)
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
                    A.CompletionChoice(
                        index=i * req.n + o.index,
                        text=echo + o.text,
                        logprobs=lp,
                        finish_reason=o.finish_reason,
                        steering=arm.infos[i],
                    )
                )
        return A.Completion(choices=choices, **arm.fields(req.model))


def check_sequences(ep: Endpoint, req: Any, cap: int) -> None:
    """A 400 naming the field to lower when the request runs more than ``cap`` sequences: each
    field has its own bound, but their product decides how long the engine is held."""
    count, product, param = ep.sequences(req)
    if count > cap:
        raise ApiError(
            f"{param}: {product} = {count} sequences; this server runs at most {cap} per "
            "request (--max-seqs-per-request): lower n or split the prompts over requests",
            param=param,
            code="too_many_sequences",
        )


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
