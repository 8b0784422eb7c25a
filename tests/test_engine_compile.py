"""torch.compile on (vLLM's compiled forward, not eager) and vLLM's default multi-process mode:
steering, every operation included, must survive compilation and give the eager engine's
tokens."""

from __future__ import annotations

import pytest
from _engine_helpers import LOGPROB_ATOL, check_against_reference, engine, load_hf, prompts, run

STEERING = [
    [{"vector": "alpha", "layer": 1, "scale": 2.0, "positions": "all"}],
    None,
    [{"vector": "beta", "layer": 2, "scale": -1.5, "positions": "last_prompt_and_generated"}],
    [{"vector": "alpha", "layer": 3, "scale": 2.5, "positions": "generated"}],
    None,
    [  # the non-additive kernel: two slots on layer 1, with an add after them
        {"vector": "beta", "layer": 1, "scale": 1.0, "positions": "all", "op": "ablate"},
        {"vector": "alpha", "layer": 1, "scale": 0.5, "positions": "generated", "op": "interp"},
        {"vector": "alpha", "layer": 1, "scale": 1.0, "positions": "all"},
    ],
    [
        {
            "vector": "beta",
            "layer": 2,
            "scale": 1.0,
            "positions": "last_prompt_and_generated",
            "op": "replace",
        }
    ],
]
N = len(STEERING)


@pytest.fixture(scope="module")
def eager_results(tiny_llama):
    eng = engine(tiny_llama)
    try:
        return run(eng, prompts(N), STEERING), run(eng, prompts(N), None)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_compiled_multiprocess_equals_eager(tiny_llama, eager_results, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    eng = engine(tiny_llama, enforce_eager=False)
    try:
        info = eng.worker_info()
        assert info[0]["hooked_layers"] == [0, 1, 2, 3]
        assert set(info[0]["vectors"]) == {"alpha", "beta"}
        steered, plain = run(eng, prompts(N), STEERING), run(eng, prompts(N), None)
        eager_steered, eager_plain = eager_results
        for got, want in zip(steered + plain, eager_steered + eager_plain, strict=True):
            assert got[0] == want[0]
            assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < LOGPROB_ATOL
        assert any(s[0] != p[0] for s, p in zip(steered, plain, strict=True) if s), "no effect"
        check_against_reference(load_hf(tiny_llama), eng, prompts(N), STEERING)
    finally:
        eng.shutdown()
