"""The prefix-cache seam: the one home of a steered request's cache key, built and parsed only here."""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from steerserve.engine.spec import DEFAULT_OP, EXTRA_ARGS_KEY, SteeringEntry, first_steered

logger = logging.getLogger("steerserve.engine")

#: Key of a steered request's prefix key in ``SamplingParams.extra_args``.
KEY = "steerserve_prefix"

#: Where steering starts, by name (the form carries no number a parser must trust): token 0, the
#: last prompt token, the first generated token (``spec.first_steered``'s None, -1, 0).
_STARTS: dict[str, int | None] = {"all": None, "last": -1, "gen": 0}
_NAMES = {v: k for k, v in _STARTS.items()}
_FORM = re.compile(r"([0-9a-f]{32}):(all|last|gen)")


def key(entries: Sequence[SteeringEntry], digests: Mapping[str, str]) -> str:
    """A steered request's prefix key: ``<digest>:<start>``.

    ``digests`` maps vector names to a content hash, so a different vector under the same name
    never reuses cached KV; an op other than ``add`` is hashed by name, so it never shares KV
    with ``add``.
    """
    h = hashlib.sha256()
    for e in entries:
        op = "" if e.op == DEFAULT_OP else f"|{e.op}"
        h.update(
            f"{e.vector}|{digests.get(e.vector, '')}|{e.layer}|{e.scale!r}|{e.positions}{op};".encode()
        )
    return f"{h.hexdigest()[:32]}:{_NAMES[first_steered(entries)]}"


def parse(value: Any) -> tuple[str, int | None] | None:
    """``(digest, start)`` from :func:`key`'s form, or None for anything else (never raises)."""
    m = _FORM.fullmatch(value) if isinstance(value, str) else None
    return None if m is None else (m[1], _STARTS[m[2]])


def steering_key(request: Any) -> tuple[str, int] | None:
    """The digest and first steered token of a scheduler request, or None when it is unsteered.

    A request that carries steering but no well-formed key gets a key of its own at token 0: it
    shares nothing, and the scheduler loop never sees an exception from here.
    """
    try:
        extra = request.sampling_params.extra_args
        if not isinstance(extra, dict) or (KEY not in extra and EXTRA_ARGS_KEY not in extra):
            return None
        parsed = parse(extra.get(KEY))
        if parsed is None:
            return f"unshared:{request.request_id}", 0
        digest, start = parsed
        return digest, 0 if start is None else max(request.num_prompt_tokens + start, 0)
    except Exception:  # a request shape we do not know (pooling): vLLM's rule, nothing added
        return None


def _probe(fn: Any) -> None:
    """Refuse a vLLM whose extra-keys function is not 0.32's: ``(keys | None, next_mm_idx)`` from
    ``(request, start, end, start_mm_idx)``, with the client's salt in block 0."""
    req = SimpleNamespace(
        mm_features=[],
        lora_request=None,
        cache_salt="probe",
        prompt_embeds=None,
        _prompt_embeds_per_block_hashes={},
        num_prompt_tokens=64,
    )
    try:
        first, _ = fn(req, 0, 16, 0)
    except Exception as e:  # a changed signature or request shape
        raise RuntimeError(f"steerserve: vLLM's block hashing changed ({e!r})") from e
    if not isinstance(first, tuple) or ("cache_salt", "probe") not in first:
        raise RuntimeError(
            "steerserve: vLLM's block hashing differs from the one the prefix-sharing seam "
            f"knows (block 0 keys {first!r}); refusing to run with it"
        )


def install() -> None:
    """Patch ``generate_block_hash_extra_keys`` where vLLM's block hasher and block pool look it
    up (idempotent; the scheduler, in the engine core, is the process that hashes)."""
    import vllm.v1.core.block_pool as block_pool
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    orig = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(orig, "_steerserve_seam", False):
        return
    _probe(orig)

    @functools.wraps(orig)
    def extra_keys(request: Any, start: int, end: int, start_mm_idx: int) -> Any:
        keys, next_mm = orig(request, start, end, start_mm_idx)
        steer = steering_key(request)
        if steer is not None and start <= steer[1] < end:
            keys = (*(keys or ()), ("steerserve", steer[0]))
        return keys, next_mm

    extra_keys._steerserve_seam = True  # type: ignore[attr-defined]
    kv_cache_utils.generate_block_hash_extra_keys = extra_keys
    block_pool.generate_block_hash_extra_keys = extra_keys  # its KV events name the same keys
    logger.debug("steerserve: prefix-cache seam installed")
