"""Where a decode step's plugin time goes: each per-step piece timed alone, best of repeats.

Load-robust (minimum over repeats of tight loops, no engine scheduling in the loop), so it reads
the same on a busy shared machine. Pieces, at the shape of one decode step of one request:

* ``hook+op`` — a hooked layer's forward hook and ``steer_add`` on a ``[tokens, hidden]`` stream
  (what every hooked layer paid on every step before the idle skip); ``hook idle`` — the same hook
  when no running request steers its layer (the skip);
* ``op`` — ``torch.ops.steerserve.steer_add`` alone; ``add`` — a plain ``hidden + delta``;
* ``sync`` / ``prepare_step`` — the runner seam's bookkeeping and index fill, idle and steered.

    .venv/bin/python bench/step_cost.py --hidden 1536 --layers 28 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch


def best_us(fn: Callable[[], object], n: int = 2000, repeats: int = 7) -> float:
    """Minimum over ``repeats`` of the mean µs of ``n`` calls."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


class Layer(torch.nn.Module):
    """A stand-in decoder layer returning ``(hidden, residual)`` as vLLM's do."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def main() -> None:
    from steerserve.engine.buffers import SteeringState
    from steerserve.engine.op import steer_add

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=1, help="tokens in the step (decode: requests)")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    st = SteeringState(
        num_layers=a.layers,
        hidden_size=a.hidden,
        max_num_seqs=64,
        max_num_tokens=2048 + 64,
        rows_per_request=4,
        device="cpu",
    )
    layers = [Layer() for _ in range(a.layers)]
    st.attach(layers, range(a.layers))
    bare = Layer()
    x = torch.randn(a.tokens, a.hidden, dtype=dtype)
    st.register_vector("v", torch.randn(a.hidden), "d")
    ids = [f"r{i}" for i in range(a.tokens)]
    qsl = np.arange(a.tokens + 1, dtype=np.int32)
    comp = np.full(a.tokens, 40, np.int32)
    plen = np.full(a.tokens, 30, np.int32)
    no_extra: dict = {}

    rows: list[tuple[str, float]] = []
    rows.append(("layer call, no hook", best_us(lambda: bare(x))))
    st.sync(ids, lambda r: no_extra)  # every request unsteered
    rows.append(("sync (idle)", best_us(lambda: st.sync(ids, lambda r: no_extra))))
    rows.append(("prepare_step (idle)", best_us(lambda: st.prepare_step(ids, qsl, comp, plen))))
    rows.append(("hooked layer, idle", best_us(lambda: layers[0](x))))
    from steerserve.engine.spec import EXTRA_ARGS_KEY, SteeringEntry, encode

    spec = {EXTRA_ARGS_KEY: encode([SteeringEntry("v", a.layers // 2, 1.0, "all")])}
    st2 = SteeringState(
        num_layers=a.layers,
        hidden_size=a.hidden,
        max_num_seqs=64,
        max_num_tokens=2048 + 64,
        rows_per_request=4,
        device="cpu",
    )
    st2.register_vector("v", torch.randn(a.hidden), "d")
    layers2 = [Layer() for _ in range(a.layers)]
    st2.attach(layers2, range(a.layers))
    st2.sync(ids, lambda r: spec)
    rows.append(("sync (steered)", best_us(lambda: st2.sync(ids, lambda r: spec))))
    rows.append(("prepare_step (steered)", best_us(lambda: st2.prepare_step(ids, qsl, comp, plen))))
    st2.prepare_step(ids, qsl, comp, plen)
    rows.append(("hooked layer, steered", best_us(lambda: layers2[a.layers // 2](x))))
    idx, pool = st2.index[a.layers // 2], st2.pool
    rows.append(("steer_add op alone", best_us(lambda: steer_add(x, idx, pool))))
    d = torch.randn(a.tokens, a.hidden, dtype=dtype)
    rows.append(("plain add", best_us(lambda: x + d)))
    print(f"hidden {a.hidden}, {a.layers} layers, {a.tokens} token(s), {a.dtype}, 1 thread")
    print("| piece | µs per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
