"""The transformers runner's mechanics on a tiny random Gemma 3: forced log P, greedy, and edits
against plain full forwards and the transformers steering reference."""

from __future__ import annotations

import pytest
import torch

from steerserve.engine.spec import SteeringEntry
from steerserve.tune.reference import greedy, phases, steering_hooks
from steerserve.tune.runner import Runner, decided, encode, entry_edits
from steerserve.tune.scorer import score
from steerserve.tune.scoring import summarise

RECORDS = [
    {"id": "a", "lang": "en", "prompt": "Country: France. Capital:", "answers": ["Paris", "Pa"]},
    {"id": "b", "lang": "fr", "prompt": "Pays : Japon. Capitale :", "answers": ["Tokyo"]},
    {"id": "c", "lang": "ja", "prompt": "国：フランス。首都：", "answers": ["パリ"]},
    {"id": "d", "lang": "fr", "prompt": "Pays : Italie. Capitale :", "answers": ["Rome"]},
]
for r in RECORDS:
    r["answers_en"] = ["Paris"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _forced_logp(runner: Runner, rec: dict, entries=(), vectors=None) -> float:
    """Max over aliases of the summed log P of the alias after the prompt, one full forward."""
    ids, aliases = encode(runner.tok, rec)
    best = -float("inf")
    for a in aliases:
        seq = ids + a
        ph = phases(len(seq), len(ids))
        masks = torch.stack([ph == k for k in range(3)]).unsqueeze(1)
        with torch.no_grad(), steering_hooks(runner.model, entries, vectors or {}, masks):
            lp = runner.model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
        best = max(best, sum(float(lp[len(ids) - 1 + k, t]) for k, t in enumerate(a)))
    return best


def test_forced_logp_and_greedy_match_full_forwards(runner: Runner) -> None:
    (res,) = runner.run(RECORDS, progress=False)
    for rec, r in zip(RECORDS, res, strict=True):
        assert r["logp"] == pytest.approx(_forced_logp(runner, rec), abs=1e-4)
        ids, _ = encode(runner.tok, rec)
        toks, _ = greedy(runner.model, ids, 8)
        ref = score(runner.tok.decode(toks, skip_special_tokens=True), rec["answers"], ["Paris"])
        assert (r["correct"], r["english"]) == (ref.correct, ref.english)


@pytest.mark.parametrize("positions", ["last_prompt_and_generated", "all", "generated", "pair"])
def test_entries_equal_reference_steering(runner: Runner, positions: str) -> None:
    g = torch.Generator().manual_seed(1)
    vecs = {n: torch.randn(runner.model.config.hidden_size, generator=g) for n in ("v", "w")}
    if positions == "pair":  # two entries in one step add up, as in the engine
        entries = [SteeringEntry("v", 1, 0.7, "last_prompt_and_generated"),
                   SteeringEntry("w", 2, -0.5, "all")]  # fmt: skip
    else:
        entries = [SteeringEntry("v", 1, 0.7, positions)]
    (res,) = runner.run(RECORDS, [entry_edits(entries, vecs)], False)
    for rec, r in zip(RECORDS, res, strict=True):
        assert r["logp"] == pytest.approx(_forced_logp(runner, rec, entries, vecs), abs=1e-3)
        assert r["logp"] != pytest.approx(_forced_logp(runner, rec), abs=1e-3)
        ids, _ = encode(runner.tok, rec)
        toks, _ = greedy(runner.model, ids, 8, entries, vecs)
        text = runner.tok.decode(toks, skip_special_tokens=True)
        assert r["correct"] == score(text, rec["answers"], ["Paris"]).correct


@pytest.mark.parametrize("positions", ["last_prompt_and_generated", "all", "generated"])
@pytest.mark.parametrize(("op", "scale"), [("ablate", 1.0), ("replace", 0.5), ("interp", 0.4)])
def test_every_op_equals_reference_steering(
    runner: Runner, op: str, scale: float, positions: str
) -> None:
    """The runner applies an op through the registry's reference, as the oracle does, with an
    add on the same layer after it (the stated order) whatever order they are listed in."""
    g = torch.Generator().manual_seed(2)
    vecs = {n: torch.randn(runner.model.config.hidden_size, generator=g) for n in ("v", "w")}
    entries = [SteeringEntry("w", 1, 0.5, "all"), SteeringEntry("v", 1, scale, positions, op)]
    (res,) = runner.run(RECORDS, [entry_edits(entries, vecs)], False)
    for rec, r in zip(RECORDS, res, strict=True):
        assert r["logp"] == pytest.approx(_forced_logp(runner, rec, entries, vecs), abs=1e-3)


def test_decided_and_summary() -> None:
    paris = {"answers": ["Paris"], "answers_en": []}
    parigi = {"answers": ["Parigi"], "answers_en": ["Paris"]}
    assert not decided(" Par", paris)
    assert decided(" Paris", paris)
    assert decided(" Rome", {"answers": ["Paris"], "answers_en": ["Paris"]})
    assert not decided(" Pa", parigi)
    assert decided(" Pa\n", parigi)
    chat = {"messages": [], "lang": "fr", "answers": ["Paris"]}
    assert not decided("Rome", chat)  # a chat reply may still name the answer later
    assert decided("It is Paris", chat)
    assert decided("Rome\n", chat)
    recs = [{"lang": lang} for lang in ("en", "fr", "fr", "ja")]
    res = [{k: x for k in ("correct", "logp", "logp_tok", "english", "chinese", "recall_any")}
           for x in (1.0, 0.0, 1.0, 1.0)]  # fmt: skip
    s = summarise(recs, res, res)
    assert s["correct"]["non_en"] == pytest.approx(0.75)  # mean of fr 0.5 and ja 1.0
    assert s["logp"]["diff_non_en"]["diff"] == 0.0


CHAT = {
    "id": "c",
    "lang": "ja",
    "messages": [
        {"role": "system", "content": "名前だけで答えてください。"},
        {"role": "user", "content": "フランスの首都はどこですか？"},
    ],
    "answers": ["パリ", "巴里"],
    "answers_en": ["Paris"],
    "answers_zh": ["巴黎"],
}


def test_chat_records_are_rendered_as_served_and_scored_by_the_chat_rule(runner: Runner) -> None:
    from steerserve.models.chat import chat_ids
    from steerserve.tune.scorer import score_record

    ids, aliases = encode(runner.tok, CHAT)
    assert ids == chat_ids(runner.tok, CHAT["messages"])
    assert aliases == [runner.tok("パリ", add_special_tokens=False)["input_ids"],
                       runner.tok("巴里", add_special_tokens=False)["input_ids"]]  # fmt: skip
    (res,) = runner.run([CHAT], progress=False)
    best = -float("inf")
    for a in aliases:
        with torch.no_grad():
            lp = runner.model(torch.tensor([ids + a])).logits[0].float().log_softmax(-1)
        best = max(best, sum(float(lp[len(ids) - 1 + k, t]) for k, t in enumerate(a)))
    assert res[0]["logp"] == pytest.approx(best, abs=1e-4)
    toks, _ = greedy(runner.model, ids, 8)
    text = runner.tok.decode([t for t in toks if t != 2], skip_special_tokens=True)
    assert res[0]["correct"] == score_record(CHAT, text).correct
