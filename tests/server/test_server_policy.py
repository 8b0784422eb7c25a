"""The steering policy and request parsing without an engine: fast, exhaustive on edge cases."""

from __future__ import annotations

import json

import pytest
import torch

from steerserve.artifacts import Artifact, Fingerprint, Intervention, Manifest, ModelBinding
from steerserve.engine.registry import VectorRegistry
from steerserve.engine.spec import SteeringEntry
from steerserve.server.answers import SteeringInfo
from steerserve.server.body import parse_request
from steerserve.server.errors import ApiError
from steerserve.server.generate.policy import Decision, LanguageDetector, SteeringPolicy
from steerserve.server.protocol import ChatCompletionRequest, CompletionRequest
from steerserve.server.steering import Multipliers, parse_steering

BINDING = ModelBinding(
    architecture="LlamaForCausalLM",
    num_layers=8,
    hidden_size=8,
    fingerprint=Fingerprint(config_sha256="c", embedding_sha256="e"),
)


def _artifact(version: str, registry: VectorRegistry) -> Artifact:
    ivs, tensors = [], {}
    for name, layer, scale in (("recall", 3, 4.0), ("translation", 5, -2.0)):
        vector = f"tiny/{version}/{name}"
        tensors[name] = torch.ones(8) * layer
        if vector not in registry:
            registry.add(vector, tensors[name])
        ivs.append(
            Intervention(name=name, tensor=name, layer=layer, scale=scale, positions="generated")
        )
    manifest = Manifest(name="tiny", version=version, model=BINDING, interventions=ivs)
    return Artifact(manifest, tensors)


class Policy(SteeringPolicy):
    """The policy fed raw JSON ``steering`` values, parsed as a request body parses them."""

    def resolve(self, raw: object, **kw: object) -> Decision:  # type: ignore[override]
        return super().resolve(parse_steering(raw), **kw)  # type: ignore[arg-type]


@pytest.fixture
def policy() -> SteeringPolicy:
    reg = VectorRegistry(8)
    p = Policy(reg, default="auto", max_abs_scale=10.0)
    p.add(_artifact("v1", reg))
    return p


def test_an_artifacts_ops_travel_through_true_auto_and_multipliers() -> None:
    reg = VectorRegistry(8)
    art = _artifact("v1", reg)
    ivs = art.manifest.interventions
    ivs = [ivs[0].model_copy(update={"op": "ablate"}),
           ivs[1].model_copy(update={"op": "interp", "scale": 0.25})]  # fmt: skip
    m = art.manifest.model_copy(update={"interventions": ivs})
    p = Policy(reg, default="auto", max_abs_scale=10.0)
    p.add(Artifact(m, art.tensors))
    multipliers = {"interventions": {"recall": 1.0, "translation": 2.0}}
    for raw, kw in ((True, {}), ("auto", {"language": "fr"}), (multipliers, {})):
        d = p.resolve(raw, **kw)
        assert [e.op for e in d.entries] == ["ablate", "interp"], raw
        assert [i.op for i in d.info(True).interventions] == ["ablate", "interp"]
    assert [e.scale for e in p.resolve({"interventions": {"translation": 4.0}}).entries] == [1.0]
    with pytest.raises(ApiError, match=r"gives scale 1.25 \(calibrated 0.25\), which is outside"
                       r" \[0, 1\] for op 'interp'") as e:  # fmt: skip
        p.resolve({"interventions": {"translation": 5.0}})
    assert e.value.param == "steering.interventions.translation"


def test_modes(policy: SteeringPolicy) -> None:
    assert policy.resolve(False).entries == ()
    on = policy.resolve(True)
    assert on.policy == "on"
    assert [e.vector for e in on.entries] == ["tiny/v1/recall", "tiny/v1/translation"]
    assert [e.scale for e in on.entries] == [4.0, -2.0]
    assert on.info(True).interventions[0].sha256 == policy.registry["tiny/v1/recall"].sha256[:12]
    assert policy.resolve("off").entries == () and policy.resolve("on").entries == on.entries
    # auto: on only for a detected non-English language
    assert policy.resolve("auto", language="en").entries == ()
    assert policy.resolve("auto", language=None).entries == ()
    fr = policy.resolve("auto", language="fr")
    assert fr.entries == on.entries and fr.info(True).detected_language == "fr"
    assert policy.resolve(None, language="ja").policy == "auto"  # the server default


def test_interventions_multiply_calibrated_scales(policy: SteeringPolicy) -> None:
    d = policy.resolve({"interventions": {"translation": 0.5}})
    assert d.entries == (SteeringEntry("tiny/v1/translation", 5, -1.0, "generated"),)
    assert d.info(True).interventions[0].name == "translation"
    assert d.info(False).interventions == []  # nothing is claimed when nothing was applied


@pytest.mark.parametrize(
    "raw,param,message",
    [
        ("yes", "steering", "not one of"),
        (3, "steering", "got int"),
        ([1], "steering", "got list"),
        ({"interventions": {"recal": 1}}, "steering.interventions.recal", "unknown intervention"),
        ({"interventions": {"recall": 3}}, "steering.interventions.recall", "outside"),
        ({"interventions": {"recall": True}}, "steering.interventions.recall", "finite number"),
        ({"interventions": {"recall": float("nan")}}, "steering.interventions.recall", "finite"),
        ({"interventions": {}}, "steering.interventions", "non-empty"),
        ({"interventions": [1]}, "steering.interventions", "non-empty"),
        ({"entries": []}, "steering.entries", "non-empty"),
        ({"entries": [], "artifact": "tiny"}, "steering", "cannot be combined"),
        ({"artifact": 3}, "steering.artifact", "string"),
        ({"artifact": "other"}, "steering.artifact", "not loaded"),
        ({"scale": 2}, "steering.scale", "unknown field"),
    ],
)
def test_refusals_name_the_field(
    policy: SteeringPolicy, raw: object, param: str, message: str
) -> None:
    with pytest.raises(ApiError) as e:
        policy.resolve(raw)
    assert e.value.status == 400 and e.value.param == param and message in e.value.message


def test_ab_forces_a_steered_arm(policy: SteeringPolicy) -> None:
    assert policy.resolve(None, force=True).policy == "on"
    assert policy.resolve("auto", language="en", force=True).entries
    with pytest.raises(ApiError, match="A/B"):
        policy.resolve(False, force=True)
    policy.default = "off"
    assert policy.resolve(None, force=True).entries  # absent means "on" for A/B


def test_no_artifact_refuses_instead_of_running_unsteered() -> None:
    p = Policy(VectorRegistry(8), default="off")
    for raw in (True, {"interventions": {"recall": 1}}):
        with pytest.raises(ApiError) as e:
            p.resolve(raw)
        assert e.value.code == "no_artifact"
    with pytest.raises(ApiError):
        p.resolve("auto", language="fr")
    assert p.resolve("auto", language="en").entries == ()


def test_artifact_choice(policy: SteeringPolicy) -> None:
    policy.add(_artifact("v10", policy.registry))
    policy.add(_artifact("v2", policy.registry))
    assert policy.default_artifact == "tiny/v1"  # the first loaded stays the default
    latest = policy.resolve({"artifact": "tiny"})  # a bare name: its latest version
    assert {e.vector.split("/")[1] for e in latest.entries} == {"v10"}
    pinned = policy.resolve({"artifact": "tiny/v2", "interventions": {"recall": 1}})
    assert [e.vector for e in pinned.entries] == ["tiny/v2/recall"]
    policy.add(policy.artifacts["tiny/v2"], make_default=True)
    assert policy.resolve(True).entries[0].vector == "tiny/v2/recall"


def test_entries_echo_known_and_unknown_vectors(policy: SteeringPolicy) -> None:
    policy.registry.add("adhoc", torch.zeros(8))
    d = policy.resolve(
        {
            "entries": [
                {"vector": "tiny/v1/recall", "layer": 2, "scale": 1.5},
                {"vector": "adhoc", "layer": 0},
            ]
        }
    )
    known, unknown = d.info(True).interventions
    assert (known.artifact, known.name, known.layer, known.scale) == ("tiny", "recall", 2, 1.5)
    assert (unknown.artifact, unknown.name, unknown.positions) == (None, "adhoc", "all")


@pytest.mark.parametrize(
    "text,lang",
    [
        ("What is the capital city of France? Please answer briefly.", "en"),
        ("Quelle est la capitale de la France ? Réponds brièvement.", "fr"),
        ("Was ist die Hauptstadt von Frankreich? Bitte antworte kurz.", "de"),
        ("¿Cuál es la capital de Francia? Responde brevemente.", "es"),
        ("日本の首都はどこですか", "ja"),
        ("한국의 수도는 어디입니까?", "ko"),
        ("Какая столица у Франции?", "ru"),
        ("", None),
        ("   ", None),
    ],
)
def test_language_detection(detector: LanguageDetector, text: str, lang: str | None) -> None:
    assert detector.detect(text) == lang


# --- protocol -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "m", "messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "a"}], "n": "2"}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": "yes"}, "stream"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "a"}], "stop": list("abcde")},
            "stop",
        ),
        ({"messages": [{"role": "user", "content": "a"}]}, "model"),
        ({"model": "m", "messages": "hi"}, "messages"),
    ],
)
def test_parse_errors_name_the_param(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(ChatCompletionRequest, json.dumps(body).encode())
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(param + ": ")


def test_parse_accepts_openai_shapes() -> None:
    req = parse_request(
        ChatCompletionRequest,
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi "},
                            {"type": "text", "text": "there"},
                        ],
                    },
                    {"role": "assistant", "content": "x", "refusal": None, "tool_calls": []},
                ],
                "stop": "\n",
                "stream": True,
                "stream_options": {"include_usage": True},
                "steering": {"interventions": {"recall": 1}},
            }
        ).encode(),
    )
    assert req.texts()[1] == "hi there" and req.stop == "\n"
    assert req.steering == Multipliers(interventions={"recall": 1.0})
    for prompt in ("a", ["a", "b"], [1, 2], [[1], [2, 3]]):
        c = parse_request(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}).encode())
        assert c.prompt == prompt and c.max_tokens == 16


def test_header() -> None:
    assert SteeringInfo(applied=False, policy="auto", detected_language="en").header() == "off"
    info = SteeringInfo(applied=True, policy="on", detected_language=None)
    assert json.loads(info.header()) == {"applied": True, "policy": "on", "interventions": []}
    assert " " not in info.header()


def test_auto_follows_the_artifacts_language_gate() -> None:
    """A gated artifact: auto steers fr at half its calibrated scales, leaves ko alone and says
    which languages it steers; true (on) ignores the gate."""
    from steerserve.artifacts import LanguageGate
    from steerserve.server.vetting import scale_refusal

    reg = VectorRegistry()
    art = _artifact("v7", reg)
    gates = {"fr": LanguageGate(multiplier=0.5), "ko": LanguageGate(multiplier=0)}
    gated = Artifact(art.manifest.model_copy(update={"languages": gates}), art.tensors)
    pol = Policy(reg, default="auto")
    pol.add(gated)
    fr = pol.resolve("auto", language="fr")
    assert [e.scale for e in fr.entries] == [2.0, -1.0] and fr.auto_languages == ("fr",)
    info = fr.info(True)
    assert info.auto_languages == ["fr"] and '"auto_languages":["fr"]' in info.header()
    ko = pol.resolve("auto", language="ko")
    assert ko.entries == () and ko.info(False).auto_languages == ["fr"]
    assert pol.resolve("auto", language="ja").entries == ()  # not listed
    assert [e.scale for e in pol.resolve(True, language="ko").entries] == [4.0, -2.0]
    plain = Policy(reg, default="auto")
    plain.add(_artifact("v8", reg))
    d = plain.resolve("auto", language="ko")
    assert [e.scale for e in d.entries] == [4.0, -2.0] and d.auto_languages is None
    assert "auto_languages" not in d.info(True).header()
    loud = {"fr": LanguageGate(multiplier=8)}
    big = Artifact(art.manifest.model_copy(update={"languages": loud}), art.tensors)
    assert "languages.fr.multiplier 8 gives intervention 'recall' scale 32" in (
        scale_refusal(big, 16.0) or ""
    )
