"""The plugin on a tiny Gemma-3-shaped model (post-feedforward norm, scaled embeddings, sliding
window layers) against the transformers oracle."""

from __future__ import annotations

from _engine_helpers import check_against_reference, engine, load_hf, prompts, run


def test_parity_gemma3(tiny_gemma):
    hf = load_hf(tiny_gemma)
    eng = engine(tiny_gemma)
    try:
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
    finally:
        eng.shutdown()
