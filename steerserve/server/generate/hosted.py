"""vLLM's own OpenAI serving layer, hosted on the server's engine: the one seam where steering
enters chat and completions."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from steerserve.engine.api import Prepared
from steerserve.engine.spec import reserved_key
from steerserve.server.errors import ApiError
from steerserve.server.generate.capacity import Budget

if TYPE_CHECKING:
    from steerserve.server.ab.experiment import Enrolled
    from steerserve.server.backend import Backend

logger = logging.getLogger(__name__)

#: vLLM releases whose serving classes this seam was read against (docs/vllm-seams.md).
KNOWN_VLLM = ("0.32.0", "0.33.0")


def check_version() -> str:
    """The installed vLLM's version; a RuntimeError for one this seam does not know."""
    import vllm

    version = str(vllm.__version__).split("+", 1)[0]
    if version not in KNOWN_VLLM:
        raise RuntimeError(
            f"steerserve hosts vLLM's OpenAI serving classes, read against vLLM "
            f"{', '.join(KNOWN_VLLM)}; the installed vLLM is {vllm.__version__} "
            "(see docs/vllm-seams.md)"
        )
    return version


# --- the per-request plan ------------------------------------------------------------------------


@dataclass
class Plan:
    """What one serving call (one arm) may send to the engine: per engine call in order (prompt i
    of a completions batch), the admitted steering and its metrics label; and what comes back
    (engine streams to close, tokens per label, the first engine-side error, replies)."""

    prepared: list[Prepared]
    labels: list[str]
    budget: int | None  # the client's max_tokens: beyond the context it is a 400, never cut
    max_model_len: int
    gens: list[AsyncGenerator[Any, None]]  # shared by the arms of a request: the flight closes them
    experiment: Enrolled | None = None
    work: Budget | None = None  # the request's prompt work, shared by its arms (capacity.py)
    grammar: str | None = None  # the field of the request's structured-output grammar, if any
    fields: tuple[str, str] = ("max_tokens", "messages")  # its budget's and its prompt's
    calls: int = 0
    tokens: dict[str, list[int]] = field(default_factory=dict)
    error: BaseException | None = None

    def take(self) -> tuple[int, Prepared]:
        """The next engine call's index and steering. Beam search (refused when steered) calls
        the engine once per step: an unsteered plan serves any number of calls."""
        i = self.calls
        self.calls += 1
        if i >= len(self.prepared):
            if any(p.steered for p in self.prepared):
                raise RuntimeError(f"engine call {i + 1} of a {len(self.prepared)}-call plan")
            i = len(self.prepared) - 1
        return i, self.prepared[i]

    def check_room(self, prompt_len: int) -> None:
        """OpenAI's 400 for a prompt plus ``max_tokens`` beyond the context (vLLM clamps it)."""
        room = self.max_model_len - prompt_len
        if room <= 0 or (self.budget is not None and self.budget > room):
            asked = prompt_len + (self.budget or 1)
            raise ApiError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {asked} tokens ({prompt_len} in the prompt, {self.budget or 1} "
                "for the completion).",
                param=self.fields[0] if room > 0 else self.fields[1],
                code="context_length_exceeded",
            )

    async def track(self, i: int, gen: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """``gen``'s outputs, counted (tokens under the call's label, replies of the experiment)
        and its first error kept for the answer."""
        label = self.labels[i]
        t = self.tokens.setdefault(label, [0, 0])
        first = True
        try:
            async for out in gen:
                if self.grammar is not None and _failed_before_a_token(out):
                    raise ApiError(  # the engine failed its grammar: compile error or timeout
                        f"{self.grammar}: the engine could not compile this grammar (too complex, "
                        "or its compilation timed out); simplify it",
                        param=self.grammar,
                        code="grammar_not_compiled",
                    )
                if first:
                    t[0] += len(out.prompt_token_ids or ())
                    first = False
                t[1] += sum(len(o.token_ids) for o in out.outputs)
                if self.experiment is not None and self.experiment.replies is not None:
                    self.experiment.add_replies(i, out)  # an enrolled request has one arm
                yield out
        except BaseException as e:
            if self.error is None and isinstance(e, Exception):
                self.error = e
            raise
        finally:
            await gen.aclose()


def _failed_before_a_token(out: Any) -> bool:
    """An engine output that ended in error before any token: what vLLM's scheduler sends when a
    request's grammar failed to compile (its only such error on this server's engines)."""
    return any(o.finish_reason == "error" and not o.token_ids for o in out.outputs)


# --- the engine client vLLM's serving classes see ---------------------------------------------------


class SteeringEngine:
    """The server's ``AsyncLLM`` as vLLM's serving classes see it: every attribute forwarded, and
    ``generate()`` applying its plan's steering (entries and prefix-cache key) through the
    backend, which also checks a steered request's distributions (``backend._checked``). The
    engine the serving objects are built on has no plan and refuses to generate; each arm's call
    runs on copies bound to its plan (:meth:`Serving.planned`)."""

    def __init__(self, backend: Backend, plan: Plan | None = None) -> None:
        self._backend = backend
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend.llm, name)

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kw: Any
    ) -> AsyncGenerator[Any, None]:
        plan = self._plan
        if plan is None:  # a route that did not plan its request: never unvetted to the worker
            raise RuntimeError("steerserve: an engine call outside a planned request")
        i, prepared = plan.take()
        extra = getattr(sampling_params, "extra_args", None) or {}
        ours = next((k for k in extra if reserved_key(k)), None)
        if ours is not None:  # refused at parse; never trusted if it came through
            raise ApiError(
                f"vllm_xargs.{ours}: steering goes in the 'steering' field",
                param=f"vllm_xargs.{ours}",
            )
        n_prompt = len(prompt.get("prompt_token_ids") or ())
        plan.check_room(n_prompt)
        if plan.work is not None:
            plan.work.charge(
                n_prompt, getattr(sampling_params, "prompt_logprobs", None) is not None
            )
        gen = self._backend.generate(prompt, sampling_params, prepared, request_id, **kw)
        tracked = plan.track(i, gen)
        plan.gens.append(tracked)
        return tracked


# --- streamed answers: vLLM's server-sent events, rewritten -------------------------------------


def event_json(event: str) -> Any:
    """The JSON of one ``data: …`` event; None for ``[DONE]`` or a comment."""
    if not event.startswith("data: "):
        return None
    body = event[len("data: ") :].strip()
    if body == "[DONE]":
        return None
    return json.loads(body)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def first_event(events: AsyncIterator[str]) -> str | None:
    """The first event of a serving stream (it comes with the engine's first output)."""
    async for ev in events:
        return ev
    return None


# --- building the serving objects ------------------------------------------------------------------


@dataclass
class Serving:
    """vLLM's serving objects on the server's engine (built once the engine is up)."""

    chat: Any  # OpenAIServingChat
    completion: Any  # OpenAIServingCompletion
    tokenization: Any  # ServingTokenization
    tool_parser: str | None
    responses: Any  # OpenAIServingResponses
    backend: Backend
    messages: Any = None  # AnthropicServingMessages (steered_messages)

    def planned(self, plan: Plan) -> Serving:
        """The generating objects for one arm's call, their engine bound to ``plan``: shallow
        copies (shared templates, parsers and caches) whose every ``engine_client.generate``,
        a Responses stream's lazy ones included, applies that plan and no other."""
        engine = SteeringEngine(self.backend, plan)

        def bound(obj: Any) -> Any:
            obj = copy.copy(obj)
            obj.engine_client = engine
            return obj

        return dataclasses.replace(
            self,
            chat=bound(self.chat),
            completion=bound(self.completion),
            responses=bound(self.responses),
            messages=bound(self.messages),
        )


def tool_parser_for(template: str | None, asked: str | None) -> str | None:
    """The tool-call parser: ``auto`` picks hermes for a chat template that writes hermes'
    ``<tool_call>`` tags (Qwen2.5, Hermes, many others), else none; ``none`` turns tools off."""
    if asked == "auto":
        return "hermes" if template and "<tool_call>" in template else None
    if asked in (None, "none"):
        return None
    from vllm.tool_parsers import ToolParserManager

    try:
        ToolParserManager.get_tool_parser(asked)
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {asked!r}") from None
    return asked


def build(
    backend: Backend,
    model_name: str,
    *,
    tool_call_parser: str | None = "auto",
    enable_auto_tool_choice: bool | None = None,
    chat_template: str | None = None,
) -> Serving:
    """vLLM's chat, completions, Responses and tokenization serving on :class:`SteeringEngine`.
    ``enable_auto_tool_choice`` None: on whenever a parser is in use (vLLM needs both flags)."""
    check_version()
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer

    engine = SteeringEngine(backend)
    llm = backend.llm
    template = load_chat_template(chat_template)
    own = template or getattr(backend.tokenizer, "chat_template", None)
    parser = tool_parser_for(own if isinstance(own, str) else None, tool_call_parser)
    auto_tools = bool(parser) if enable_auto_tool_choice is None else enable_auto_tool_choice
    models = OpenAIServingModels(
        engine_client=engine,
        base_model_paths=[BaseModelPath(name=model_name, model_path=backend.cfg.model)],
    )
    common: dict[str, Any] = dict(
        chat_template=template,
        chat_template_content_format="auto",
        enable_auto_tools=auto_tools,
        tool_parser=parser,
    )
    renderer = OnlineRenderer(
        model_config=llm.model_config, renderer=llm.renderer, request_logger=None, **common
    )
    served: dict[str, Any] = dict(request_logger=None, enable_prompt_tokens_details=True)
    chat = OpenAIServingChat(
        engine, models, "assistant", online_renderer=renderer, **served, **common
    )
    completion = OpenAIServingCompletion(engine, models, online_renderer=renderer, **served)
    tokenization = ServingTokenization(
        models, renderer, chat_template=template, chat_template_content_format="auto"
    )
    responses = OpenAIServingResponses(engine, models, renderer, **served, **common)
    messages = steered_messages()(
        engine, models, "assistant", online_renderer=renderer, **served, **common
    )
    return Serving(chat, completion, tokenization, parser, responses, backend, messages)


def steered_messages() -> type:
    """vLLM's Anthropic Messages serving, whose chat request (it converts each Messages request
    into one) is named and seeded as the pipeline set them on the Messages request: the
    answer's id is then the pipeline's, as for chat."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    class SteeredMessages(AnthropicServingMessages):
        @classmethod
        def to_chat_completion_request(cls, request: Any, **kw: Any) -> Any:
            chat = super().to_chat_completion_request(request, **kw)
            if getattr(request, "request_id", None):
                chat.request_id = request.request_id
            chat.seed = getattr(request, "seed", None)
            return chat

    return SteeredMessages
