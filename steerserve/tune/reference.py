"""Plain transformers steering with forward hooks: the oracle the vLLM plugin is tested against,
with its semantics (each entry's ``engine/ops.py`` op at block L on its ``positions``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from steerserve.engine.ops import OPS, ordered
from steerserve.engine.spec import (
    PHASE_GENERATED,
    PHASE_LAST_PROMPT,
    PHASE_PROMPT,
    POSITIONS,
    SteeringEntry,
)
from steerserve.tune.hf import decoder_layers, device_of


def phases(seq_len: int, prompt_len: int) -> torch.Tensor:
    """Phase of each position of a sequence whose first ``prompt_len`` tokens are the prompt."""
    pos = torch.arange(seq_len)
    out = torch.full((seq_len,), PHASE_PROMPT)
    out[pos == prompt_len - 1] = PHASE_LAST_PROMPT
    out[pos >= prompt_len] = PHASE_GENERATED
    return out


@contextmanager
def steering_hooks(
    model: torch.nn.Module,
    entries: Sequence[SteeringEntry],
    vectors: Mapping[str, torch.Tensor],
    masks: torch.Tensor | None = None,
) -> Iterator[dict]:
    """Apply the entries while the context is open; ``masks`` (bool ``[3, batch, seq]``, settable
    as ``ctx["masks"]``) gives each token's phase, else only ``positions="all"`` entries apply."""
    layers = decoder_layers(model)
    ctx: dict = {"masks": masks}
    by_layer: dict[int, list[SteeringEntry]] = {}
    for e in ordered(entries):
        by_layer.setdefault(e.layer, []).append(e)

    def selected(e: SteeringEntry, h: torch.Tensor) -> torch.Tensor | None:
        m, wanted = ctx["masks"], POSITIONS[e.positions]
        if m is None:
            if PHASE_PROMPT not in wanted:
                return None
            return torch.ones(h.shape[:-1], dtype=torch.bool, device=h.device)
        return m[list(wanted)].any(0).to(h.device)

    def hook(module, args, output, here):  # noqa: ANN001
        h = output[0] if isinstance(output, tuple) else output
        for e in here:
            sel = selected(e, h)
            if sel is not None:
                v = vectors[e.vector].to(device=h.device, dtype=torch.float32)
                h = torch.where(sel.unsqueeze(-1), OPS[e.op].reference(h, v, e.scale), h)
        return (h, *output[1:]) if isinstance(output, tuple) else h

    handles = [
        layers[layer].register_forward_hook(lambda mod, a, out, here=here: hook(mod, a, out, here))
        for layer, here in by_layer.items()
    ]
    try:
        yield ctx
    finally:
        for hd in handles:
            hd.remove()


@torch.no_grad()
def greedy(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    entries: Sequence[SteeringEntry] = (),
    vectors: Mapping[str, torch.Tensor] | None = None,
    forced: Sequence[int] | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by full recomputation (simple and exact): the new token ids and the
    log-probabilities each was chosen from; ``forced`` tokens are fed back instead of the argmax."""
    ids = list(prompt_ids)
    p = len(ids)
    out, logps = [], []
    with steering_hooks(model, entries, vectors or {}) as ctx:
        for i in range(max_new_tokens):
            ph = phases(len(ids), p)
            ctx["masks"] = torch.stack([ph == k for k in range(3)]).unsqueeze(1)
            inp = torch.tensor([ids], device=device_of(model))
            logits = model(inp).logits[0, -1].to(torch.float32)
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax()) if forced is None else int(forced[i])
            out.append(tok)
            logps.append(lp)
            ids.append(tok)
    return out, logps
