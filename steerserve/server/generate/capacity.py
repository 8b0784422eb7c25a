"""What one request may cost everyone else: its prompt work (:class:`Budget`) and its share of the
engine's sequence seats (:class:`Seats`)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from steerserve.server.errors import ApiError

#: Logits (scored prompt tokens x vocabulary) one request may compute: 2**28, a GiB of float32,
#: so a 262,144-token vocabulary scores 1,024 prompt tokens per request and a 151,936 one 1,766.
SCORED_LOGITS = 1 << 28
#: Prompt tokens one request may prefill, in contexts: eight full ones.
PROMPT_CONTEXTS = 8


def budget(max_model_len: int, vocab_size: int) -> tuple[int, int]:
    """(prompt tokens, scored prompt tokens) one request may send: the one rule for both caps."""
    return PROMPT_CONTEXTS * max_model_len, max(1, SCORED_LOGITS // max(1, vocab_size))


@dataclass
class Budget:
    """A request's prompt work so far, against its caps (shared by its arms and engine calls)."""

    prompt_cap: int
    scored_cap: int
    prompt: int = 0
    scored: int = 0

    def charge(self, prompt_tokens: int, scored: bool) -> None:
        """Count one engine call's prompt; ApiError 400 (``request_too_large``) past a cap."""
        self.prompt += prompt_tokens
        self.scored += prompt_tokens if scored else 0
        if self.prompt > self.prompt_cap:
            raise ApiError(
                f"prompt: {self.prompt} prompt tokens in one request; this server prefills at most "
                f"{self.prompt_cap} per request: split the prompts over requests",
                param="prompt",
                code="request_too_large",
            )
        if self.scored > self.scored_cap:
            raise ApiError(
                f"logprobs: {self.scored} prompt tokens scored (echo with logprobs, or "
                f"prompt_logprobs) in one request; this server scores at most {self.scored_cap} "
                "per request: split the prompts over requests",
                param="logprobs",
                code="request_too_large",
            )


def reserved(total: int) -> int:
    """Seats kept for one-sequence requests: an eighth of the engine's, at least one (none on an
    engine of one seat)."""
    return 0 if total <= 1 else max(1, total // 8)


@dataclass
class Ticket:
    """A request's seats, held until :meth:`Seats.release` (once; a second call does nothing)."""

    client: str
    n: int
    released: bool = False


@dataclass
class _Waiter:
    ticket: Ticket
    ready: asyncio.Future[None]


@dataclass
class Seats:
    """Seat bookkeeping of one server (event-loop only: no locks needed)."""

    total: int
    per_client: int
    max_wait: float = 30.0
    max_waiting: int = 4
    in_use: int = 0
    by_client: dict[str, int] = field(default_factory=dict)
    _queue: deque[_Waiter] = field(default_factory=deque)

    @property
    def shared(self) -> int:
        """Seats requests of several sequences may hold together."""
        return max(1, self.total - reserved(self.total))

    def _fits(self, t: Ticket) -> bool:
        return self.in_use + t.n <= self.shared and self._within_share(t)

    def _within_share(self, t: Ticket) -> bool:
        return self.by_client.get(t.client, 0) + t.n <= self.per_client

    def _hold(self, t: Ticket) -> None:
        self.in_use += t.n
        self.by_client[t.client] = self.by_client.get(t.client, 0) + t.n

    async def take(self, client: str, n: int) -> Ticket | None:
        """Seats for a request of ``n`` sequences (None for one: never held), waiting for them in
        turn; ApiError 429 when they do not come in time or too many of the client's wait."""
        if n <= 1:
            return None
        t = Ticket(client, min(n, self.per_client, self.shared))  # the cap is checked earlier
        # In turn: a waiter short of shared seats goes first; one held by its own client's
        # share holds up nobody else.
        ahead = any(self._within_share(w.ticket) for w in self._queue)
        if not ahead and self._fits(t):
            self._hold(t)
            return t
        if sum(w.ticket.client == client for w in self._queue) >= self.max_waiting:
            raise _busy(f"{self.max_waiting} requests of this client wait for seats already")
        w = _Waiter(t, asyncio.get_running_loop().create_future())
        self._queue.append(w)
        start = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(w.ready), self.max_wait)
        except BaseException as e:  # timed out, or the client went away while waiting
            if w.ready.done():
                self.release(t)  # granted in the same turn the wait ended: give it back
            else:
                self._queue.remove(w)
            if isinstance(e, TimeoutError):
                raise _busy(
                    f"no engine seats for {t.n} sequences in {time.monotonic() - start:.0f} s"
                ) from None
            raise
        return t

    def release(self, t: Ticket | None) -> None:
        """Give a ticket's seats back and admit the waiters that now fit, in order: the first one
        short of shared seats holds up those behind it (no large request is starved by small
        ones passing it), one held by its client's share holds up nobody."""
        if t is None or t.released:
            return
        t.released = True
        self.in_use -= t.n
        left = self.by_client[t.client] - t.n
        if left:
            self.by_client[t.client] = left
        else:
            del self.by_client[t.client]
        for w in list(self._queue):
            if self._fits(w.ticket):
                self._queue.remove(w)
                self._hold(w.ticket)
                w.ready.set_result(None)
            elif self._within_share(w.ticket):
                break


def _busy(why: str) -> ApiError:
    return ApiError(
        f"the server is busy: {why}; retry later, or lower n or the number of prompts",
        status=429,
        type="rate_limit_error",
        code="engine_busy",
    )
