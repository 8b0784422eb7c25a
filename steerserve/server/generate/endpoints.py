"""What differs between chat, completions, the A/B endpoint and the Responses API: the request
schema, the checks before anything is rendered, the texts ``auto`` reads a language from, which
of vLLM's serving calls answers, and where an answer carries its ``steering``. The path every
request takes (``pipeline.py``) is shared; the answers' shapes are vLLM's (``hosted.py``)."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from steerserve.server import protocol as P
from steerserve.server.errors import ApiError
from steerserve.server.generate.hosted import sse

MAX_PROMPTS = 128


class Endpoint:
    """What an endpoint defines; ``pipeline.handle`` does the rest."""

    name: str  # the metrics endpoint label
    schema: type[Any]  # the request's model (protocol.py)
    id_prefix: str
    ab = False  # two arms, unsteered and steered
    done = "data: [DONE]\n\n"  # a stream's last event
    fields = ("max_tokens", "messages")  # a context-length refusal's: the budget, the prompt
    plain = True  # its stream's later chunks may go out as vLLM wrote them (streaming._events)

    def admit(self, req: Any) -> None:
        """Refusals and defaults of this endpoint, before anything is tokenized."""

    def sequences(self, req: Any) -> tuple[int, str, str]:
        """How many sequences the request runs, the product that gives it, and the field to
        lower: checked against the server's cap before anything is tokenized."""
        n = req.n or 1
        return n, f"n {n}", "n"

    def answer_id(self, hexid: str) -> str:
        """The answer's id (the decision log joins feedback by it), as vLLM's serving call
        names it from :meth:`request_id`."""
        return f"{self.id_prefix}-{hexid}"

    def request_id(self, hexid: str) -> str:
        """The ``request_id`` vLLM's serving call is given (chat and completions prefix it)."""
        return hexid

    def size(self, req: Any) -> tuple[int, int, str]:
        """(characters of text, token ids) of the largest prompt, and its field: checked
        against the context before anything is tokenized."""
        raise NotImplementedError

    def texts(self, req: Any, tokenizer: Any, vocab_size: int) -> list[str]:
        """Per prompt, the text ``auto`` detects the language of (and the decision log keeps)."""
        raise NotImplementedError

    def serve(self, serving: Any) -> Any:
        """vLLM's serving call for this endpoint (``create_chat_completion`` …)."""
        raise NotImplementedError

    def echo(self, body: dict[str, Any], infos: list[Any], n: int) -> None:
        """Put each prompt's ``steering`` (``infos``) into a collected answer's choices."""

    def echo_chunk(self, chunk: dict[str, Any], infos: list[Any], n: int, told: set[int]) -> None:
        """The same for a streamed chunk: on a choice's first chunk (``told`` tracks them)."""

    def dump(self, result: Any) -> dict[str, Any]:
        """A collected answer of vLLM's serving call as JSON."""
        return result.model_dump(mode="json")

    def label_chunk(self, chunk: dict[str, Any], model: str, steering: Any, first: bool) -> None:
        """Name the model asked for (a preset's id) in a streamed chunk, and put the answer's
        ``steering`` into its first chunk and its usage chunk."""
        chunk["model"] = model
        if first or (chunk.get("usage") and not chunk.get("choices")):
            chunk["steering"] = steering

    def sse(self, chunk: dict[str, Any]) -> str:
        """A chunk as a server-sent event."""
        return sse(chunk)


class Chat(Endpoint):
    """``POST /v1/chat/completions``."""

    name = "chat"
    schema = P.ChatCompletionRequest
    id_prefix = "chatcmpl"

    def admit(self, req: P.ChatCompletionRequest) -> None:
        super().admit(req)
        if not req.messages:
            raise ApiError("messages: must not be empty", param="messages")

    def size(self, req: P.ChatCompletionRequest) -> tuple[int, int, str]:
        return sum(map(len, req.texts())), 0, "messages"

    def texts(self, req: P.ChatCompletionRequest, tokenizer: Any, vocab_size: int) -> list[str]:
        return [req.user_text()]

    def serve(self, serving: Any) -> Any:
        return serving.chat.create_chat_completion


class ABChat(Chat):
    """``POST /v1/chat/completions/ab``: the unsteered and the steered arm with one seed."""

    name = "ab"
    ab = True

    def admit(self, req: P.ChatCompletionRequest) -> None:
        super().admit(req)
        if req.seed is None:
            req.seed = random.randrange(2**31)  # both arms sample with the same seed

    def sequences(self, req: P.ChatCompletionRequest) -> tuple[int, str, str]:
        n = req.n or 1
        return 2 * n, f"n {n} × 2 arms", "n"


class Completions(Endpoint):
    """``POST /v1/completions``: one or several prompts (text or token ids), ``n`` samples each."""

    name = "completions"
    schema = P.CompletionRequest
    id_prefix = "cmpl"

    def admit(self, req: P.CompletionRequest) -> None:
        super().admit(req)
        p = _prompt_list(req)
        if not p:
            raise ApiError("prompt: must not be empty", param="prompt")
        if len(p) > MAX_PROMPTS:
            raise ApiError(f"prompt: at most {MAX_PROMPTS} prompts per request", param="prompt")

    def sequences(self, req: P.CompletionRequest) -> tuple[int, str, str]:
        count, n = len(_prompt_list(req)), req.n or 1
        return count * n, f"{count} prompts × n {n}", "n" if n > 1 else "prompt"

    def size(self, req: P.CompletionRequest) -> tuple[int, int, str]:
        p = _prompt_list(req)
        chars = max((len(x) for x in p if isinstance(x, str)), default=0)
        return chars, max((len(x) for x in p if isinstance(x, list)), default=0), "prompt"

    def texts(self, req: P.CompletionRequest, tokenizer: Any, vocab_size: int) -> list[str]:
        """The prompts' texts; ids are checked against the vocabulary before anything decodes
        them."""
        out = []
        for x in _prompt_list(req):
            if isinstance(x, str):
                out.append(x)
            else:
                check_ids(list(x), vocab_size)
                out.append(tokenizer.decode(list(x)))
        return out

    def serve(self, serving: Any) -> Any:
        return serving.completion.create_completion

    def echo(self, body: dict[str, Any], infos: list[Any], n: int) -> None:
        for c in body.get("choices") or ():
            c["steering"] = infos[c["index"] // n]

    def echo_chunk(self, chunk: dict[str, Any], infos: list[Any], n: int, told: set[int]) -> None:
        for c in chunk.get("choices") or ():
            if c["index"] not in told:
                told.add(c["index"])
                c["steering"] = infos[c["index"] // n]


class Responses(Endpoint):
    """``POST /v1/responses``: the OpenAI Responses API, one answer per request (no ``n``)."""

    plain = False  # its events are written again (sse), and labelled by their type
    name = "responses"
    schema = P.ResponsesRequest
    id_prefix = "resp"
    done = ""  # vLLM's and OpenAI's Responses streams end with response.completed
    fields = ("max_output_tokens", "input")

    def sequences(self, req: P.ResponsesRequest) -> tuple[int, str, str]:
        return 1, "1", "input"

    def answer_id(self, hexid: str) -> str:
        return self.request_id(hexid)

    def request_id(self, hexid: str) -> str:
        return f"resp_{hexid}"  # vLLM's Responses answer is named by it as it is

    def size(self, req: P.ResponsesRequest) -> tuple[int, int, str]:
        return sum(map(len, req.texts())), 0, "input"

    def texts(self, req: P.ResponsesRequest, tokenizer: Any, vocab_size: int) -> list[str]:
        return [req.user_text()]

    def serve(self, serving: Any) -> Callable[[Any, Any], Awaitable[Any]]:
        async def create(req: P.ResponsesRequest, raw: Any) -> Any:
            result = await serving.responses.create_responses(req, raw)
            if isinstance(result, AsyncIterator):
                return _event_texts(result)
            return result

        return create

    def dump(self, result: Any) -> dict[str, Any]:
        return result.model_dump(mode="json", by_alias=True)

    def label_chunk(self, chunk: dict[str, Any], model: str, steering: Any, first: bool) -> None:
        """The events that carry the response object (created, in progress, completed) carry
        the model asked for and the ``steering`` in it."""
        if isinstance(response := chunk.get("response"), dict):
            response["model"] = model
            response["steering"] = steering

    def sse(self, chunk: dict[str, Any]) -> str:
        return f"event: {chunk.get('type', 'error')}\n{sse(chunk)}"


class Messages(Endpoint):
    """``POST /v1/messages``: the Anthropic Messages API (vLLM's), steered as chat is; one answer
    per request, its ``steering`` at the top (streamed: in ``message_start``'s message)."""

    plain = False  # its events are written again (sse), and labelled by their type
    name = "messages"
    schema = P.MessagesRequest
    id_prefix = "chatcmpl"  # vLLM names a Messages answer by the chat completion it converts
    done = ""  # an Anthropic stream ends with message_stop

    def sequences(self, req: P.MessagesRequest) -> tuple[int, str, str]:
        return 1, "1", "messages"

    def size(self, req: P.MessagesRequest) -> tuple[int, int, str]:
        return sum(map(len, req.texts())), 0, "messages"

    def texts(self, req: P.MessagesRequest, tokenizer: Any, vocab_size: int) -> list[str]:
        return [req.user_text()]

    def serve(self, serving: Any) -> Callable[[Any, Any], Awaitable[Any]]:
        async def create(req: P.MessagesRequest, raw: Any) -> Any:
            result = await serving.messages.create_messages(req, raw)
            if isinstance(result, AsyncIterator):
                return _data_events(result)
            return result

        return create

    def dump(self, result: Any) -> dict[str, Any]:
        return result.model_dump(mode="json", exclude_none=True)

    def label_chunk(self, chunk: dict[str, Any], model: str, steering: Any, first: bool) -> None:
        if isinstance(message := chunk.get("message"), dict):  # message_start's
            message["model"] = model
            message["steering"] = steering

    def sse(self, chunk: dict[str, Any]) -> str:
        return f"event: {chunk.get('type', 'error')}\n{sse(chunk)}"


async def _data_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """vLLM's Anthropic events (``event: x`` + ``data: {...}``) as ``data:`` events, the form
    the stream reads (each JSON names its event in ``type``; :meth:`Messages.sse` writes it)."""
    try:
        async for event in events:
            yield event[event.find("data: ") :] if "data: " in event else event
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


#: The Responses events vLLM sends before the engine has answered anything.
_OPENING = {"response.created", "response.in_progress"}


async def _event_texts(events: AsyncIterator[Any]) -> AsyncIterator[str]:
    """vLLM's Responses events as ``data:`` events, the opening ones held back until the engine's
    first output (or its refusal) comes: the pipeline waits for a stream's first event so that
    a refusal is still a 4xx (``streaming.stream``)."""
    held: list[str] | None = []
    try:
        async for event in events:
            text = f"data: {event.model_dump_json(by_alias=True)}\n\n"
            if held is None:
                yield text
                continue
            held.append(text)
            if getattr(event, "type", None) not in _OPENING:
                for t in held:
                    yield t
                held = None
        for t in held or ():
            yield t
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def copies(req: Any) -> int:
    """How many times the engine's one sample is repeated: ``n`` for greedy requests with n > 1
    (vLLM refuses those; OpenAI answers n choices, identical by definition), else 1."""
    n = getattr(req, "n", None) or 1
    return n if req.temperature is not None and req.temperature < 1e-5 and n > 1 else 1


def repeat(body: dict[str, Any], n: int) -> None:
    """An answer or chunk of a request served with n = 1 as the ``n`` identical choices it
    stands for: choice i becomes choices i·n … i·n + n − 1, and usage counts every copy."""
    if n == 1:
        return
    choices = []
    for c in body.get("choices") or ():
        index = c["index"]
        for j in range(n):
            d = copy.deepcopy(c) if j else c
            d["index"] = index * n + j
            choices.append(d)
    if "choices" in body:
        body["choices"] = choices
    if usage := body.get("usage"):
        usage["completion_tokens"] *= n
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def check_sequences(ep: Endpoint, req: Any, cap: int) -> int:
    """The sequences the request runs; a 400 naming the field to lower when they are more than
    ``cap``: each field has its own bound, but their product decides how long the engine is
    held."""
    count, product, param = ep.sequences(req)
    if count > cap:
        raise ApiError(
            f"{param}: {product} = {count} sequences; this server runs at most {cap} per "
            "request (--max-seqs-per-request): lower n or split the prompts over requests",
            param=param,
            code="too_many_sequences",
        )
    return count


def _prompt_list(req: P.CompletionRequest) -> list[Any]:
    """``prompt`` as a list of prompts (strings or lists of ids)."""
    p: Any = req.prompt
    if p is None:
        return []
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        return [p]
    return list(p)


def check_ids(ids: list[int], vocab: int, field: str = "prompt") -> None:
    """Token ids given as such: not empty, each in the vocabulary (before anything decodes them)."""
    if not ids:
        raise ApiError(f"{field}: the prompt is empty", param=field)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            f"{field}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=field
        )


#: The endpoints :func:`steerserve.server.generate.pipeline.handle` serves.
CHAT, AB, COMPLETIONS, RESPONSES = Chat(), ABChat(), Completions(), Responses()
MESSAGES = Messages()


def invoked(body: bytes) -> Endpoint:
    """The endpoint an ``/invocations`` body is for (SageMaker's one route, as vLLM serves it):
    a chat body (``messages``), a completions body (``prompt``) or a Responses body (``input``)."""
    try:
        data = json.loads(body)
    except ValueError:
        raise ApiError("request body is not valid JSON", code="invalid_json") from None
    for key, ep in (("messages", CHAT), ("prompt", COMPLETIONS), ("input", RESPONSES)):
        if isinstance(data, dict) and key in data:
            return ep
    raise ApiError(
        "messages: an /invocations body is a chat (messages), completions (prompt) or "
        "Responses (input) request",
        param="messages",
    )
