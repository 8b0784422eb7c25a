"""Per-request seeds on CPU: a seeded request whose prefill is split across steps must neither
kill the engine (vLLM's rewind of the discarded draw assumes CUDA's Philox offsets) nor depend on
how its prompt was chunked or batched."""

from __future__ import annotations

import torch
from _engine_helpers import engine


def _long_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[1] + torch.randint(4, 250, (n,), generator=g).tolist() for n in (150, 170, 190)]


def _sample(eng, prompts, steering=None) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    return [list(o.outputs[0].token_ids) for o in eng.generate(prompts, sp, steering=steering)]


def test_seeded_chunked_prefills_survive_and_match_unchunked_runs(tiny_llama) -> None:
    prompts = _long_prompts()
    steer = [None, [{"vector": "alpha", "layer": 1, "scale": 2.0}], None]
    eng = engine(tiny_llama, max_num_batched_tokens=64)  # every prompt spans 3-4 steps
    try:
        batched = _sample(eng, prompts, steer)
        solo = [_sample(eng, [p], [s])[0] for p, s in zip(prompts, steer, strict=True)]
    finally:
        eng.shutdown()
    eng = engine(tiny_llama, max_num_batched_tokens=512)  # no prompt is split
    try:
        whole = _sample(eng, prompts, steer)
    finally:
        eng.shutdown()
    assert batched == solo == whole
    assert len({tuple(t) for t in batched}) == 3  # different prompts, different samples
