"""A generation request's bookkeeping, from submission until it is settled, collected or
streamed alike (the pipeline's ``Flight``): the queue gauge, the client going away, engine errors
as API errors, closing engine requests, token and request metrics; and :func:`until_disconnect`,
which runs the engine work until it ends, the client hangs up or the drain drops it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from steerserve.server.ab.experiment import Enrolled
from steerserve.server.drain import Drain
from steerserve.server.errors import ApiError
from steerserve.server.generate.capacity import Ticket
from steerserve.server.generate.enrolment import settle_experiment
from steerserve.server.vllm_errors import engine_error

if TYPE_CHECKING:
    from steerserve.server.generate.context import Context

logger = logging.getLogger("steerserve.server")
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Call:
    """Per-request bookkeeping, also read by the app's error handlers (metrics need the endpoint
    and the arm; ``arm`` stays "none" for a request refused before steering was decided)."""

    endpoint: str
    arm: str = "none"
    t0: float = field(default_factory=time.perf_counter)
    done: bool = False
    experiment: Enrolled | None = None  # under the server's A/B experiment
    tokens: tuple[int, int] = (0, 0)  # prompt, completion (all arms), once settled
    preset: str | None = None  # the steering preset the request's model id names
    seats: Ticket | None = None  # engine seats held until the request is settled (capacity.py)
    request_id: str | None = None  # the client's X-Request-Id (the answer's id carries it)


def finish(state: Context, call: Call, status: int, timed: bool = True) -> None:
    """Count a finished request and log it (one structured line per request, once)."""
    if call.done:
        return
    call.done = True
    state.seats.release(call.seats)
    seconds = time.perf_counter() - call.t0
    state.metrics.observe(call.endpoint, call.arm, status, seconds if timed else None)
    if call.preset is not None:
        state.metrics.preset_requests.labels(call.preset, str(status)).inc()
    if call.experiment is not None:
        settle_experiment(state, call.experiment, status, seconds if timed else None, call.tokens)
    logger.info(
        "request endpoint=%s arm=%s%s%s status=%d ms=%.1f",
        call.endpoint,
        call.arm,
        "" if call.preset is None else f" preset={call.preset}",
        "" if call.request_id is None else f" id={call.request_id}",
        status,
        seconds * 1e3,
    )


def refused(request: Request, status: int) -> None:
    """For the app's error handlers: count a request refused with ``status`` (not timed)."""
    call: Call | None = getattr(request.state, "call", None)
    if call is not None:
        finish(request.app.state.steer, call, status, timed=False)


class Flight:
    """A submitted request until it is settled, collected or streamed alike: the queue gauge; the
    client going away (499, the engine requests aborted); an engine error as an API error; every
    engine request closed; tokens counted per arm; the request counted once."""

    def __init__(
        self, state: Context, call: Call, request: Request, gens: Sequence[AsyncGenerator]
    ) -> None:
        self.state, self.call, self.request, self.gens = state, call, request, gens
        self.status = 200
        self.tokens: dict[str, list[int]] = {}
        #: A stream's last event (``[DONE]``) went out: the client has its whole answer, and
        #: hanging up after it (as soon as it reads ``[DONE]``) is no 499 and loses no decision.
        self.delivered = False

    def count(self, arm: str, prompt: int, completion: int) -> None:
        t = self.tokens.setdefault(arm, [0, 0])
        t[0] += prompt
        t[1] += completion

    def failed(self, e: BaseException) -> ApiError:
        err = engine_error(e, self.state.drain if self.state.stopping else None)
        self.status = err.status
        return err

    async def __aenter__(self) -> Flight:
        self.state.metrics.queue_depth.inc()
        return self

    async def __aexit__(
        self, typ: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool:
        gone = isinstance(e, (ClientGone, asyncio.CancelledError, GeneratorExit))
        err = None if e is None or gone else self.failed(e)
        try:
            if e is None and not self.delivered and await client_gone(self.request):
                gone = True  # the answer was ready, but nobody is there to read it
        except asyncio.CancelledError:  # cancelled for the hang-up while looking for it
            gone = True
            raise
        finally:
            self._settle(499 if gone else self.status)
            # Closing aborts unfinished engine requests; a cancellation of this task (Starlette
            # cancels a stream's task group again at every await) must not stop it half-way.
            await asyncio.shield(asyncio.ensure_future(_close(self.gens)))
        if err is not None:
            raise err from None
        return isinstance(e, ClientGone)  # collected: answered 499 by the caller

    def _settle(self, status: int) -> None:
        self.status = status
        self.state.metrics.queue_depth.dec()
        for arm, (prompt, completion) in self.tokens.items():
            self.state.metrics.count_tokens(arm, prompt, completion)
        self.call.tokens = (
            sum(t[0] for t in self.tokens.values()),
            sum(t[1] for t in self.tokens.values()),
        )
        finish(self.state, self.call, status)


async def _close(gens: Sequence[AsyncGenerator]) -> None:
    for g in gens:
        await g.aclose()


async def client_gone(request: Request) -> bool:
    """Whether the client has hung up. A hang-up that arrived while the event loop was busy is
    still queued as I/O: a few loop turns let the server see it before it is asked."""
    for _ in range(3):
        await asyncio.sleep(0)
    return await request.is_disconnected()


async def until_disconnect(request: Request, work: Awaitable[T], drain: Drain) -> T:
    """Run ``work``; cancel it (aborting generation) and raise :class:`ClientGone` if the client
    disconnects first, or the drain's :class:`Dropped` at its deadline. Cancelled itself, it
    cancels ``work`` before going (else ``work`` reads engine streams that are being closed).
    Once a stream has started, Starlette cancels it on a hang-up."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    dropper = asyncio.ensure_future(drain.wait())
    try:
        await asyncio.wait({task, watcher, dropper}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _cancel(task)
        raise
    finally:
        watcher.cancel()
        dropper.cancel()
    if task.done():
        return task.result()
    await _cancel(task)
    if drain.dropping:
        raise drain.error()
    raise ClientGone


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has stopped (whatever it raises: its request is gone)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
