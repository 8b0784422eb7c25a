"""The server's backend: vLLM ``AsyncLLM`` with the steering plugin, built off the event loop.

Reuses the engine package's front-end pieces (``engine_kwargs``, ``Admission``, ``make_prompt``,
``with_steering``, ``vector_payload``, ``check_workers``) so the server and the offline API can
never disagree about what a steering entry means.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import math
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from steerserve.engine import degenerate, plugin
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
from steerserve.server.drain import GRACE
from steerserve.server.engine_exit import await_own_stop, engine_processes
from steerserve.server.errors import ApiError
from steerserve.server.vllm_errors import EngineAborted

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Backend:
    """One AsyncLLM and the admission state (registered vectors) that goes with it."""

    def __init__(self, cfg: EngineConfig, drain_seconds: int = 0) -> None:
        self.cfg = cfg
        self.drain_seconds = drain_seconds
        self.shape = ModelShape.read(cfg.model)
        self.admission = Admission(cfg, self.shape)
        self.llm: Any = None
        self.tokenizer: Any = None
        self.max_token_chars = 0  # of the longest token: a text this long x N is >= N tokens
        self.logprob_check = False  # set at start: whether the check reads logprobs (V2 runner)
        # Tokenization runs here, off the event loop; one thread, as a tokenizer is not safe to
        # call from several at once.
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="steerserve-tokenize")
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

        plugin.activate()  # the seams, in this process and the engine's
        kw = engine_kwargs(self.cfg, self.shape)
        # EngineCore drains (instead of aborting) on a SIGINT/SIGTERM sent to the process group,
        # a little longer than the front end, which answers what it drops at its deadline.
        kw.setdefault("shutdown_timeout", self.drain_seconds + GRACE)
        return [AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))]

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
        self.max_token_chars = await asyncio.to_thread(longest_token, self.tokenizer)
        # the worker flags degenerate steered rows through the V1 runner's seam; Model Runner
        # V2 (a GPU's default) has none, so there the check reads a logprob per token (the cost
        # issue 60 removed elsewhere)
        self.logprob_check = bool(llm.vllm_config.use_v2_model_runner)
        self.llm = llm

    async def register(
        self, name: str, tensor: torch.Tensor, source: str | None = None, sha256: str | None = None
    ) -> RegisteredVector:
        """Register a vector on every worker, then admit it (a name is usable only once every
        worker holds it). ``sha256``: the digest ``load_artifact`` verified, not computed again."""
        if not self.cfg.steering:
            raise ValueError("this engine was built without the steering plugin")
        async with self._register_lock:
            if name in self.registry:
                return self.registry.add(name, tensor, source, sha256)  # same: no-op; else refused
            rv = VectorRegistry(self.shape.hidden_size).add(name, tensor, source, sha256)
            await self.llm.collective_rpc("steer_register", args=vector_payload(rv))
            return self.registry.admit(rv)  # checked and hashed above: not again

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the tokenizer's thread (templates, tokenization, decoding)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, *args)

    def check_size(self, chars: int, tokens: int, field: str) -> None:
        """Refuse a prompt that cannot fit before tokenizing it: ``chars`` characters of text
        are at least chars / (longest token x MERGE) tokens, ``tokens`` are ids given as such."""
        least = max(tokens, chars // (self.max_token_chars * MERGE))
        if least >= self.max_model_len:
            raise ApiError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt is at least {least} tokens long.",
                param=field,
                code="context_length_exceeded",
            )

    @property
    def max_model_len(self) -> int:
        return int(self.llm.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.llm.model_config.get_vocab_size())

    def prepare(self, entries: Sequence[Any] | None, field: str = "steering") -> Prepared:
        """Admit entries (``SteeringError`` naming the field under ``field``)."""
        return self.admission.prepare(entries, field=field)

    def generate(
        self, prompt: Any, params: Any, prepared: Prepared, request_id: str, **kw: Any
    ) -> AsyncGenerator[Any, None]:
        """Stream ``RequestOutput``s of ``prompt`` (token ids or vLLM's engine input; ``kw``:
        ``AsyncLLM.generate``'s); closing or cancelling the generator aborts the request. A
        steered request fails with a 500 when a distribution is degenerate (:func:`_checked`)."""
        asked = params.logprobs
        floor = None
        if prepared.steered and self.logprob_check:
            floor = -math.log(self.vocab_size) + UNIFORM_MARGIN
            if asked is None:
                params = copy.copy(params)
                params.logprobs = 1  # the most likely token's: what the check reads
        gen = self.llm.generate(
            make_prompt(prompt), with_steering(params, prepared), request_id, **kw
        )
        gen = _answered(gen)
        return _checked(gen, floor, keep=asked is not None) if prepared.steered else gen

    def in_flight(self) -> int:
        return 0 if self.llm is None else int(self.llm.get_num_unfinished_requests())

    async def shutdown(self, signalled: bool = False) -> None:
        """Stop the engine (and its processes); waits for a build still in progress.
        ``signalled``: the process was stopped by a signal, which may have reached EngineCore
        too; an EngineCore stopping on it is waited for, not signalled again (``engine_exit``)."""
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
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        if llm is not None:
            handler = getattr(llm, "output_handler", None)
            if handler is not None:  # stop reading outputs first: no "engine dead" noise
                handler.cancel()
            if signalled and (procs := engine_processes(llm)):
                if left := await asyncio.to_thread(await_own_stop, procs):
                    logger.info("%s not stopping by itself: vLLM stops it", ", ".join(left))
            await asyncio.to_thread(llm.shutdown)


async def _answered(gen: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """``gen``'s outputs, raising :class:`EngineAborted` at one the engine aborted (the server's
    own aborts close the generator instead, so they never show here)."""
    try:
        async for out in gen:
            if any(o.finish_reason == "abort" for o in out.outputs):
                raise EngineAborted(out.request_id)
            yield out
    finally:
        await gen.aclose()


#: How far above -ln(vocabulary) (nats) a token's logprob must be where the check reads logprobs
#: (Model Runner V2): at it, every token is equally likely, which no trained model predicts.
UNIFORM_MARGIN = 1e-3


def _degenerate(out: Any, floor: float | None) -> bool:
    """The worker flagged the request (``engine/degenerate.py``), or, where the check reads
    logprobs (``floor``), a token's came out at the uniform floor or NaN."""
    if degenerate.flagged(out.request_id):
        return True
    if floor is None:
        return False
    return any(
        not max(lp.logprob for lp in d.values()) > floor
        for o in out.outputs
        for d in o.logprobs or ()
    )


async def _checked(
    gen: AsyncGenerator[Any, None], floor: float | None = None, keep: bool = True
) -> AsyncGenerator[Any, None]:
    """``gen``'s outputs, failing with a 500 naming ``steering`` at a degenerate next-token
    distribution (uniform or NaN): a steered request must never be a 200 with garbage or empty
    text. The server's fault, not the client's: every vector it serves was vetted at load to
    fit the model at any admitted scale. ``keep``: the client asked for the logprobs."""
    rid = None
    try:
        async for out in gen:
            rid = out.request_id
            if _degenerate(out, floor):
                logger.error("request %s: steering made a degenerate distribution", rid)
                raise ApiError(
                    "steering: the steered model's next-token distribution came out "
                    "degenerate (uniform or NaN): a steering vector overwhelms the model",
                    status=500,
                    type="server_error",
                    param="steering",
                    code="steering_degenerate",
                )
            if not keep:
                out = copy.copy(out)
                out.outputs = [dataclasses.replace(o, logprobs=None) for o in out.outputs]
            yield out
    finally:
        if rid is not None:
            degenerate.forget(rid)
        await gen.aclose()


#: How many characters of input a tokenizer's normalizer may fold into one (Hangul jamo into a
#: syllable: 3), on top of the longest token.
MERGE = 4


def longest_token(tokenizer: Any) -> int:
    """Characters of the longest token, added and special ones included (they match literally in
    text). Vocabulary strings are never shorter than the text they stand for: byte-level pieces
    are one character per byte, SentencePiece's are the text with ``▁`` for a space (or
    ``<0xNN>`` for one byte)."""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))
