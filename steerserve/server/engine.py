"""The server's engine: vLLM ``AsyncLLM`` with the steering plugin, built off the event loop.

Reuses the engine package's front-end pieces (``engine_kwargs``, ``Admission``, ``make_prompt``,
``with_steering``, ``vector_payload``, ``check_workers``) so the server and the offline API can
never disagree about what a steering entry means.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from steerserve.engine.api import (
    Admission,
    EngineConfig,
    ModelShape,
    Prepared,
    check_workers,
    engine_kwargs,
    make_prompt,
    vector_payload,
    with_steering,
)
from steerserve.engine.registry import RegisteredVector, VectorRegistry
from steerserve.server.protocol import ApiError

logger = logging.getLogger(__name__)


class ServingEngine:
    """One AsyncLLM and the admission state (registered vectors) that goes with it."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.shape = ModelShape.read(cfg.model)
        self.admission = Admission(cfg, self.shape)
        self.llm: Any = None
        self.tokenizer: Any = None
        self._build: asyncio.Future[list[Any]] | None = None
        self._closing = False
        self._register_lock = asyncio.Lock()

    @property
    def registry(self) -> VectorRegistry:
        return self.admission.registry

    @property
    def ready(self) -> bool:
        return self.llm is not None and not self.llm.errored

    def _make(self) -> list[Any]:
        """The engine in a box: thread-pool futures and frames keep their result alive, and an
        AsyncLLM collected at interpreter exit fails in ``__del__``; shutdown empties the box."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return [AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(self.cfg, self.shape)))]

    async def start(self) -> None:
        """Build the engine in a worker thread (seconds to minutes) so /health answers meanwhile."""
        self._build = asyncio.get_running_loop().run_in_executor(None, self._make)
        box = await asyncio.shield(self._build)
        llm = box[0]
        if self._closing:
            llm.shutdown()
            raise RuntimeError("shut down while the engine was loading")
        if self.cfg.steering:
            check_workers(await llm.collective_rpc("steer_info"), self.cfg)
        self.tokenizer = llm.get_tokenizer()
        self.llm = llm

    async def register(
        self, name: str, tensor: torch.Tensor, source: str | None = None
    ) -> RegisteredVector:
        """Register a vector on every worker, then admit it (a name is usable only once every
        worker holds it)."""
        if not self.cfg.steering:
            raise ValueError("this engine was built without the steering plugin")
        async with self._register_lock:
            if name in self.registry:
                return self.registry.add(name, tensor, source)  # same data: no-op; else refused
            rv = VectorRegistry(self.shape.hidden_size).add(name, tensor, source)
            await self.llm.collective_rpc("steer_register", args=vector_payload(rv))
            return self.registry.add(name, rv.tensor, source)

    # --- prompts ---------------------------------------------------------------------------------

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat with the model's template; base models without one get a plain
        transcript (a lone user message is sent as is, so few-shot prompts work through chat)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = enc["input_ids"] if not isinstance(enc, list) else enc
            return list(ids)
        turns = [m for m in messages if m["role"] != "system"]
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        if len(turns) == 1 and turns[0]["role"] == "user":
            text = turns[0]["content"]
        else:
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in turns)
            text += "Assistant:"
        return self.encode(f"{system}\n\n{text}" if system else text)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def max_model_len(self) -> int:
        return int(self.llm.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.llm.model_config.get_vocab_size())

    def sampling_params(self, req: Any, prompt_len: int, **kw: Any) -> Any:
        """vLLM ``SamplingParams`` for a chat/completions request, refusing a prompt plus
        completion longer than the context (400, OpenAI's ``context_length_exceeded``)."""
        from vllm import SamplingParams

        max_len = self.max_model_len
        room = max_len - prompt_len
        budget = req.token_budget()
        if room <= 0 or (budget is not None and budget > room):
            asked = prompt_len + (budget or 1)
            raise ApiError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{asked} tokens ({prompt_len} in the prompt, {budget or 1} for the completion).",
                param="max_tokens" if room > 0 else "messages",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                max_tokens=budget or room,
                stop=req.stop_list(),
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                ignore_eos=req.ignore_eos,
                **kw,
            )
        except Exception as e:  # vLLM's own checks (ValueError / VLLMValidationError)
            raise ApiError(str(e)) from None

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(f"{param}: the prompt is empty", param=param)
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param
            )

    def prepare(self, entries: Sequence[Any] | None) -> Prepared:
        return self.admission.prepare(entries)

    def generate(
        self, prompt_ids: Sequence[int], params: Any, prepared: Prepared, request_id: str
    ) -> AsyncGenerator[Any, None]:
        """Stream ``RequestOutput``s; closing/cancelling the generator aborts the request."""
        return self.llm.generate(
            make_prompt(prompt_ids, prepared), with_steering(params, prepared), request_id
        )

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    def in_flight(self) -> int:
        return 0 if self.llm is None else int(self.llm.get_num_unfinished_requests())

    async def shutdown(self) -> None:
        """Stop the engine (and its processes); waits for a build still in progress."""
        self._closing = True
        llm = self.llm
        if llm is None and self._build is not None:
            try:
                llm = (await self._build)[0]
            except Exception:  # the build failed: nothing to shut down
                llm = None
        self.llm = None
        if self._build is not None and self._build.done() and not self._build.exception():
            self._build.result().clear()
        self._build = None
        if llm is not None:
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # stop reading outputs first: no "engine dead" noise
                handler.cancel()
            await asyncio.to_thread(llm.shutdown)


# --- consuming engine streams --------------------------------------------------------------------


def engine_error(e: BaseException) -> ApiError:
    """An engine exception as an API error: the caller's fault (4xx) or ours (5xx)."""
    if isinstance(e, BaseExceptionGroup):
        return engine_error(e.exceptions[0])
    if isinstance(e, ApiError):
        return e
    from vllm.exceptions import GracefulHTTPError, VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(e, GracefulHTTPError):
        return ApiError(e.message, status=int(e.http_status), type="service_unavailable")
    if isinstance(e, (VLLMClientError, ValueError)):
        return ApiError(str(e))
    if isinstance(e, EngineDeadError):
        return ApiError("the engine died", status=503, type="service_unavailable")
    logger.error("generation failed", exc_info=e)
    return ApiError("generation failed", status=500, type="server_error")


async def collect(gen: AsyncGenerator[Any, None]) -> Any:
    """The last output of a FINAL_ONLY stream."""
    last = None
    async for out in gen:
        last = out
    return last


async def merge(gens: list[AsyncGenerator[Any, None]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several engine streams; closing the merge cancels (aborts) them all."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncGenerator[Any, None]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prime(gen: AsyncGenerator[Any, None]) -> Any:
    """Submit the request and wait for its first output, so engine-side refusals are still a
    proper 4xx (the stream's 200 is not sent yet)."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None
    except Exception as e:
        await gen.aclose()
        raise engine_error(e) from None


async def chained(first: Any, gen: AsyncGenerator[Any, None]) -> AsyncIterator[Any]:
    """``first`` (from :func:`prime`) followed by the rest of ``gen``."""
    if first is not None:
        yield first
        async for out in gen:
            yield out


def load_artifacts(root: str | Path | None, model_dir: str | Path) -> list[Any]:
    """The verified artifacts under ``root`` bound to this model (others skipped, logged)."""
    if root is None or not Path(root).is_dir():
        return []
    from steerserve.artifacts import artifacts_for_model

    return artifacts_for_model(root, model_dir)
