"""Where a decode step's plugin time goes: each per-step piece timed alone, best of repeats.

Load-robust (minimum over repeats of tight loops, no engine scheduling in the loop), so it reads
the same on a busy shared machine. Pieces, at the shape of one decode step of one request:

* ``hooked layer, idle`` — a hooked layer's forward hook when no running request steers its layer
  (the skip); ``hooked layer, steered <op>`` — the hook with every row of the step steered by one
  entry of that operation (``engine/ops.py``: ``add`` runs ``steer_add``, the others
  ``steer_edit``); ``hooked layer, no skip`` — both kernels on an unsteered layer, what every
  hooked layer pays where the skip is off (CUDA graphs, torch.compile on a GPU);
* ``op`` — each kernel alone; ``add`` — a plain ``hidden + delta``;
* ``sync`` / ``prepare_step`` — the runner seam's bookkeeping and index fill, idle and steered;
* the degeneracy check: vLLM's logprobs of the batch (before issue 60) against the worker's check.

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


def steered_state(a: argparse.Namespace, spec: dict | None) -> tuple[object, list[Layer]]:
    """A steering state on stand-in layers, every request of the step running ``spec``."""
    from steerserve.engine.buffers import SteeringState

    st = SteeringState(
        num_layers=a.layers,
        hidden_size=a.hidden,
        max_num_seqs=64,
        max_num_tokens=2048 + 64,
        rows_per_request=4,
        device="cpu",
    )
    st.register_vector("v", torch.randn(a.hidden), "d")
    layers = [Layer() for _ in range(a.layers)]
    st.attach(layers, range(a.layers))
    ids = [f"r{i}" for i in range(a.tokens)]
    st.sync(ids, lambda r: spec)
    return st, layers


def op_rows(a: argparse.Namespace, name: str, x: torch.Tensor, step: tuple) -> list:
    """The pieces of one operation with every request of the step running one entry of it at
    the middle layer (all positions); the bookkeeping and kernel alone for ``add`` (the delta
    pool) and ``ablate`` (standing for the non-additive kernel, which every such op shares)."""
    from steerserve.engine.kernels import steer_add, steer_edit
    from steerserve.engine.ops import OPS
    from steerserve.engine.spec import EXTRA_ARGS_KEY, SteeringEntry, encode

    mid = a.layers // 2
    scale = 0.5 if OPS[name].scale_range else 1.0
    spec = {EXTRA_ARGS_KEY: encode([SteeringEntry("v", mid, scale, "all", name)])}
    st, layers = steered_state(a, spec)
    st.prepare_step(*step)
    rows = []
    if name == "add":
        rows.append(("sync (steered)", best_us(lambda: st.sync(step[0], lambda r: spec))))
        rows.append(("prepare_step (steered)", best_us(lambda: st.prepare_step(*step))))
        idx, pool = st.index[mid], st.pool
        rows.append(("steer_add op alone", best_us(lambda: steer_add(x, idx, pool))))
    elif name == "ablate":
        rows.append(("prepare_step (steered, non-additive)",
                     best_us(lambda: st.prepare_step(*step))))  # fmt: skip
        oi, rw = st.op_index[mid], st.op_rows
        rows.append(("steer_edit op alone (K slots)", best_us(lambda: steer_edit(x, x, oi, rw))))
    rows.append((f"hooked layer, steered {name}", best_us(lambda: layers[mid](x))))
    return rows


def check_rows(a: argparse.Namespace, x: torch.Tensor) -> list[tuple[str, float]]:
    """The degeneracy check of a steered step, before and after issue 60: vLLM's logprobs of the
    batch (what asking one logprob per steered request made the sampler compute for every row)
    against the worker's check of the steered rows' final hidden states."""
    from vllm.v1.sample.sampler import Sampler

    from steerserve.engine.degenerate import flag_rows

    logits = torch.randn(a.tokens, a.vocab)
    sampled = logits.argmax(-1)
    s = Sampler()
    n = max(1, 200_000_000 // (a.tokens * a.vocab))  # calls: about 200 M logits in all

    def logprobs() -> object:
        return s.gather_logprobs(s.compute_logprobs(logits), 1, token_ids=sampled)

    return [
        (f"vLLM logprobs of the batch, vocabulary {a.vocab} (the old check)",
         best_us(logprobs, n=n, repeats=3)),
        ("the worker's check of the rows' hidden states (the new one)",
         best_us(lambda: flag_rows(x))),
    ]  # fmt: skip


def main() -> None:
    from steerserve.engine.ops import engine_ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=1, help="tokens in the step (decode: requests)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vocab", type=int, default=151936, help="for the logprobs row")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype)
    x = torch.randn(a.tokens, a.hidden, dtype=dtype)
    ids = [f"r{i}" for i in range(a.tokens)]
    qsl = np.arange(a.tokens + 1, dtype=np.int32)
    comp = np.full(a.tokens, 40, np.int32)
    plen = np.full(a.tokens, 30, np.int32)
    bare = Layer()

    rows: list[tuple[str, float]] = []
    rows.append(("layer call, no hook", best_us(lambda: bare(x))))
    st, layers = steered_state(a, None)  # every request unsteered
    rows.append(("sync (idle)", best_us(lambda: st.sync(ids, lambda r: None))))
    rows.append(("prepare_step (idle)", best_us(lambda: st.prepare_step(ids, qsl, comp, plen))))
    rows.append(("hooked layer, idle", best_us(lambda: layers[0](x))))
    st.skip_idle = False
    rows.append(("hooked layer, no skip (both kernels, nothing steered)",
                 best_us(lambda: layers[0](x))))  # fmt: skip
    for name in engine_ops():
        rows += op_rows(a, name, x, (ids, qsl, comp, plen))
    d = torch.randn(a.tokens, a.hidden, dtype=dtype)
    rows.append(("plain add", best_us(lambda: x + d)))
    rows += check_rows(a, x)
    print(f"hidden {a.hidden}, {a.layers} layers, {a.tokens} token(s), {a.dtype}, 1 thread")
    print("| piece | µs per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
