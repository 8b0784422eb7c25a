"""The degeneracy check of steered requests, computed where it costs nothing: the worker."""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Requests (vLLM's external ids) whose distribution a worker found degenerate, in this front end;
#: the reader discards its own id when its request ends (``forget``).
_FLAGGED: set[str] = set()


def flag_rows(hidden: torch.Tensor) -> torch.Tensor:
    """Per row of final hidden states (the input of ``compute_logits``), whether its logits are
    degenerate: a zero or non-finite state gives all-equal (uniform) or NaN logits."""
    norm = torch.linalg.vector_norm(hidden.float(), dim=-1)
    return ~(torch.isfinite(norm) & (norm > 0))


def merge(output: Any, req_ids: list[str]) -> None:
    """Add ``req_ids`` to a ``ModelRunnerOutput``'s (or an async one's) ``num_nans_in_logits``."""
    out = getattr(output, "_model_runner_output", output)
    if not hasattr(out, "num_nans_in_logits"):
        return  # an output kind without the field (connector-only): nothing sampled
    out.num_nans_in_logits = {**(out.num_nans_in_logits or {}), **dict.fromkeys(req_ids, 1)}


def flagged(request_id: str) -> bool:
    return request_id in _FLAGGED


def forget(request_id: str) -> None:
    _FLAGGED.discard(request_id)


def install() -> None:
    """Note, in the front end, the requests whose engine output says their logits were corrupted
    (idempotent; inert in the engine processes, which build no ``RequestOutput``)."""
    from vllm.v1.engine.output_processor import OutputProcessor as P

    if getattr(P, "_steerserve_seam", False):
        return
    orig = P.process_outputs

    @functools.wraps(orig)
    def process_outputs(self: Any, engine_core_outputs: list, *args: Any, **kw: Any) -> Any:
        for eco in engine_core_outputs:
            if eco.num_nans_in_logits and (st := self.request_states.get(eco.request_id)):
                _FLAGGED.add(st.external_req_id)
        return orig(self, engine_core_outputs, *args, **kw)

    P.process_outputs = process_outputs
    P._steerserve_seam = True
