"""The worker-side bookkeeping without an engine: entry validation, row planning, the per-token
index for batches with chunked prefill and decode, slot reuse, padding, and rank determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from steerserve.engine import prefix, spec
from steerserve.engine.buffers import SteeringState

H = 8


def _state(**kw) -> SteeringState:
    st = SteeringState(
        num_layers=4,
        hidden_size=H,
        max_num_seqs=4,
        max_num_tokens=64,
        rows_per_request=kw.pop("rows_per_request", 4),
        device="cpu",
    )
    st.register_vector("a", torch.arange(H, dtype=torch.float32), "da")
    st.register_vector("b", torch.ones(H), "db")
    return st


def _spec(*entries: tuple[str, int, float, str]) -> dict:
    return {spec.EXTRA_ARGS_KEY: spec.encode([spec.SteeringEntry(*e) for e in entries])}


def _delta(st: SteeringState, layer: int, upto: int) -> torch.Tensor:
    return st.pool[st.index[layer, :upto].long()]


def test_plan_rows_groups_phases_and_stacks_entries():
    e = [
        spec.SteeringEntry("a", 1, 2.0, "all"),
        spec.SteeringEntry("b", 1, 1.0, "generated"),
        spec.SteeringEntry("b", 3, 1.0, "last_prompt_and_generated"),
    ]
    rows = spec.plan_rows(e)
    assert [(r.layer, r.phases) for r in rows] == [(1, (0, 1)), (1, (2,)), (3, (1, 2))]
    assert rows[1].terms == (("a", 2.0, "add"), ("b", 1.0, "add"))


def test_encode_decode_round_trip_and_prefix_key():
    e = (spec.SteeringEntry("a", 1, 0.5, "all"), spec.SteeringEntry("b", 2, -1.0, "generated"))
    assert spec.decode(spec.encode(e)) == e
    k1 = prefix.key(e, {"a": "x", "b": "y"})
    assert prefix.parse(k1) == (k1[:32], None)
    assert k1 != prefix.key(e, {"a": "x2", "b": "y"})  # same names, other data
    assert k1 != prefix.key(e[:1], {"a": "x", "b": "y"})


def test_rows_per_request_budget_is_enforced_at_admission():
    entries = [{"vector": "a", "layer": i, "scale": 1.0, "positions": "all"} for i in range(3)]
    with pytest.raises(ValueError, match="needs 3 distinct"):
        spec.validate(entries, num_layers=4, vectors={"a": 1}, rows_per_request=2)
    with pytest.raises(ValueError, match="not steerable"):
        spec.validate(entries[:1], num_layers=4, vectors={"a": 1}, steerable_layers=[1])


def test_index_follows_phases_chunked_prefill_and_decode():
    st = _state()
    extra = {
        "r0": None,
        "r1": _spec(("a", 1, 2.0, "last_prompt_and_generated")),
        "r2": _spec(("b", 1, -1.0, "all"), ("a", 2, 1.0, "generated")),
    }
    st.sync(["r0", "r1", "r2"], extra.get)
    # step: r0 decodes 1 token, r1 prefills its whole 4-token prompt, r2 prefills chunk 2..5 of 6
    qsl = np.array([0, 1, 5, 8])
    st.prepare_step(["r0", "r1", "r2"], qsl, np.array([7, 0, 2]), np.array([3, 4, 6]))
    a, b = st.vectors["a"], st.vectors["b"]
    d1 = _delta(st, 1, 8)
    assert torch.equal(d1[0], torch.zeros(H))  # r0 unsteered
    assert torch.equal(d1[1:4], torch.zeros(3, H))  # r1 prompt tokens 0..2
    assert torch.equal(d1[4], 2.0 * a)  # r1 last prompt token
    assert torch.equal(d1[5:8], (-1.0 * b).expand(3, H))  # r2 "all"
    assert torch.equal(_delta(st, 2, 8), torch.zeros(8, H))  # r2 prompt: "generated" not yet
    assert torch.equal(_delta(st, 0, 8), torch.zeros(8, H))
    # next step: r0 finished; r1 and r2 decode their first generated token
    st.sync(["r1", "r2"], extra.get)
    st.prepare_step(["r1", "r2"], np.array([0, 1, 2]), np.array([4, 6]), np.array([4, 6]))
    assert torch.equal(_delta(st, 1, 2), torch.stack([2.0 * a, -1.0 * b]))
    assert torch.equal(_delta(st, 2, 2), torch.stack([torch.zeros(H), 1.0 * a]))
    assert int(st.index[:, 2:].abs().sum()) == 0  # stale tail from the 8-token step zeroed


def test_slots_are_freed_and_reused_and_index_cleared():
    st = _state()
    extra = {f"r{i}": _spec(("a", 0, float(i + 1), "all")) for i in range(8)}
    for i in range(8):  # more requests over time than slots: slots must be recycled
        st.sync([f"r{i}"], extra.get)
        st.prepare_step([f"r{i}"], np.array([0, 3]), np.array([0]), np.array([3]))
        assert torch.equal(_delta(st, 0, 3), (float(i + 1) * st.vectors["a"]).expand(3, H))
    st.sync([], extra.get)
    st.prepare_step([], np.array([0]), np.array([]), np.array([]))
    assert int(st.index.abs().sum()) == 0
    assert st.info()["live_steered"] == 0


def test_reset_zeroes_index_for_dummy_runs():
    st = _state()
    st.sync(["r"], {"r": _spec(("a", 3, 1.0, "all"))}.get)
    st.prepare_step(["r"], np.array([0, 5]), np.array([0]), np.array([5]))
    assert int(st.index[3].abs().sum()) > 0
    st.reset()
    assert int(st.index.abs().sum()) == 0


def test_ranks_derive_identical_buffers_without_communication():
    """Tensor-parallel ranks see the same scheduler output; each must compute the same rows."""
    ranks = [_state(), _state()]
    extra = {
        "x": _spec(("a", 1, 1.5, "all")),
        "y": None,
        "z": _spec(("b", 2, 2.0, "generated"), ("a", 2, 1.0, "all")),
    }
    steps = [
        (["x", "y", "z"], [0, 3, 5, 9], [0, 0, 0], [3, 2, 4]),
        (["x", "y", "z"], [0, 1, 2, 3], [3, 2, 4], [3, 2, 4]),
        (["z", "x"], [0, 1, 2], [5, 4], [4, 3]),
    ]
    for live, qsl, comp, plen in steps:
        for st in ranks:
            st.sync(live, extra.get)
            st.prepare_step(live, np.array(qsl), np.array(comp), np.array(plen))
        assert torch.equal(ranks[0].index, ranks[1].index)
        assert torch.equal(ranks[0].pool, ranks[1].pool)


def test_unregistered_vector_in_worker_fails_loudly():
    st = _state()
    with pytest.raises(RuntimeError, match="not registered in the worker"):
        st.sync(["r"], {"r": _spec(("missing", 0, 1.0, "all"))}.get)


def test_model_runner_v2_seam_host_logic():
    """The MRV2 ModelState subclass drives the same state from vLLM's V2 batch objects (GPU only
    at run time; here its host logic, fed objects with the V2 InputBatch/RequestState fields)."""
    from types import SimpleNamespace as NS

    from steerserve.engine.runner import steering_model_state_cls

    cls = steering_model_state_cls()
    ms = cls.__new__(cls)  # the real __init__ needs a GPU runner
    ms.rope_state = ms.prompt_embeds_state = None
    ms.supports_mm_inputs = False
    ms._steer = st = _state()
    new = NS(req_id="s", sampling_params=NS(extra_args=_spec(("a", 1, 2.0, "all"))))
    ms.add_request(3, new)
    ms.add_request(0, NS(req_id="u", sampling_params=NS(extra_args=None)))
    batch = NS(
        num_reqs=2,
        req_ids=["u", "s"],
        idx_mapping_np=np.array([0, 3]),
        query_start_loc_np=np.array([0, 1, 4]),
        num_computed_tokens_np=np.array([5, 0]),
    )
    req_states = NS(prompt_len=NS(np=np.array([2, 0, 0, 3])))
    assert ms.prepare_inputs(batch, req_states) == {}
    d = _delta(st, 1, 4)
    assert torch.equal(d[0], torch.zeros(H))
    assert torch.equal(d[1:], (2.0 * st.vectors["a"]).expand(3, H))
    ms.prepare_dummy_inputs(4, 4)
    assert int(st.index.abs().sum()) == 0
    ms.remove_request("s")
    assert st.info()["live_steered"] == 0


class _Block(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 1.0, x


def test_hook_skips_layers_no_running_request_steers_and_adds_on_the_rest(monkeypatch):
    """Issue 23: an idle layer returns the block's own output (no op, no copy); a steered layer
    adds its rows; with ``skip_idle`` off (GPU graphs) or while traced, the op always runs."""
    import steerserve.engine.kernels as op

    calls: list[int] = []
    real = op._steer_add
    monkeypatch.setattr(op, "_steer_add", lambda h, i, p: calls.append(1) or real(h, i, p))
    st = _state()
    blocks = [_Block() for _ in range(4)]
    st.attach(blocks, range(4))
    x = torch.randn(3, H)
    args = (["r0", "r1"], np.array([0, 2, 3]), np.array([0, 5]), np.array([2, 3]))
    st.sync(["r0", "r1"], lambda r: None)
    st.prepare_step(*args)
    out = [b(x)[0] for b in blocks]
    assert calls == [] and all(torch.equal(o, x) for o in out)
    st.sync(["r0", "r2"], lambda r: _spec(("a", 2, 1.0, "all")) if r == "r2" else None)
    st.prepare_step(["r0", "r2"], *args[1:])
    hidden = [b(x)[0] for b in blocks]
    assert len(calls) == 1  # layer 2 only
    assert torch.equal(hidden[2][:2], x[:2]) and torch.equal(hidden[2][2], x[2] + st.vectors["a"])
    assert all(torch.equal(hidden[i], x) for i in (0, 1, 3))
    st.sync(["r0"], lambda r: None)  # r2 finished: layer 2 idle again
    calls.clear()
    st.prepare_step(["r0"], np.array([0, 1]), np.array([6]), np.array([2]))
    [b(x[:1]) for b in blocks]
    assert calls == []
    st.skip_idle = False
    [b(x[:1]) for b in blocks]
    assert len(calls) == 4


def test_degeneracy_check_flags_only_steered_rows_with_a_zero_or_non_finite_state():
    """The worker's check (issue 60): of a step's requests, only the steered ones are read, and
    one is flagged when its final hidden state is zero (an overflowed stream after RMSNorm) or
    not finite; a sound state, an unsteered request and a call of another shape are not."""
    st = _state()
    st.sync(["u", "s1", "s2", "s3"], {"s1": _spec(("a", 1, 1.0, "all")), "s2": _spec(
        ("a", 1, 1.0, "all")), "s3": _spec(("b", 2, 1.0, "all"))}.get)  # fmt: skip
    qsl = np.arange(5, dtype=np.int32)
    st.prepare_step(["u", "s1", "s2", "s3"], qsl, np.full(4, 3, np.int32), np.full(4, 2, np.int32))
    hidden = torch.randn(4, H)
    hidden[0] = 0.0  # unsteered: not the check's business
    hidden[2] = 0.0
    hidden[3, 1] = float("nan")
    st.check_sampled(hidden[:3])  # another row count (prompt logprobs): ignored, disarms
    assert st.take_degenerate() == []
    st.prepare_step(["u", "s1", "s2", "s3"], qsl, np.full(4, 3, np.int32), np.full(4, 2, np.int32))
    st.check_sampled(hidden)
    assert st.take_degenerate() == ["s2", "s3"]
    assert st.take_degenerate() == []  # taken once
    st.prepare_step(["u"], qsl[:2], np.full(1, 3, np.int32), np.full(1, 2, np.int32))
    st.check_sampled(hidden[:1])  # nothing steered in the step: nothing read
    assert st.take_degenerate() == []


def test_degenerate_flags_merge_into_the_runner_output_field():
    from types import SimpleNamespace

    from steerserve.engine import degenerate

    out = SimpleNamespace(num_nans_in_logits=None)
    degenerate.merge(out, ["r1"])
    degenerate.merge(SimpleNamespace(_model_runner_output=out), ["r2"])
    assert out.num_nans_in_logits == {"r1": 1, "r2": 1}
    degenerate.merge(SimpleNamespace(), ["r3"])  # no such field: nothing to do, no error
