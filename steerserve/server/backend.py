"""The server's backend: vLLM ``AsyncLLM`` with the steering plugin, built off the event loop.

Reuses the engine package's front-end pieces (``engine_kwargs``, ``Admission``, ``make_prompt``,
``with_steering``, ``vector_payload``, ``check_workers``) so the server and the offline API can
never disagree about what a steering entry means.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Sequence
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


class Backend:
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

    def prepare(self, entries: Sequence[Any] | None, field: str = "steering") -> Prepared:
        """Admit entries (``SteeringError`` naming the field under ``field``)."""
        return self.admission.prepare(entries, field=field)

    def generate(
        self, prompt_ids: Sequence[int], params: Any, prepared: Prepared, request_id: str
    ) -> AsyncGenerator[Any, None]:
        """Stream ``RequestOutput``s; closing/cancelling the generator aborts the request."""
        return self.llm.generate(
            make_prompt(prompt_ids, prepared), with_steering(params, prepared), request_id
        )

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


# --- errors ------------------------------------------------------------------------------------


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
