"""torch.compile on (vLLM's compiled forward, not eager) and vLLM's default multi-process mode:
steering, every operation included, must survive compilation and give the eager engine's
tokens. In one process: the compiled graph's gated ops skip idle layers' arithmetic (issue 48)
with one graph for every batch mix, and a steered batch after an idle one is still steered."""

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


ADD_ONLY = [
    [{"vector": "alpha", "layer": i % 4, "scale": 2.0, "positions": "all"}] for i in range(N)
]
ABLATE_ONLY = [
    [{"vector": "beta", "layer": i % 4, "scale": 1.0, "positions": "all", "op": "ablate"}]
    for i in range(N)
]


@pytest.mark.slow
def test_compiled_idle_skips_the_arithmetic_with_one_graph(tiny_llama, eager_results, monkeypatch):
    """CPU, compiled, in this process (so the kernels and dynamo's counters are this module's):
    an idle batch runs neither kernel's arithmetic; steered batches after it are steered and equal
    eager; scale 0 is unsteered; no batch mix traces another graph."""
    from torch._dynamo.utils import counters

    import steerserve.engine.kernels as op

    calls: list[str] = []
    real_add, real_edit = op._steer_add, op._steer_edit
    monkeypatch.setattr(op, "_steer_add", lambda *a: calls.append("add") or real_add(*a))
    monkeypatch.setattr(op, "_steer_edit", lambda *a: calls.append("edit") or real_edit(*a))
    eng = engine(tiny_llama, enforce_eager=False)
    try:
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 1, "the engine traced no graph: not compiled in this process"
        eager_steered, eager_plain = eager_results
        plain = [p[0] for p in eager_plain]
        calls.clear()
        assert [p[0] for p in run(eng, prompts(N), None)] == plain
        assert calls == [], "an idle compiled step ran steering arithmetic"
        steered = run(eng, prompts(N), STEERING)
        assert {"add", "edit"} <= set(calls)
        for got, want in zip(steered, eager_steered, strict=True):
            assert got[0] == want[0]
            assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < LOGPROB_ATOL
        for i, entries in enumerate(STEERING):
            if entries is None:  # an unsteered row of a steered batch is its solo self
                assert steered[i][0] == run(eng, [prompts(N)[i]], None)[0][0]
        calls.clear()
        add_only = run(eng, prompts(N), ADD_ONLY)
        assert set(calls) == {"add"}
        calls.clear()
        ablated = run(eng, prompts(N), ABLATE_ONLY)
        assert set(calls) == {"edit"}
        assert [a[0] for a in add_only] != plain and [a[0] for a in ablated] != plain
        zero = [[{**e, "scale": 0.0} for e in entries] for entries in ADD_ONLY]
        assert [z[0] for z in run(eng, prompts(N), zero)] == plain
        calls.clear()
        assert [p[0] for p in run(eng, prompts(N), None)] == plain
        assert calls == []
        assert counters["stats"]["unique_graphs"] == graphs, "a batch mix recompiled"
    finally:
        eng.shutdown()
