"""The steering op: ``torch.ops.steerserve.steer_add``.

A registered custom op (with a fake implementation) so torch.compile keeps it as an opaque call
instead of tracing a Python hook away, and CUDA graphs capture it: it reads only persistent buffers,
never syncs with the host and never branches on tensor values.
"""

from __future__ import annotations

import torch
from torch.library import Library

_LIB = Library("steerserve", "FRAGMENT")  # keep alive: the op lives as long as this object


def _steer_add(hidden: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """``hidden[t] + pool[index[t]]`` for the first ``hidden.shape[0]`` tokens.

    ``index`` is the layer's full per-token row buffer; row 0 of ``pool`` is zeros, so unsteered
    tokens come out bit-identical (``x + 0 == x``). The sum is formed in the hidden dtype after the
    float32 delta is cast, as a transformers hook adding ``scale * v`` in that dtype would.
    """
    rows = index[: hidden.shape[0]]
    return hidden + pool.index_select(0, rows).to(hidden.dtype)


def _steer_add_fake(hidden: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(hidden)


def _register() -> str:
    """Register the op once and say with what: vLLM's low-overhead registration where vLLM is
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
    direct_register_custom_op(
        "steer_add", _steer_add, mutates_args=[], fake_impl=_steer_add_fake, target_lib=_LIB
    )
    return "vllm"


def _register_with_torch() -> None:
    """The schema, kernel and fake that vLLM's registration gives, for CPU and CUDA alike."""
    from torch.library import infer_schema, register_fake

    _LIB.define("steer_add" + infer_schema(_steer_add, mutates_args=()))
    for key in ("CPU", "CUDA"):
        _LIB.impl("steer_add", _steer_add, key)
    register_fake("steerserve::steer_add", _steer_add_fake, lib=_LIB)


#: Who registered the op in this process: "vllm", "torch.library" or "existing".
REGISTERED_WITH = _register()


def steer_add(hidden: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    return torch.ops.steerserve.steer_add(hidden, index, pool)
