"""The steering operations: one row each, the one place an operation is defined."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

#: The operation an entry without ``op`` means (and every manifest written before ops existed).
DEFAULT_OP = "add"

#: ``(a, b, u, c)``: the engine's coefficients ``h' = a·h − b·(h·u)·u + c`` (u, c: float32 [H]).
Affine = tuple[float, float, "torch.Tensor", "torch.Tensor"]


@dataclass(frozen=True)
class Op:
    """One steering operation."""

    name: str
    #: what it does to the stream ``h`` (the request schema's description)
    formula: str
    #: the engine serves it (else: the research runner and the oracle only)
    engine: bool
    #: it is ``h + delta`` with a delta independent of ``h``: folds into the delta pool
    additive: bool
    #: llama.cpp's GGUF control vectors can carry it (they add a direction to every token)
    gguf: bool
    #: ``(low, high)`` the scale must lie in; None: the engine's ``±max_abs_scale``
    scale_range: tuple[float, float] | None
    #: v must be non-zero (it is normalised)
    needs_direction: bool
    #: ``reference(h, v, scale)``: the stream after the op, in ``h``'s dtype (``v`` float32,
    #: broadcastable to ``h``); the oracle and the research runner apply it on selected tokens
    reference: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    #: an additive op's delta for ``(v, scale)`` (float32, summed into the pool row with the
    #: layer's other additive entries); None for any other
    delta: Callable[[torch.Tensor, float], torch.Tensor] | None = None
    #: the non-additive kernel's coefficients for ``(v, scale)``; None for an additive op
    affine: Callable[[torch.Tensor, float], Affine] | None = None

    def scale_refusal(self, scale: float) -> str | None:
        """Why ``scale`` cannot go with this op, to follow the value (``"is outside [0, 1] for
        op 'interp'"``), or None; the engine's ``±max_abs_scale`` is checked by the caller."""
        lo_hi = self.scale_range
        if lo_hi is not None and not lo_hi[0] <= scale <= lo_hi[1]:
            return f"is outside [{lo_hi[0]:g}, {lo_hi[1]:g}] for op {self.name!r}"
        return None


def unit(v: torch.Tensor) -> torch.Tensor:
    """``v / |v|`` along the last axis (float32)."""
    v = v.float()
    return v / v.norm(dim=-1, keepdim=True)


def _add(h: torch.Tensor, v: torch.Tensor, s: float) -> torch.Tensor:
    # the delta is cast, then added in h's dtype, as the engine's pool row is
    return h + _add_delta(v, s).to(h.dtype)


def _add_delta(v: torch.Tensor, s: float) -> torch.Tensor:
    return s * v.float()


def _ablate(h: torch.Tensor, v: torch.Tensor, s: float) -> torch.Tensor:
    hf, u = h.float(), unit(v)
    return (hf - s * (hf * u).sum(-1, keepdim=True) * u).to(h.dtype)


def _replace(h: torch.Tensor, v: torch.Tensor, s: float) -> torch.Tensor:
    return (s * v.float()).to(h.dtype).expand_as(h).clone()


def _interp(h: torch.Tensor, v: torch.Tensor, s: float) -> torch.Tensor:
    return ((1 - s) * h.float() + s * v.float()).to(h.dtype)


def _ablate_affine(v: torch.Tensor, s: float) -> Affine:
    return 1.0, s, unit(v), v.float().new_zeros(v.shape)


def _replace_affine(v: torch.Tensor, s: float) -> Affine:
    return 0.0, 0.0, v.float().new_zeros(v.shape), s * v.float()


def _interp_affine(v: torch.Tensor, s: float) -> Affine:
    return 1 - s, 0.0, v.float().new_zeros(v.shape), s * v.float()


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op("add", "h + s·v", engine=True, additive=True, gguf=True, scale_range=None,
           needs_direction=False, reference=_add, delta=_add_delta),
        Op("ablate", "h − s·(h·v̂)v̂", engine=True, additive=False, gguf=False, scale_range=None,
           needs_direction=True, reference=_ablate, affine=_ablate_affine),
        Op("replace", "s·v", engine=True, additive=False, gguf=False, scale_range=None,
           needs_direction=False, reference=_replace, affine=_replace_affine),
        Op("interp", "(1 − s)·h + s·v", engine=True, additive=False, gguf=False,
           scale_range=(0.0, 1.0), needs_direction=False, reference=_interp,
           affine=_interp_affine),
    )
}  # fmt: skip


def engine_ops() -> tuple[str, ...]:
    """The names a request may send (the engine serves them), in registry order."""
    return tuple(n for n, op in OPS.items() if op.engine)


def ordered(items: Iterable[T], op_of: Callable[[T], str] | None = None) -> list[T]:
    """``items`` (entries, or anything ``op_of`` names an op of; default: its ``op``) in the
    order they apply on one layer: the non-additive first, in their order, then the additive."""
    seq: Sequence[T] = list(items)
    additive = [OPS[op_of(e) if op_of else e.op].additive for e in seq]  # type: ignore[attr-defined]
    return [e for e, a in zip(seq, additive, strict=True) if not a] + [
        e for e, a in zip(seq, additive, strict=True) if a
    ]
