"""The steering ops: ``torch.ops.steerserve.steer_add`` and ``torch.ops.steerserve.steer_edit``."""

from __future__ import annotations

import torch
from torch.library import Library

_LIB = Library("steerserve", "FRAGMENT")  # keep alive: the ops live as long as this object


def _steer_add(hidden: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """``hidden[t] + pool[index[t]]`` for the first ``hidden.shape[0]`` tokens.

    ``index`` is the layer's full per-token row buffer; row 0 of ``pool`` is zeros, so unsteered
    tokens come out bit-identical (``x + 0 == x``). The sum is formed in the hidden dtype after the
    float32 delta is cast, as a transformers hook adding ``scale * v`` in that dtype would.
    """
    rows = index[: hidden.shape[0]]
    return hidden + pool.index_select(0, rows).to(hidden.dtype)


def _steer_add_op(
    hidden: torch.Tensor,
    index: torch.Tensor,
    pool: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's body: ``_steer_add``, or a copy where ``gate`` says no request steers the layer
    (a fresh tensor: the schema promises no alias, and inductor may reuse ``hidden``'s buffer)."""
    if gate is not None and not gate.item():
        return hidden.clone()
    return _steer_add(hidden, index, pool)


def _steer_add_fake(
    hidden: torch.Tensor,
    index: torch.Tensor,
    pool: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(hidden)


def _steer_edit(
    hidden: torch.Tensor, residual: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The non-additive ops on ``h = hidden + residual``: per op slot ``k``,
    ``h = a·h − b·(h·u)·u + c`` with ``rows[index[k, t]] = (u, c, a, b)``."""
    n, size = hidden.shape[0], hidden.shape[-1]
    idx = index[:, :n]
    h = torch.add(hidden.float(), residual)  # float32, residual promoted as it is read
    for k in range(idx.shape[0]):  # K is static: a loop the graph unrolls
        r = rows.index_select(0, idx[k])
        u, c, a, b = r[:, :size], r[:, size : 2 * size], r[:, -2:-1], r[:, -1:]
        h = a * h - b * (h * u).sum(-1, keepdim=True) * u + c
    edited = (idx[0] != 0).unsqueeze(-1)  # slot 0 is set wherever any slot is
    return torch.where(edited, h.to(hidden.dtype), hidden), torch.where(edited, 0.0, residual)


def _steer_edit_op(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's body: ``_steer_edit`` over the first ``gate`` slots (the most any running request
    fills on the layer; the rest are row 0, the identity), copies of both halves where 0."""
    if gate is None:
        return _steer_edit(hidden, residual, index, rows)
    depth = int(gate.item())
    if not depth:
        return hidden.clone(), residual.clone()
    return _steer_edit(hidden, residual, index[:depth], rows)


def _steer_edit_fake(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(hidden), torch.empty_like(residual)


# The registered bodies look ``_steer_add``/``_steer_edit`` up at call time (tests count calls).
_OPS = {
    "steer_add": (_steer_add_op, _steer_add_fake),
    "steer_edit": (_steer_edit_op, _steer_edit_fake),
}


def _register() -> str:
    """Register the ops once and say with what: vLLM's low-overhead registration where vLLM is
    installed (the engine), plain ``torch.library`` where it is not (a bare PyTorch machine)."""
    if hasattr(torch.ops.steerserve, "steer_add"):
        return "existing"
    try:
        from vllm.utils.torch_utils import direct_register_custom_op
    except ModuleNotFoundError as e:
        if e.name != "vllm":  # vLLM is installed but broken: fail loudly, never fall back
            raise
        _register_with_torch()
        return "torch.library"
    for name, (fn, fake) in _OPS.items():
        direct_register_custom_op(name, fn, mutates_args=[], fake_impl=fake, target_lib=_LIB)
    return "vllm"


def _register_with_torch() -> None:
    """The schema, kernel and fake that vLLM's registration gives, for CPU and CUDA alike."""
    from torch.library import infer_schema, register_fake

    for name, (fn, fake) in _OPS.items():
        _LIB.define(name + infer_schema(fn, mutates_args=()))
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, key)
        register_fake(f"steerserve::{name}", fake, lib=_LIB)


#: Who registered the ops in this process: "vllm", "torch.library" or "existing".
REGISTERED_WITH = _register()


def steer_add(
    hidden: torch.Tensor,
    index: torch.Tensor,
    pool: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.ops.steerserve.steer_add(hidden, index, pool, gate)


def steer_edit(
    hidden: torch.Tensor,
    residual: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.steerserve.steer_edit(hidden, residual, index, rows, gate)
