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


def _register() -> None:
    if hasattr(torch.ops.steerserve, "steer_add"):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op(
        "steer_add", _steer_add, mutates_args=[], fake_impl=_steer_add_fake, target_lib=_LIB
    )


_register()


def steer_add(hidden: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    return torch.ops.steerserve.steer_add(hidden, index, pool)
