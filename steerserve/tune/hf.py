"""transformers helpers shared here: loading, decoder blocks, left-padded batches and capture
at the output of block L (the engine's convention), found and hooked in one place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def load_model(
    name_or_path: str | Path | None, device: str = "cpu", dtype: str = "float32"
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` on ``device`` in ``dtype`` (``bfloat16`` on GPU for 3B models),
    resolved and loaded by :func:`steerserve.models.load_hf_model`."""
    from steerserve.models import load_hf_model

    model, tok = load_hf_model(name_or_path, dtype=getattr(torch, dtype))
    return model.to(device), tok


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a transformers causal LM (``model.model.layers`` and variants)."""
    for path in ("model.layers", "model.language_model.layers", "language_model.model.layers"):
        m: object = model
        for part in path.split("."):
            m = getattr(m, part, None)
        if isinstance(m, torch.nn.ModuleList):
            return m
    raise TypeError(f"{type(model).__name__}: cannot find decoder layers")


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@dataclass
class Batch:
    """Left-padded token ids with their mask and explicit position ids: every row's last prompt
    token sits in column -1 and sees the positions it would see alone."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor

    def inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Keyword arguments of a transformers forward."""
        return {
            "input_ids": self.ids.to(device),
            "attention_mask": self.mask.to(device),
            "position_ids": self.positions.to(device),
        }


def left_padded(seqs: Sequence[Sequence[int]], pad: int | None) -> Batch:
    """``seqs`` as one left-padded batch (``pad`` None: id 0, never attended to)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), 0 if pad is None else pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = torch.tensor(list(s))
        mask[r, width - len(s) :] = 1
    return Batch(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))


@contextmanager
def last_token_outputs(modules: Sequence[torch.nn.Module]) -> Iterator[list[torch.Tensor | None]]:
    """While open, ``out[i]`` holds module i's output at the last position of the latest forward
    (``[batch, hidden]``, float32). Hooks registered after steering hooks see steered outputs."""
    out: list[torch.Tensor | None] = [None] * len(modules)

    def hook(i: int) -> Any:
        def f(module: Any, args: Any, output: Any) -> None:  # noqa: ARG001
            h = output[0] if isinstance(output, tuple) else output
            out[i] = h[:, -1, :].float()

        return f

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
    try:
        yield out
    finally:
        for hd in handles:
            hd.remove()
