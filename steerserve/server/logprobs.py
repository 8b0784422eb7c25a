"""Per-token log probabilities in OpenAI's two shapes: chat ``logprobs.content`` and the legacy
completions ``logprobs``, from vLLM's per-token ``{token_id: Logprob}``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from steerserve.server import answers as A
from steerserve.server.tokens import Tokens


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
) -> A.ChatLogprobs | None:
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
        A.TokenLogprob(**entry(tid, chosen), top_logprobs=[A.TopLogprob(**entry(*t)) for t in best])
        for tid, chosen, best in _tokens(token_ids, logprobs, top)
    ]
    return A.ChatLogprobs(content=content)


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Any]] | None,
    top: int,
    tokens: Tokens,
    offset: int = 0,
) -> A.CompletionLogprobs | None:
    """Legacy completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset).
    ``top_logprobs`` is keyed by token text, and distinct tokens have distinct texts (see
    :mod:`tokens`); only tokens with identical bytes share a key, which keeps the likelier."""
    if logprobs is None:
        return None
    out = A.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
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
