"""The scorer audit: blind samples and the agreement of scorer and readers."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from steerserve.cli import app
from steerserve.research import audit
from steerserve.research.replies import Generation, judge, write_replies


def _replies() -> list:
    recs = [audit.chat_records()[i] for i in ("capital_of:FR:ja", "capital_of:FR:fr")]
    ja, fr = recs
    return [
        judge(ja, "unsteered", Generation("フランスの首都はパリです。", 8)),
        judge(ja, "both", Generation("フランスの首都はParisです。", 8)),
        judge(fr, "unsteered", Generation("Paris", 2)),
        judge(fr, "both", Generation("Lyon", 2)),
    ]


def test_sample_is_blind_and_compare_counts_errors(tmp_path: Path) -> None:
    reps = _replies()
    rows = audit.sample(reps, {"ja": 2, "fr": 1}, seed=1)
    assert len(rows) == 3 and all("verdict" not in r and "why" not in r for r in rows)
    assert rows[0]["question"].startswith("フランス")
    judged = [
        {"key": "unsteered|capital_of:FR:ja", "correct": True, "script": "query"},
        {"key": "both|capital_of:FR:ja", "correct": True, "script": "latin"},  # a lenient reader
        {"key": "both|capital_of:FR:fr", "correct": True, "script": "query", "note": "x"},
    ]
    res = audit.compare(judged, reps)
    assert res["all"]["n"] == 3
    assert res["all"]["false_negative"] == {"k": 2, "n": 3, "rate": 2 / 3}
    assert res["all"]["false_positive"] == {"k": 0, "n": 0, "rate": None}
    assert res["ja/ko"]["script_agrees"]["k"] == 2
    assert {d["key"] for d in res["disagreements"]} == {
        "both|capital_of:FR:ja",
        "both|capital_of:FR:fr",
    }


def test_audit_commands(tmp_path: Path) -> None:
    path = write_replies(tmp_path / "replies.jsonl", _replies())
    blind = tmp_path / "blind.jsonl"
    res = CliRunner().invoke(app, ["lab", "audit-sample", str(path), "--out", str(blind),
                                   "--per-lang", "ja=2,fr=2"])  # fmt: skip
    assert res.exit_code == 0 and "wrote 4 replies" in res.output, res.output
    rows = audit.read_jsonl(blind)
    judged = tmp_path / "judged.jsonl"
    audit.write_jsonl(judged, [{**r, "correct": False, "script": "query"} for r in rows])
    res = CliRunner().invoke(app, ["lab", "audit-score", str(path), str(judged), "--out",
                                   str(tmp_path / "a.json")])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "all: n=4 false positives 2/4, false negatives 0/0" in res.output


def test_rescore_rebuilds_a_report_from_kept_replies(tmp_path: Path, tiny_llama: Path) -> None:
    """A report rebuilt from replies.jsonl by today's scorer, with no model."""
    import json

    from steerserve.research import evaluate as ev
    from steerserve.research import rescore as rs
    from steerserve.research.scoring import score_all

    reps = _replies()
    recs = [audit.chat_records()[i] for i in ("capital_of:FR:ja", "capital_of:FR:fr")]
    results = {}
    for arm in ("unsteered", "both"):
        mine = [r for r in reps if r.arm == arm]
        res = score_all(recs, [r.text for r in mine])
        res.replies = mine
        results[arm] = res
    report = ev.build_report(recs, results, {"model": "m", "n_items": 2})
    ev.write_report(report, tmp_path, results)
    # a reply's stored verdict is stale: the rescore recomputes it from the text
    lines = (tmp_path / "replies.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    lines[0] = json.dumps({**first, "verdict": "wrong", "why": "stale"}, ensure_ascii=False)
    (tmp_path / "replies.jsonl").write_text("\n".join(lines) + "\n")
    cut = rs.capped(tmp_path, [1], tiny_llama)  # the byte-level tiny tokenizer: 1 byte
    assert cut["unsteered"][0] == 1.0 and cut["unsteered"][1] == 0.0  # whole vs one byte
    new = rs.run(tmp_path)
    assert new["rescored"] and new["arms"]["unsteered"]["per_language"]["ja"]["accuracy"] == 1.0
    assert json.loads((tmp_path / "replies.jsonl").read_text().splitlines()[0])["verdict"] == (
        "correct"
    )
