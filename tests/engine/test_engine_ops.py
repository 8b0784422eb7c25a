"""The operations registry (``engine/ops.py``) without an engine: every copy of the steering
vocabulary derives from it, the kernel equals each op's reference, the stated order, validation,
the wire form and the cache salt. The ops in a real engine: tests/engine/test_engine_llama.py and
tests/engine/test_engine_gemma.py."""

from __future__ import annotations

import dataclasses
import hashlib
import typing

import numpy as np
import pytest
import torch

from steerserve.engine import ops, prefix, spec
from steerserve.engine.buffers import SteeringState
from steerserve.engine.ops import DEFAULT_OP, OPS, engine_ops
from steerserve.engine.registry import VectorRegistry
from steerserve.engine.spec import POSITIONS, SteeringEntry, SteeringError

H = 16


def test_every_row_is_complete():
    assert DEFAULT_OP in OPS and OPS[DEFAULT_OP].additive and OPS[DEFAULT_OP].gguf
    assert set(engine_ops()) >= {"add", "ablate", "replace", "interp"}
    for op in OPS.values():
        assert callable(op.reference) and op.formula
        # the engine runs an additive op in the delta pool, any other in the affine kernel
        assert (op.delta is not None) == op.additive or not op.engine, op.name
        assert (op.affine is None) == op.additive or not op.engine, op.name
        assert not op.gguf or op.additive, f"{op.name}: llama.cpp only adds"
    assert OPS["interp"].scale_range == (0.0, 1.0)
    assert OPS["ablate"].needs_direction


def test_every_copy_derives_from_the_registry():
    """The entry is described in one place: these are the copies that must agree with it."""
    from steerserve.artifacts import Intervention
    from steerserve.server.answers import AppliedIntervention
    from steerserve.server.steering import _ENTRY_SCHEMA
    from steerserve.tune.calibrate import Setting
    from steerserve.tune.runner import Edit, entry_edits

    props = _ENTRY_SCHEMA["properties"]
    assert props["op"]["enum"] == list(engine_ops()) and props["op"]["default"] == DEFAULT_OP
    assert props["positions"]["enum"] == list(POSITIONS)
    fields = {f.name for f in dataclasses.fields(SteeringEntry)}
    assert set(props) == fields == spec.ENTRY_FIELDS
    bounded = {r["if"]["properties"]["op"]["const"]: r["then"] for r in _ENTRY_SCHEMA["allOf"]}
    assert bounded == {
        n: {"properties": {"scale": {"minimum": o.scale_range[0], "maximum": o.scale_range[1]}}}
        for n, o in OPS.items()
        if o.engine and o.scale_range
    }
    # the pydantic copies carry the entry's own field definitions (types, bounds, defaults)
    declared = spec.entry_fields()
    for model, leave_out in ((Intervention, {"vector"}), (AppliedIntervention, set())):
        for name, (typ, default) in declared.items():
            if name in leave_out:
                continue
            f, (kind, info) = model.model_fields[name], typing.get_args(typ)
            want = (kind, info.metadata, info.description, default is ...)
            assert (f.annotation, f.metadata, f.description, f.is_required()) == want, name
    assert Intervention.model_fields["op"].default == DEFAULT_OP
    with pytest.raises(ValueError, match="finite"):
        Intervention(name="v", tensor="v", layer=0, scale=float("nan"))
    # the research wing's settings and edits hold an entry, not a renamed copy of one
    for cls in (Setting, Edit):
        assert {f.name for f in dataclasses.fields(cls)} & fields == set(), cls
        assert dataclasses.fields(cls)[1].type in ("SteeringEntry", SteeringEntry)
    v = {"v": torch.ones(H)}
    for name in OPS:  # every op is a research edit
        Edit("e", SteeringEntry("v", 1, 1.0, "all", name), torch.ones(H))
    with pytest.raises(ValueError, match="unknown op"):
        Edit("e", SteeringEntry("v", 1, 1.0, "all", "rotate"), torch.ones(H))
    for pos, phases in POSITIONS.items():
        for name in engine_ops():
            (e,) = entry_edits([SteeringEntry("v", 1, 0.5, pos, name)], v)
            assert (e.entry.op, e.entry.scale) == (name, 0.5)
            assert e.phases == set(phases), (pos, name)


class _Block(torch.nn.Module):
    """A stand-in decoder layer returning vLLM's split stream ``(hidden, residual)``."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, r


def _state(dtype_vectors: dict[str, torch.Tensor], **kw) -> tuple[SteeringState, list[_Block]]:
    st = SteeringState(num_layers=3, hidden_size=H, max_num_seqs=4, max_num_tokens=32,
                       rows_per_request=4, device="cpu", **kw)  # fmt: skip
    for name, v in dtype_vectors.items():
        st.register_vector(name, v, name)
    blocks = [_Block() for _ in range(3)]
    st.attach(blocks, range(3))
    return st, blocks


def _vectors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(H, generator=g) * 2, "b": torch.randn(H, generator=g)}


def _step(st: SteeringState, extra: dict, plen: int = 3, computed: int = 0, n: int = 4) -> None:
    ids = list(extra)
    st.sync(ids, extra.get)
    qsl = np.arange(0, n * len(ids) + 1, n)
    st.prepare_step(ids, qsl, np.full(len(ids), computed), np.full(len(ids), plen))


def _spec(*entries: SteeringEntry) -> dict:
    return {spec.EXTRA_ARGS_KEY: spec.encode(entries)}


@pytest.mark.parametrize("name", [n for n in engine_ops() if not OPS[n].additive])
def test_kernel_equals_the_reference_and_leaves_other_rows_alone(name):
    """Float32: the engine's affine kernel gives the reference's stream bit for bit on the
    steered request's tokens; the unsteered request's hidden and residual come out untouched."""
    vecs = _vectors()
    st, blocks = _state(vecs)
    e = SteeringEntry("a", 1, 0.7, "all", name)
    _step(st, {"u": None, "s": _spec(e)})
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(8, H, generator=g), torch.randn(8, H, generator=g)
    hx, hr = blocks[1](x, r)
    assert torch.equal(hx[:4], x[:4]) and torch.equal(hr[:4], r[:4])
    assert torch.equal(hr[4:], torch.zeros(4, H))
    assert torch.equal(hx[4:], OPS[name].reference(x[4:] + r[4:], vecs["a"], 0.7))
    assert blocks[0](x, r)[0] is x  # an idle layer: the block's own output


def test_bfloat16_stream_is_edited_in_float32():
    vecs = _vectors()
    st, blocks = _state(vecs)
    _step(st, {"s": _spec(SteeringEntry("a", 1, 1.0, "all", "ablate"))})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, H, generator=g).bfloat16()
    r = torch.randn(4, H, generator=g).bfloat16()
    hx, hr = blocks[1](x, r)
    assert hx.dtype == torch.bfloat16 and hr.dtype == torch.bfloat16
    want = OPS["ablate"].reference(x.float() + r.float(), vecs["a"], 1.0).bfloat16()
    assert torch.equal(hx, want)


def test_the_stated_order_non_additive_in_entry_order_then_add():
    vecs = _vectors()
    st, blocks = _state(vecs)
    entries = [SteeringEntry("b", 2, 1.5, "all"),  # listed first, applied last
               SteeringEntry("a", 2, 1.0, "all", "ablate"),
               SteeringEntry("b", 2, 0.25, "generated", "interp")]  # fmt: skip
    assert ops.ordered(entries) == entries[1:] + entries[:1]
    # two tokens of the prompt, then two generated ones
    _step(st, {"s": _spec(*entries)}, plen=2)
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)
    hx, hr = blocks[2](x, r)
    h = x + r
    a, b = vecs["a"], vecs["b"]
    ablated = OPS["ablate"].reference(h, a, 1.0)
    want = torch.cat([ablated[:2], OPS["interp"].reference(ablated[2:], b, 0.25)])
    want = OPS["add"].reference(want, b, 1.5)
    torch.testing.assert_close(hx + hr, want, rtol=0, atol=1e-6)
    # the transformers oracle applies the same order, whatever order the entries come in
    from steerserve.tune.reference import steering_hooks

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
    masks = torch.stack([torch.tensor([0, 1, 2, 2]) == k for k in range(3)]).unsqueeze(1)
    with steering_hooks(model, entries, vecs, masks):
        got = model.model.layers[2](h.unsqueeze(0))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_slots_release_and_an_idle_plugin_skips_both_kernels(monkeypatch):
    import steerserve.engine.kernels as op

    calls: list[str] = []
    real_add, real_edit = op._steer_add, op._steer_edit
    monkeypatch.setattr(op, "_steer_add", lambda *a: calls.append("add") or real_add(*a))
    monkeypatch.setattr(op, "_steer_edit", lambda *a: calls.append("edit") or real_edit(*a))
    st, blocks = _state(_vectors())
    x = torch.randn(4, H)
    _step(st, {"u": None})
    [b(x, x) for b in blocks]
    assert calls == []
    _step(st, {"s": _spec(SteeringEntry("a", 1, 1.0, "all", "replace"))})
    [b(x, x) for b in blocks]
    assert calls == ["edit"]  # layer 1: the edit kernel only (no add entry)
    assert st.info()["ops_per_layer"] == 2
    _step(st, {"u": None})  # s finished: its rows and slots are released, the index cleared
    assert int(st.op_index.abs().sum()) == 0 and not st._op_users.any()
    calls.clear()
    [b(x, x) for b in blocks]
    assert calls == []


def _compiled(blocks: list[_Block]):  # noqa: ANN202
    """The blocks as one traced function, as vLLM compiles a model (dynamic token count)."""

    def stack(x: torch.Tensor) -> torch.Tensor:
        r = x
        for b in blocks:
            x, r = b(x, r)
            x = x * 1.0 + r
        return x

    return stack, torch.compile(stack, backend="aot_eager", dynamic=True, fullgraph=True)


def test_compiled_ops_skip_by_their_gates_in_one_graph(monkeypatch):
    """Issue 48: traced, both ops stay in the graph; where ``skip_idle`` holds (CPU) their gates
    skip the arithmetic on a layer no running request uses, step by step, with no recompile, and
    the stream is the eager hook's; traced with it off (GPU graphs), both kernels always run."""
    from torch._dynamo.utils import counters

    import steerserve.engine.kernels as op

    calls: list[str] = []
    real_add, real_edit = op._steer_add, op._steer_edit
    monkeypatch.setattr(op, "_steer_add", lambda *a: calls.append("add") or real_add(*a))
    monkeypatch.setattr(op, "_steer_edit", lambda *a: calls.append("edit") or real_edit(*a))
    torch._dynamo.reset()
    st, blocks = _state(_vectors())
    eager, compiled = _compiled(blocks)
    steps = [
        ({"u": None}, []),
        ({"s": _spec(SteeringEntry("a", 0, 1.5, "all"))}, ["add"]),
        ({"u": None, "t": _spec(SteeringEntry("b", 1, 1.0, "all", "ablate"))}, ["edit"]),
        ({"u": None}, []),  # the ablating request left: no stale gate
    ]
    g = torch.Generator().manual_seed(1)
    graphs = counters["stats"]["unique_graphs"]  # process-wide: count this test's only
    for extra, want in steps:
        _step(st, extra)
        x = torch.randn(4 * len(extra), H, generator=g)
        calls.clear()
        got = compiled(x)
        assert calls == want, (list(extra), calls)
        torch.testing.assert_close(got, eager(x), rtol=0, atol=0)
        assert torch.equal(got, _compiled_ref(x)) == (not want)
    assert counters["stats"]["unique_graphs"] - graphs == 1, "a step traced another graph"
    st.skip_idle = False  # read when traced: a fresh trace always runs both ops
    torch._dynamo.reset()
    calls.clear()
    _compiled(blocks)[1](torch.randn(4, H, generator=g))
    assert calls == ["edit", "add"] * 3


def _compiled_ref(x: torch.Tensor) -> torch.Tensor:
    """The stack's stream with no steering (what ``_compiled``'s blocks compute unhooked)."""
    r = x
    for _ in range(3):
        x = x * 1.0 + r
    return x


def test_ops_per_layer_zero_keeps_the_edit_kernel_out():
    st, blocks = _state(_vectors(), ops_per_layer=0)
    st.skip_idle = False  # as on a GPU with graphs: every kernel that exists runs
    x = torch.randn(4, H)
    hx, hr = blocks[1](x, x)
    assert torch.equal(hx, x) and hr is x  # add's row 0 only: no edit ran (it would copy hr)
    with pytest.raises(SteeringError, match=r"steering\[0\]\.op: this engine serves additive"):
        spec.validate([SteeringEntry("a", 1, 1.0, "all", "ablate")], num_layers=3,
                      vectors={"a": 1}, ops_per_layer=0)  # fmt: skip


def _validate(entries, vectors=None, **kw):
    return spec.validate(entries, num_layers=4, vectors=vectors or {"a": 1}, **kw)


@pytest.mark.parametrize(
    ("item", "field", "message"),
    [
        ({"op": "rotate"}, "steering[0].op", "'rotate' is not one of add, ablate, replace, interp"),
        ({"op": None}, "steering[0].op", "None is not one of"),
        ({"op": "interp", "scale": 1.01}, "steering[0].scale", "1.01 is outside [0, 1]"),
        ({"op": "interp", "scale": -0.5}, "steering[0].scale", "-0.5 is outside [0, 1]"),
        ({"op": "ablate", "scale": float("inf")}, "steering[0].scale", "must be finite"),
        ({"op": "replace", "scale": "1"}, "steering[0].scale", "must be a number"),
    ],
)
def test_bad_ops_are_refused_naming_the_field(item, field, message):
    with pytest.raises(SteeringError) as e:
        _validate([{"vector": "a", "layer": 1} | item])
    assert e.value.field == field and message in e.value.reason


def test_an_op_the_engine_does_not_serve_is_refused(monkeypatch):
    lab_only = dataclasses.replace(OPS["replace"], name="patch", engine=False)
    monkeypatch.setitem(OPS, "patch", lab_only)
    assert "patch" not in engine_ops()
    with pytest.raises(SteeringError, match=r"steering\[1\]\.op: 'patch' is not implemented"):
        _validate([{"vector": "a", "layer": 1}, {"vector": "a", "layer": 1, "op": "patch"}])
    with pytest.raises(SteeringError, match=r"steering\[0\]\.op: 'patch' is not implemented"):
        _validate([SteeringEntry("a", 1, 1.0, "all", "patch")])


def test_zero_vector_ablation_and_budgets():
    reg = VectorRegistry(H)
    reg.add("a", torch.ones(H))
    reg.add("zero", torch.zeros(H))
    _validate([{"vector": "zero", "layer": 1}], reg)  # adding nothing is allowed
    with pytest.raises(SteeringError, match=r"steering\[0\]\.vector: ablate needs a non-zero"):
        _validate([{"vector": "zero", "layer": 1, "op": "ablate"}], reg)
    three = [{"vector": "a", "layer": 1, "op": "ablate", "positions": p}
             for p in ("all", "generated", "last_prompt_and_generated")]  # fmt: skip
    with pytest.raises(SteeringError, match=r"steering\[2\]\.op: more than 2 non-additive"):
        _validate(three, reg, ops_per_layer=2)
    _validate(three[:1] + three[2:], reg, ops_per_layer=2)  # distinct tokens on one layer
    spread = [{"vector": "a", "layer": i, "op": "replace"} for i in range(4)] + three[:1]
    with pytest.raises(SteeringError, match="needs 5 non-additive entries"):
        _validate(spread, reg, rows_per_request=4)


def test_plan_ops_takes_slots_in_entry_order():
    e = [SteeringEntry("a", 1, 1.0, "all", "ablate"),
         SteeringEntry("b", 1, 2.0, "all"),
         SteeringEntry("b", 1, 0.5, "generated", "interp"),
         SteeringEntry("a", 2, 1.0, "generated", "replace")]  # fmt: skip
    plans = spec.plan_ops(e)
    assert [(p.layer, p.op, p.slots) for p in plans] == [
        (1, "ablate", ((0, 0), (1, 0), (2, 0))),
        (1, "interp", ((2, 1),)),
        (2, "replace", ((2, 0),)),
    ]
    assert [r.terms for r in spec.plan_rows(e)] == [(("b", 2.0, "add"),)]  # only add is a delta


def test_wire_form_and_prefix_key():
    add = SteeringEntry("a", 1, 0.5, "generated")
    abl = dataclasses.replace(add, op="ablate")
    assert spec.encode([add]) == '[["a",1,0.5,"generated"]]'  # as before ops existed
    assert spec.encode([abl]) == '[["a",1,0.5,"generated","ablate"]]'
    both = (add, abl, SteeringEntry("b", 2, 0.3, "all", "interp"))
    assert spec.decode(spec.encode(both)) == both
    assert spec.decode([dataclasses.asdict(e) for e in both]) == both
    digests = {"a": "x", "b": "y"}
    legacy = hashlib.sha256(b"a|x|1|0.5|generated;").hexdigest()[:32]
    assert prefix.key([add], digests) == f"{legacy}:gen"  # add keeps its key
    key = prefix.key([abl], digests)
    assert key != prefix.key([add], digests) and key.endswith(":gen")  # still shares
    assert prefix.key([dataclasses.replace(abl, op="replace")], digests) != key


def test_references_broadcast_per_item_vectors():
    """The research runner's per-item vectors ``[R, 1, H]`` against ``[R, T, H]`` states."""
    g = torch.Generator().manual_seed(2)
    h, v = torch.randn(3, 5, H, generator=g), torch.randn(3, 1, H, generator=g)
    for name, op in OPS.items():
        out = op.reference(h, v, 0.5)
        assert out.shape == h.shape and out.dtype == h.dtype, name
        row = op.reference(h[1], v[1, 0], 0.5)
        torch.testing.assert_close(out[1], row, rtol=0, atol=1e-6)
    u = v / v.norm(dim=-1, keepdim=True)
    assert float((OPS["ablate"].reference(h, v, 1.0) * u).sum(-1).abs().max()) < 1e-5
