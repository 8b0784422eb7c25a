"""The plugin in the real vLLM engine (CPU, eager) on a tiny Llama: parity with the transformers
oracle, mixed batches, scale 0, prefix caching, admission errors."""

from __future__ import annotations

import math

import pytest
from _engine_helpers import check_against_reference, engine, load_hf, prompts, run


@pytest.fixture(scope="module")
def stock_unsteered(tiny_llama):
    """Unsteered outputs of an engine built WITHOUT the plugin (the stock architecture)."""
    eng = engine(tiny_llama, steering=False)
    try:
        return run(eng, prompts(8), None)
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def eng(tiny_llama, stock_unsteered):  # after the stock engine: one engine at a time
    e = engine(tiny_llama)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return load_hf(tiny_llama)


@pytest.mark.parametrize("positions", ["all", "last_prompt_and_generated", "generated"])
def test_parity_with_transformers(eng, hf, positions):
    ps = prompts(3)
    steering = [[{"vector": "alpha", "layer": 1, "scale": 2.0, "positions": positions}]] * 3
    got = check_against_reference(hf, eng, ps, steering)
    plain = run(eng, ps, None)
    assert any(g[0] != p[0] for g, p in zip(got, plain, strict=True)), "steering had no effect"


MIXED = [
    None,
    [{"vector": "alpha", "layer": 1, "scale": 2.0, "positions": "all"}],
    [{"vector": "beta", "layer": 2, "scale": -1.5, "positions": "last_prompt_and_generated"}],
    None,
    [
        {"vector": "alpha", "layer": 0, "scale": 1.0, "positions": "all"},
        {"vector": "beta", "layer": 3, "scale": 2.5, "positions": "generated"},
    ],
    [  # two vectors on one layer add up
        {"vector": "alpha", "layer": 2, "scale": 1.0, "positions": "all"},
        {"vector": "beta", "layer": 2, "scale": 1.0, "positions": "last_prompt_and_generated"},
    ],
    None,
    [{"vector": "beta", "layer": 1, "scale": 3.0, "positions": "generated"}],
]


def test_mixed_batch_equals_solo_and_stock(eng, hf, stock_unsteered):
    ps = prompts(8)
    batch = run(eng, ps, MIXED)
    for i, (p, s) in enumerate(zip(ps, MIXED, strict=True)):
        solo = run(eng, [p], [s])[0]
        assert batch[i][0] == solo[0], f"request {i} differs in a batch"
        if s is None:
            assert batch[i][0] == stock_unsteered[i][0], f"unsteered {i} differs from stock engine"
            assert batch[i][1] == stock_unsteered[i][1], f"unsteered {i} logprobs differ from stock"
    plain = run(eng, ps, None)
    for i, s in enumerate(MIXED):
        if s is None:
            assert batch[i] == plain[i], f"unsteered {i} changed by steered batch-mates"
    steered_changed = sum(batch[i][0] != plain[i][0] for i, s in enumerate(MIXED) if s)
    assert steered_changed >= 3, "steering changed too few requests to be meaningful"
    # and the steered ones are right, not just self-consistent
    check_against_reference(hf, eng, ps[4:6], MIXED[4:6])


def test_scale_zero_is_unsteered(eng):
    ps = prompts(4, seed=3)
    zero = [[{"vector": "alpha", "layer": li, "scale": 0.0, "positions": "all"}] for li in range(4)]
    assert run(eng, ps, zero) == run(eng, ps, None)


def test_prefix_cache_does_not_leak_into_steered(eng, hf):
    from vllm import SamplingParams

    prefix = prompts(10, seed=11)[7] * 5  # ~200 shared tokens: many full KV blocks
    unsteered_prompt, steered_prompt = prefix + [40, 41], prefix + [50, 51]
    entry = [{"vector": "alpha", "layer": 1, "scale": 2.0, "positions": "all"}]
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    first = eng.generate([unsteered_prompt], sp)[0]
    second = eng.generate([prefix + [60, 61]], sp)[0]
    assert second.num_cached_tokens > 0, "prefix caching is not on: the test would prove nothing"
    steered = eng.generate([steered_prompt], sp, steering=[entry])[0]
    assert steered.num_cached_tokens == 0, "steered request reused unsteered KV"
    check_against_reference(hf, eng, [steered_prompt], [entry])
    again = eng.generate([prefix + [70, 71]], sp, steering=[entry])[0]
    assert again.num_cached_tokens > 0, "steered requests with the same steering should share KV"
    assert first.outputs[0].token_ids  # ran


BAD = [
    ([{"vector": "nope", "layer": 1, "scale": 1.0}], r"steering\[0\]\.vector: unknown vector"),
    ([{"vector": "alpha", "layer": 4, "scale": 1.0}], r"steering\[0\]\.layer: 4 is out of range"),
    ([{"vector": "alpha", "layer": -1, "scale": 1.0}], r"steering\[0\]\.layer"),
    (
        [{"vector": "alpha", "layer": True, "scale": 1.0}],
        r"steering\[0\]\.layer: must be an integer",
    ),
    ([{"vector": "alpha", "layer": 1, "scale": math.nan}], r"steering\[0\]\.scale: must be finite"),
    ([{"vector": "alpha", "layer": 1, "scale": math.inf}], r"steering\[0\]\.scale: must be finite"),
    ([{"vector": "alpha", "layer": 1, "scale": 1e6}], r"steering\[0\]\.scale: .* is outside"),
    ([{"vector": "alpha", "layer": 1, "scale": "2"}], r"steering\[0\]\.scale: must be a number"),
    (
        [{"vector": "alpha", "layer": 1, "scale": 1.0, "positions": "prompt"}],
        r"steering\[0\]\.positions: 'prompt' is not one of",
    ),
    ([{"vector": "alpha", "layer": 1, "scale": 1.0, "colour": 1}], r"steering\[0\]\.colour"),
    ({"vector": "alpha"}, r"steering: must be a list"),
]


@pytest.mark.parametrize(("steering", "message"), BAD)
def test_bad_steering_is_refused(eng, steering, message):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=message):
        # a valid request alongside: the whole call is refused before anything runs
        eng.generate(
            [[1, 5, 6], [1, 7, 8]], SamplingParams(max_tokens=2), steering=[None, steering]
        )


def test_vector_that_does_not_fit_is_refused(eng):
    import torch

    with pytest.raises(ValueError, match="does not match the model's hidden size"):
        eng.register_vector("short", torch.ones(eng.shape.hidden_size - 1))
    with pytest.raises(ValueError, match="NaN or Inf"):
        eng.register_vector("bad", torch.full((eng.shape.hidden_size,), math.nan))
    with pytest.raises(ValueError, match="already registered with different data"):
        eng.register_vector("alpha", torch.zeros(eng.shape.hidden_size))
