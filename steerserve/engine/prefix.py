"""The prefix-cache seam: a steered request shares the cached blocks before its first steered token.

vLLM chains its block hashes and mixes a request's ``cache_salt`` into block 0's hash only, so a
salted (steered) request could share no block with anything else. But steering whose
``positions`` start at the last prompt token or later leaves every earlier token's KV exactly
unsteered (attention is causal). So a steered salt says where its steering starts
(:func:`steerserve.engine.spec.cache_salt`: ``:-1`` the last prompt token, ``:0`` the first
generated one, nothing for token 0; not ``@``, which vLLM's request models refuse in a salt),
and this seam moves the salt into the hash of the block that holds that token: blocks wholly
before it hash exactly as unsteered blocks do, and the chain keys that block and every later
one by the steering (entries and vector digests). Nothing steered is ever cached under an
unsteered hash, so later requests that extend a steered one's prompt or output share only its
unsteered blocks.

The seam is one function, patched where vLLM's scheduler process calls it; :func:`install`
first probes the installed vLLM's function for the behaviour this relies on and refuses loudly
when it differs.
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace
from typing import Any

from steerserve.engine.spec import SALT_PREFIX

logger = logging.getLogger("steerserve.engine")


def salted_from(salt: str | None, num_prompt_tokens: int) -> int:
    """The index of the first token whose block a salt keys: 0 (the whole request, as vLLM does)
    unless the salt is steerserve's and names a later start."""
    if not salt or not salt.startswith(SALT_PREFIX) or ":" not in salt:
        return 0
    return max(num_prompt_tokens + int(salt.rsplit(":", 1)[1]), 0)


def _probe(fn: Any) -> None:
    """Refuse a vLLM whose extra hash keys are not 0.32's: the salt alone, in block 0 only."""
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
        later, _ = fn(req, 16, 32, 0)
    except Exception as e:  # a changed signature or request shape
        raise RuntimeError(f"steerserve: vLLM's block hashing changed ({e!r})") from e
    if first != (("cache_salt", "probe"),) or later is not None:
        raise RuntimeError(
            "steerserve: vLLM's block hashing differs from the one the prefix-sharing seam "
            f"knows (salt keys {first!r} / {later!r}); refusing to run with it"
        )


def install() -> None:
    """Patch ``generate_block_hash_extra_keys`` where vLLM's block hasher and block pool look it
    up (idempotent; every vLLM process loads the plugin, the scheduler's is the one that hashes)."""
    import vllm.v1.core.block_pool as block_pool
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    orig = kv_cache_utils.generate_block_hash_extra_keys
    if getattr(orig, "_steerserve_seam", False):
        return
    _probe(orig)

    @functools.wraps(orig)
    def extra_keys(request: Any, start: int, end: int, start_mm_idx: int) -> Any:
        keys, next_mm = orig(request, start, end, start_mm_idx)
        salt = request.cache_salt
        first = salted_from(salt, request.num_prompt_tokens)
        if not first:
            return keys, next_mm
        key = ("cache_salt", salt)
        rest = tuple(k for k in keys or () if k != key)
        if start <= first < end:
            rest += (key,)
        return rest or None, next_mm

    extra_keys._steerserve_seam = True  # type: ignore[attr-defined]
    kv_cache_utils.generate_block_hash_extra_keys = extra_keys
    block_pool.generate_block_hash_extra_keys = extra_keys  # its KV events name the same keys
    logger.debug("steerserve: prefix-cache seam installed")
