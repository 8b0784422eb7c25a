"""The HTTP boundary: OpenAI's chat/completions schema plus ``steering``, parsed once."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from openai.types.chat import ChatCompletionMessageFunctionToolCallParam
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest as _VMessages
from vllm.entrypoints.generate.base.protocol import (
    _CACHE_SALT_FORBIDDEN_CHARS,
    _MAX_CACHE_SALT_LENGTH,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest as _VChat,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as _VCompletion
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as _VResponses
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest as _VDetokenize
from vllm.entrypoints.serve.tokenize.protocol import (  # noqa: F401 (the tokenize routes')
    DetokenizeResponse,
    TokenizeResponse,
)
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest as _VTokenizeChat
from vllm.entrypoints.serve.tokenize.protocol import (
    TokenizeCompletionRequest as _VTokenizeCompletion,
)

from steerserve.engine.spec import reserved_key
from steerserve.server.ab.metrics import posted as posted_metrics
from steerserve.server.admin import ARTIFACT_REF
from steerserve.server.errors import api_error, field_path
from steerserve.server.steering import STEERING_DOC, Steering

# --- requests ----------------------------------------------------------------------------------


def _integral(v: Any) -> Any:
    """``2.0`` as ``2``: JSON Schema's ``integer`` (what /openapi.json publishes) includes it,
    so a client that validates against the document must not be refused; ``2.5`` stays wrong."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


class _Request(BaseModel):
    """Our own request bodies (feedback, vector loads): strict."""

    model_config = ConfigDict(extra="forbid", strict=True)


# --- chat and completions: vLLM's request models, strict, plus ``steering`` ------------------------

#: OpenAI fields that are bookkeeping on OpenAI's side and change nothing in an answer: accepted
#: (and ignored, as vLLM does) so that SDKs and frameworks sending them work.
NO_OP_FIELDS = (
    "metadata",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "store",
)

#: Fields that would change the answer's meaning and that this server cannot honour: refused with
#: the reason (vLLM's models would accept and ignore the OpenAI ones).
REFUSED_FIELDS = {
    "functions": "the legacy 'functions' API is not served: send 'tools'",
    "function_call": "the legacy 'function_call' is not served: send 'tool_choice'",
    "audio": "audio output is not served (text only)",
    "modalities": "only text output is served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not served",
    "request_id": "the server names each answer: send the X-Request-Id header to name it (as "
    "vLLM takes it)",
    # vLLM refuses it unless `vllm serve --trust-request-chat-template` (a Jinja template is code
    # run on the server), which steerserve never sets: left out of the document, with the reason
    "chat_template": "a chat template sent with a request is not run (it is code run on the "
    "server): the server renders with its own (serve --chat-template)",
}

#: Integer fields (see :func:`_integral`).
_INTEGRAL = (
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "top_logprobs",
    "logprobs",
    "top_k",
    "min_tokens",
    "prompt_logprobs",
)

#: The integers msgspec, which carries a request to vLLM's engine core, can encode. vLLM bounds
#: a few fields (``seed``, ``extra_args``) but not ``top_k``, ``stream_interval``,
#: ``repetition_detection`` or an integer in a structured-output schema: past this range those
#: fail after admission, a 500. One check over the whole body covers every field.
INT_RANGE = (-(2**63), 2**64 - 1)


def _out_of_range(value: Any, path: str = "") -> str | None:
    """The path (``a.b[0]``) of the first integer in a JSON value outside :data:`INT_RANGE`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if INT_RANGE[0] <= value <= INT_RANGE[1] else path
    if isinstance(value, dict):
        items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for sub, v in items:
        if (found := _out_of_range(v, sub)) is not None:
            return found
    return None


#: What ``/v1/completions`` generates when ``max_tokens`` is absent or null (OpenAI's and vLLM's
#: default; SDKs send unset fields as null, which must not mean "to the context limit").
COMPLETION_MAX_TOKENS = 16


def _strict_fields(model: type[BaseModel], data: Any) -> Any:
    """The checks vLLM's lax request models leave out: an unknown top-level field is a 400 naming
    it (vLLM's ``extra="allow"`` only logs it, so a misspelt ``steering`` would be silently
    unsteered), the fields of :data:`REFUSED_FIELDS` are refused with their reason, and
    ``vllm_xargs`` cannot carry steering past admission."""
    if not isinstance(data, dict):
        return data
    for key in data:
        if key in REFUSED_FIELDS:
            raise PydanticCustomError(
                "refused", "{message}", {"message": REFUSED_FIELDS[key], "field": key}
            )
        if key not in model.model_fields and key not in NO_OP_FIELDS:
            raise PydanticCustomError("extra_forbidden", "unrecognized", {"field": key})
    messages = data.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(m, dict):
            _check_message(i, m)
    bias = data.get("logit_bias")
    for key, value in bias.items() if isinstance(bias, dict) else ():
        if isinstance(value, int | float) and not -100 <= value <= 100:
            raise PydanticCustomError(  # OpenAI's range; vLLM would clamp it silently
                "range", "must be between -100 and 100", {"field": f"logit_bias.{key}"}
            )
    if (path := _out_of_range(data)) is not None:
        raise PydanticCustomError(
            "range",
            "integers must be between -2**63 and 2**64 - 1 (what reaches the engine core)",
            {"field": path},
        )
    xargs = data.get("vllm_xargs")
    ours = next((k for k in xargs if reserved_key(k)), None) if isinstance(xargs, dict) else None
    if ours is not None:
        raise PydanticCustomError(
            "refused",
            "{message}",
            {
                "message": "steering goes in the 'steering' field, where it is checked",
                # the key itself: param is a field path (ApiError bounds a long one)
                "field": f"vllm_xargs.{ours}",
            },
        )
    if any(isinstance(data.get(k), float) for k in _INTEGRAL):
        data = {**data, **{k: _integral(data[k]) for k in _INTEGRAL if k in data}}
    return data


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``#/$defs/`` references replaced by what they name (no cycles): a
    schema our models publish inside their own, where pydantic's references would not hold."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if (ref := node.get("$ref", "")).startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


#: A message's ``tool_calls``, on any role: null or OpenAI's function tool calls (vLLM renders no
#: other kind); checked and published from this one type. vLLM's message types check them only as
#: an assistant turn is rendered (a wrong type there was a 400 naming no field) and not at all on
#: other roles (a string was rendered).
_TOOL_CALLS: TypeAdapter[Any] = TypeAdapter(list[ChatCompletionMessageFunctionToolCallParam] | None)
_TOOL_CALLS_SCHEMA = _inlined(_TOOL_CALLS.json_schema())


def _check_message(i: int, m: dict[str, Any]) -> None:
    """What vLLM's message union leaves unchecked in message ``i``: it also takes openai-harmony
    messages (gpt-oss' own format, no role), which its renderer then fails on, content of any
    iterable type, and ``tool_calls`` of any type (:data:`_TOOL_CALLS`)."""
    if "role" not in m:
        raise PydanticCustomError("missing", "Field required", {"field": f"messages[{i}].role"})
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise PydanticCustomError(
            "content",
            "must be a string or an array of content parts",
            {"field": f"messages[{i}].content"},
        )
    if "tool_calls" in m:
        try:
            _TOOL_CALLS.validate_python(m["tool_calls"], strict=True)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            where = field_path(("messages", i, "tool_calls", *err["loc"]))
            raise PydanticCustomError(
                "tool_calls", "{message}", {"message": err["msg"], "field": where}
            ) from None


def _publish_strict(schema: dict[str, Any]) -> None:
    """The published schema says what :func:`_strict_fields` enforces: no other top-level field
    (the no-op ones listed), not the refused ones, every message's ``tool_calls``, and vLLM's
    bounds on ``cache_salt`` (its schema says 1,024 characters, its check refuses past 128)."""
    props = schema.setdefault("properties", {})
    for key in NO_OP_FIELDS:
        props.setdefault(key, {"description": "accepted; changes nothing in the answer"})
    for key in REFUSED_FIELDS:  # vLLM's request_id among them
        props.pop(key, None)
    schema["additionalProperties"] = False
    if "messages" in props:
        props["messages"]["items"]["properties"] = {"tool_calls": _TOOL_CALLS_SCHEMA}
    for form in props.get("cache_salt", {}).get("anyOf", ()):
        # vLLM's validate_cache_salt, as JSON Schema: its refusal is kept (it guards the cache
        # backends' keys, and 128 characters hold far more than a 256-bit secret)
        if form.get("type") == "string":
            chars = "".join(f"\\u{ord(c):04x}" for c in sorted(_CACHE_SALT_FORBIDDEN_CHARS))
            form.update(maxLength=_MAX_CACHE_SALT_LENGTH, pattern=f"^[^{chars}]*$")


def _text(content: Any) -> str:
    """A message's content as plain text (text parts joined): what ``auto`` reads a language
    from and the size check counts. vLLM's models keep parts as a one-pass iterator: this reads
    it up, so the request served is parsed anew from the body (``pipeline``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))


class ChatCompletionRequest(_VChat):
    """vLLM's chat request (every OpenAI and vLLM field), strict, plus ``steering``."""

    model_config = ConfigDict(strict=True, json_schema_extra=_publish_strict)

    model: str  # required here: the server checks it before anything else
    steering: Steering = Field(None, description=STEERING_DOC)

    @model_validator(mode="before")
    @classmethod
    def _strict(cls, data: Any) -> Any:
        data = _strict_fields(cls, data)
        if isinstance(data, dict) and data.get("echo"):
            raise PydanticCustomError(
                "refused",
                "{message}",
                {"message": "echo is a completions field (use /v1/completions)", "field": "echo"},
            )
        return data

    def texts(self) -> list[str]:
        """Every message's text (the size check); a content part vLLM's model refuses (checked
        only as it is read) is a 400 naming it."""
        out = []
        for i, m in enumerate(self.messages):
            try:
                out.append(_text(m.get("content")))
            except ValidationError as e:
                err = e.errors(include_url=False)[0]
                raise api_error(err, prefix=("messages", i, "content")) from None
        return out

    def user_text(self) -> str:
        """The last user message's text: the language ``auto`` steers by."""
        for m in reversed(self.messages):
            if m.get("role") == "user":
                return _text(m.get("content"))
        return ""

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


def _non_empty(schema: dict[str, Any]) -> None:
    """Every string and array form in ``schema`` published as non-empty (``minLength``,
    ``minItems``), its items' too."""
    for form in schema.get("anyOf", [schema]):
        if form.get("type") == "string":
            form["minLength"] = max(form.get("minLength", 0), 1)
        elif form.get("type") == "array":
            form["minItems"] = max(form.get("minItems", 0), 1)
            _non_empty(form.get("items", {}))


def _publish_completion(schema: dict[str, Any]) -> None:
    """:func:`_publish_strict`, ``prompt`` non-empty at every level (``_empty_prompt``), and
    ``prompt_embeds`` as what JSON carries: base64 text (pydantic says ``format: binary``, raw
    bytes no JSON body holds, which schemathesis fails on inside /invocations' ``oneOf``)."""
    _publish_strict(schema)
    _non_empty(schema["properties"]["prompt"])
    embeds = schema["properties"].get("prompt_embeds", {})
    for form in [*embeds.get("anyOf", []), *(f.get("items", {}) for f in embeds.get("anyOf", []))]:
        if form.pop("format", None) == "binary":
            form["contentEncoding"] = "base64"


def _empty_prompt(prompt: Any) -> str | None:
    """The field of an empty prompt, at any level. ``""`` and ``[]`` were refused, ``[""]`` and
    ``[[]]`` in a list served: an empty text is the BOS token alone on a model that has one and
    an engine error on one that has none (Qwen's), so no empty form is served and the document
    says so; a client wanting OpenAI's "start of a document" sends that token itself."""
    if prompt == "" or prompt == []:
        return "prompt"
    if isinstance(prompt, list):
        return next((f"prompt[{i}]" for i, p in enumerate(prompt) if p == "" or p == []), None)
    return None


class CompletionRequest(_VCompletion):
    """vLLM's completions request, strict, plus ``steering``."""

    model_config = ConfigDict(strict=True, json_schema_extra=_publish_completion)

    model: str
    steering: Steering = Field(None, description=STEERING_DOC)

    @model_validator(mode="before")
    @classmethod
    def _strict(cls, data: Any) -> Any:
        data = _strict_fields(cls, data)
        if isinstance(data, dict) and (field := _empty_prompt(data.get("prompt"))) is not None:
            raise PydanticCustomError("empty", "must not be empty", {"field": field})
        if isinstance(data, dict) and data.get("max_tokens", 0) is None:
            data = {**data, "max_tokens": COMPLETION_MAX_TOKENS}
        return data

    def token_budget(self) -> int | None:
        return self.max_tokens


#: Responses fields this server cannot honour (vLLM's in-memory store is off: see
#: ``VLLM_ENABLE_RESPONSES_API_STORE``), refused with the reason instead of vLLM's.
RESPONSES_REFUSED = {
    "background": "background responses are not served: send the request and wait for it, or "
    "stream it",
}


def _publish_messages(schema: dict[str, Any]) -> None:
    """The document says what :meth:`MessagesRequest._strict` enforces."""
    schema.get("properties", {}).pop("request_id", None)
    schema["additionalProperties"] = False


class MessagesRequest(_VMessages):
    """vLLM's Anthropic Messages request (``POST /v1/messages``), strict, plus ``steering`` and
    vLLM's ``seed``; ``request_id`` is the server's (the pipeline names every answer)."""

    model_config = ConfigDict(json_schema_extra=_publish_messages)

    steering: Steering = Field(None, description=STEERING_DOC)
    seed: int | None = Field(None, description="vLLM's sampling seed")
    request_id: str | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _strict(cls, data: Any) -> Any:
        """An unknown top-level field is a 400 naming it (vLLM's model ignores it, so a
        misspelt ``steering`` would go unsteered); ``request_id`` is refused; integers bounded."""
        if not isinstance(data, dict):
            return data
        for key in data:
            if key in REFUSED_FIELDS:
                raise PydanticCustomError(
                    "refused", "{message}", {"message": REFUSED_FIELDS[key], "field": key}
                )
            if key not in cls.model_fields:
                raise PydanticCustomError("extra_forbidden", "unrecognized", {"field": key})
        if data.get("messages") == []:  # vLLM's conversion indexes the first message
            raise PydanticCustomError(
                "too_short", "at least one message is required", {"field": "messages"}
            )
        if (path := _out_of_range(data)) is not None:
            raise PydanticCustomError(
                "range",
                "integers must be between -2**63 and 2**64 - 1 (what reaches the engine core)",
                {"field": path},
            )
        return data

    def texts(self) -> list[str]:
        """The system prompt's and every message's text (the size check)."""
        return [_blocks_text(self.system), *(_blocks_text(m.content) for m in self.messages)]

    def user_text(self) -> str:
        """The last user message's text: the language ``auto`` steers by."""
        for m in reversed(self.messages):
            if m.role == "user":
                return _blocks_text(m.content)
        return ""

    def token_budget(self) -> int | None:
        return self.max_tokens


def _blocks_text(content: Any) -> str:
    """An Anthropic content (a string or content blocks) as plain text (text blocks joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text or "" for b in content if b.type == "text")


class ResponsesRequest(_VResponses):
    """vLLM's Responses API request (``POST /v1/responses``), strict, plus ``steering``."""

    model_config = ConfigDict(strict=True, json_schema_extra=_publish_strict)

    model: str
    steering: Steering = Field(None, description=STEERING_DOC)

    @model_validator(mode="before")
    @classmethod
    def _strict(cls, data: Any) -> Any:
        data = _strict_fields(cls, data)
        for key, why in RESPONSES_REFUSED.items():
            if isinstance(data, dict) and data.get(key):
                raise PydanticCustomError("refused", "{message}", {"message": why, "field": key})
        return data

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as a list of items (a string is one user message), each a dict."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [i if isinstance(i, dict) else i.model_dump() for i in self.input]

    def texts(self) -> list[str]:
        """The instructions' and every item's text (the size check): message contents, tool
        calls' arguments and tool outputs."""
        out = [self.instructions or ""]
        for item in self.input_items():
            out += [_text(item.get(k)) for k in ("content", "arguments", "output")]
        return out

    def user_text(self) -> str:
        """The last user message's text: the language ``auto`` steers by."""
        for item in reversed(self.input_items()):
            if item.get("role") == "user":
                return _text(item.get("content"))
        return ""

    def token_budget(self) -> int | None:
        return self.max_output_tokens


class _Strict(BaseModel):
    """vLLM's lax request models made strict (:func:`_strict_fields`, published)."""

    model_config = ConfigDict(strict=True, json_schema_extra=_publish_strict)

    @model_validator(mode="before")
    @classmethod
    def _strict(cls, data: Any) -> Any:
        return _strict_fields(cls, data)


class TokenizeCompletionRequest(_Strict, _VTokenizeCompletion):
    """vLLM's: a prompt."""


class TokenizeChatRequest(_Strict, _VTokenizeChat):
    """vLLM's: messages rendered by the chat template."""


def _tokenize_kind(data: Any) -> str:
    return "TokenizeChatRequest" if isinstance(data, dict) and "messages" in data else "Prompt"


class TokenizeRequest(
    RootModel[
        Annotated[
            Annotated[TokenizeCompletionRequest, Tag("Prompt")]
            | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
            Discriminator(_tokenize_kind),
        ]
    ]
):
    """``POST /v1/tokenize``: vLLM's (a prompt, or messages rendered by the chat template)."""


#: vLLM's ``tokens`` (ids in the int64 range), with what the server adds: at least one.
_TOKENS = _VDetokenize.model_fields["tokens"].annotation


class DetokenizeRequest(_Strict, _VDetokenize):
    """``POST /v1/detokenize``: vLLM's (token ids)."""

    # [] was a 400 (nothing to detokenize) the document did not announce: now its own rule
    tokens: _TOKENS = Field(min_length=1)  # type: ignore[valid-type]


_POSTED, _LO, _HI = posted_metrics()  # the metric registry's (server/ab/metrics.py)


class FeedbackRequest(_Request):
    id: str = Field(min_length=1, max_length=200, description="the answer's completion id")
    score: float = Field(
        allow_inf_nan=False,
        ge=_LO,
        le=_HI,
        description="the outcome in the metric's range (feedback: [-1, 1], e.g. 1 thumbs up, 0 "
        "down); an answer's last per metric counts",
    )
    metric: str = Field(
        "feedback",
        description="a feedback metric of the server's registry (the automatic ones are "
        "measured by the server on every reply and refused here)",
        json_schema_extra={"enum": _POSTED},
    )


class FeedbackAnswer(BaseModel):
    """``POST /v1/steering/feedback``: the feedback, joined to its request's arm."""

    object: Literal["steering.feedback"] = "steering.feedback"
    id: str
    score: float
    metric: str = "feedback"
    experiment: str | None
    arm: str | None
    language: str | None


class VectorLoadRequest(_Request):
    name: str = Field(
        description="artifact name, optionally /version; never a path",
        # the rule is admin.check_ref's; published so clients and fuzzers know it
        json_schema_extra={"pattern": ARTIFACT_REF.pattern, "not": {"pattern": r"\.\."}},
    )
    default: bool = Field(False, description="make it the artifact `steering: true` uses")
