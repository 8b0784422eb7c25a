"""The plugin in the real vLLM engine (CPU, eager) on a tiny Llama: parity with the transformers
oracle for every operation and positions value, mixed batches, scale 0, prefix caching,
admission errors."""

from __future__ import annotations

import math

import pytest
from _engine_helpers import (
    LOGPROB_ATOL,
    check_against_reference,
    engine,
    load_hf,
    prompts,
    run,
    vectors,
)

from steerserve.engine.ops import engine_ops
from steerserve.engine.spec import POSITIONS


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


#: A scale per op that visibly steers the tiny model (interp's α lies in [0, 1]).
OP_SCALE = {"add": 2.0, "ablate": 2.0, "replace": 1.0, "interp": 0.6}


@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("op", engine_ops())
def test_every_op_matches_transformers(eng, hf, op, positions):
    ps = prompts(3)
    entry = {"vector": "alpha", "layer": 1, "scale": OP_SCALE[op], "positions": positions}
    got = check_against_reference(hf, eng, ps, [[entry | {"op": op}]] * 3)
    plain = run(eng, ps, None)
    moved = max(
        abs(a - b) for g, p in zip(got, plain, strict=True) for a, b in zip(g[1], p[1], strict=True)
    )
    assert moved > 1e-3, f"{op} at {positions} had no effect"


#: Every op, two of them stacked on one layer and token, combined with add on the same layer.
MIXED_OPS = [
    None,
    [{"vector": "alpha", "layer": 1, "scale": 1.0, "positions": "all", "op": "ablate"}],
    [
        {
            "vector": "beta",
            "layer": 2,
            "scale": 1.0,
            "positions": "last_prompt_and_generated",
            "op": "replace",
        }
    ],
    None,
    [
        {"vector": "alpha", "layer": 0, "scale": 0.5, "positions": "all", "op": "interp"},
        {"vector": "beta", "layer": 3, "scale": 2.5, "positions": "generated"},
    ],
    [  # on layer 2: ablate then interp (generated tokens), then the add
        {"vector": "alpha", "layer": 2, "scale": 1.0, "positions": "all"},
        {
            "vector": "beta",
            "layer": 2,
            "scale": 1.0,
            "positions": "last_prompt_and_generated",
            "op": "ablate",
        },
        {"vector": "alpha", "layer": 2, "scale": 0.3, "positions": "generated", "op": "interp"},
    ],
    None,
    [
        {"vector": "alpha", "layer": 1, "scale": 0.8, "positions": "generated", "op": "replace"},
        {"vector": "beta", "layer": 1, "scale": -1.0, "positions": "all", "op": "ablate"},
    ],
]


def test_mixed_batch_of_every_op_equals_solo_and_stock(eng, hf, stock_unsteered):
    ps = prompts(8)
    batch = run(eng, ps, MIXED_OPS)
    for i, (p, s) in enumerate(zip(ps, MIXED_OPS, strict=True)):
        solo = run(eng, [p], [s])[0]
        assert batch[i][0] == solo[0], f"request {i} differs in a batch"
        assert max(abs(a - b) for a, b in zip(batch[i][1], solo[1], strict=True)) < LOGPROB_ATOL
        if s is None:
            assert batch[i] == stock_unsteered[i], f"unsteered {i} differs from a stock engine"
    steered = [i for i, s in enumerate(MIXED_OPS) if s]
    check_against_reference(hf, eng, [ps[i] for i in steered], [MIXED_OPS[i] for i in steered])


def _capture_stream(layer: int, out: list):
    """A worker-side function (``collective_rpc``): hook decoder block ``layer`` after the
    steering hook and keep the stream ``hidden + residual`` it hands on."""

    def install(worker):
        from steerserve.engine.archs import _decoder

        block = _decoder(worker.model_runner.get_model()).layers[layer]

        def keep(module, args, output):
            hidden, residual = output
            out.append((hidden + residual).detach().clone())

        worker._steerserve_test_hook = block.register_forward_hook(keep)

    return install


def test_ablate_leaves_the_stream_orthogonal(eng, hf):
    """Scale 1 removes v's direction at the steered tokens: in the engine (the stream block 1
    hands on) and in the transformers reference (block 1's output)."""
    import torch

    from steerserve.engine.spec import SteeringEntry
    from steerserve.tune.reference import phases, steering_hooks

    v = vectors(eng.shape.hidden_size)["alpha"]
    u = v / v.norm()
    entry = {"vector": "alpha", "layer": 1, "scale": 1.0, "positions": "all", "op": "ablate"}

    def max_cos(streams: torch.Tensor) -> float:
        return float(((streams @ u) / streams.norm(dim=-1)).abs().max())

    seen: list = []
    eng.llm.collective_rpc(_capture_stream(1, seen))
    try:
        run(eng, prompts(2), None)
        plain, seen[:] = torch.cat(seen), []
        run(eng, prompts(2), [[entry]] * 2)
        ablated = torch.cat(seen)
    finally:
        eng.llm.collective_rpc(lambda w: w._steerserve_test_hook.remove())
    assert max_cos(plain) > 1e-2 and ablated.shape[0] > 20
    assert max_cos(ablated) < 1e-5, f"engine: |cos(h, v)| up to {max_cos(ablated):.2e}"

    ids, kept = prompts(1)[0], []
    with steering_hooks(hf, [SteeringEntry(**entry)], {"alpha": v}) as ctx:
        ph = phases(len(ids), len(ids))
        ctx["masks"] = torch.stack([ph == k for k in range(3)]).unsqueeze(1)
        handle = hf.model.layers[1].register_forward_hook(
            lambda m, a, o: kept.append(o[0] if isinstance(o, tuple) else o)
        )
        try:
            with torch.no_grad():
                hf(torch.tensor([ids]))
        finally:
            handle.remove()
    assert max_cos(kept[0][0]) < 1e-5, f"reference: |cos(h, v)| up to {max_cos(kept[0][0]):.2e}"


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
    ([{"vector": "alpha", "layer": 1, "op": "rotate"}], r"steering\[0\]\.op: 'rotate' is not one"),
    ([{"vector": "alpha", "layer": 1, "op": 3}], r"steering\[0\]\.op: 3 is not one of"),
    (
        [{"vector": "alpha", "layer": 1, "scale": 1.5, "op": "interp"}],
        r"steering\[0\]\.scale: 1.5 is outside \[0, 1\] for op 'interp'",
    ),
    (
        [{"vector": "alpha", "layer": 1, "scale": -0.1, "op": "interp"}],
        r"steering\[0\]\.scale: -0.1 is outside",
    ),
    (
        [{"vector": "alpha", "layer": 1, "scale": math.nan, "op": "ablate"}],
        r"steering\[0\]\.scale: must be finite",
    ),
    (
        [
            {"vector": v, "layer": 2, "scale": 1.0, "op": "ablate"}
            for v in ("alpha", "beta", "alpha")
        ],
        r"steering\[2\]\.op: more than 2 non-additive entries on layer 2",
    ),
]


@pytest.mark.parametrize(("steering", "message"), BAD)
def test_bad_steering_is_refused(eng, steering, message):
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=message):
        # a valid request alongside: the whole call is refused before anything runs
        eng.generate(
            [[1, 5, 6], [1, 7, 8]], SamplingParams(max_tokens=2), steering=[None, steering]
        )


def test_ablating_a_zero_vector_is_refused(eng):
    import torch
    from vllm import SamplingParams

    eng.register_vector("zero", torch.zeros(eng.shape.hidden_size))
    ok = [{"vector": "zero", "layer": 1, "scale": 1.0}]  # adding nothing is allowed
    assert run(eng, prompts(1), [ok]) == run(eng, prompts(1), None)
    with pytest.raises(ValueError, match=r"steering\[0\]\.vector: ablate needs a non-zero"):
        eng.generate(
            [[1, 5, 6]], SamplingParams(max_tokens=2), steering=[[ok[0] | {"op": "ablate"}]]
        )


def test_vector_that_does_not_fit_is_refused(eng):
    import torch

    with pytest.raises(ValueError, match="does not match the model's hidden size"):
        eng.register_vector("short", torch.ones(eng.shape.hidden_size - 1))
    with pytest.raises(ValueError, match="NaN or Inf"):
        eng.register_vector("bad", torch.full((eng.shape.hidden_size,), math.nan))
    with pytest.raises(ValueError, match="already registered with different data"):
        eng.register_vector("alpha", torch.zeros(eng.shape.hidden_size))
