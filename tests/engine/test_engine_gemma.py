"""The plugin on a tiny Gemma-3-shaped model (post-feedforward norm, scaled embeddings, sliding
window layers) against the transformers oracle, for every operation and positions value."""

from __future__ import annotations

import pytest
from _engine_helpers import check_against_reference, engine, load_hf, prompts, run

from steerserve.engine.ops import engine_ops
from steerserve.engine.spec import POSITIONS


@pytest.fixture(scope="module")
def eng(tiny_gemma):
    e = engine(tiny_gemma)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_gemma):
    return load_hf(tiny_gemma)


def test_parity_gemma3(eng, hf):
    ps = prompts(3, seed=7)
    steering = [
        [{"vector": "alpha", "layer": 2, "scale": 3.0, "positions": "all"}],
        [
            {
                "vector": "beta",
                "layer": 0,
                "scale": -2.0,
                "positions": "last_prompt_and_generated",
            }
        ],
        [
            {"vector": "alpha", "layer": 1, "scale": 1.5, "positions": "all"},
            {"vector": "beta", "layer": 3, "scale": 2.0, "positions": "generated"},
        ],
    ]
    got = check_against_reference(hf, eng, ps, steering)
    plain = run(eng, ps, None)
    assert any(g[0] != p[0] for g, p in zip(got, plain, strict=True)), "no effect"


OP_SCALE = {"add": 3.0, "ablate": 2.0, "replace": 1.0, "interp": 0.6}


@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("op", engine_ops())
def test_every_op_matches_transformers(eng, hf, op, positions):
    ps = prompts(3, seed=7)
    entry = {"vector": "beta", "layer": 2, "scale": OP_SCALE[op], "positions": positions, "op": op}
    # with an add on the same layer and an op on another: the stated order, per layer
    steering = [
        [entry],
        [{"vector": "alpha", "layer": 2, "scale": 1.5, "positions": "all"}, entry],
        [entry, {"vector": "alpha", "layer": 0, "scale": 0.5, "positions": positions, "op": op}],
    ]
    got = check_against_reference(hf, eng, ps, steering)
    plain = run(eng, ps, None)
    moved = max(
        abs(a - b) for g, p in zip(got, plain, strict=True) for a, b in zip(g[1], p[1], strict=True)
    )
    assert moved > 1e-3, f"{op} at {positions} had no effect"
