"""The server-side A/B experiment (``--ab-split``) over real HTTP on the tiny Llama: a sticky,
balanced split by user, the arm in every answer, metric and log line, explicit steering winning,
feedback joined to the arm. One server (a start costs most of the time); the same arms after a
restart: tests/server/test_server_process.py, whose two ``steerserve serve`` processes run one
experiment."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server import (
    AUTH,
    FR,
    Server,
    chat_body,
    metric,
    tiny_server,
    tiny_settings,
)

from steerserve.server.ab import metrics
from steerserve.server.ab.experiment import DecisionLog, Experiment

NAME = "exp-1"
USERS = [f"user-{i}" for i in range(200)]


def _ab(root: Path, **kw: Any) -> dict[str, Any]:
    """:func:`tiny_settings` keywords of this module's experiment: the artifacts of root/vectors,
    half the users steered, decisions logged to root/ab.jsonl (``kw``: more settings)."""
    ab = {"ab_split": 0.5, "ab_name": NAME, "ab_log": str(root / "ab.jsonl")}
    return {"vectors": root / "vectors", **ab, **kw}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, root: Path) -> Iterator[Server]:
    with tiny_server(tiny_llama, **_ab(root, ab_log_content=True)) as srv:
        yield srv


def ask(http: httpx.Client, user: str | None = None, header: bool = False, **kw: Any) -> Any:
    """One short French chat as ``user`` (in the ``user`` field or the subject header)."""
    body = chat_body(FR, max_tokens=1, **kw)
    headers = {}
    if user is not None and header:
        headers["x-steerserve-subject"] = user
    elif user is not None:
        body["user"] = user
    r = http.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    steering = r.json()["steering"]
    exp = steering.get("experiment")
    if exp is not None:  # the header says what the body says
        assert json.loads(r.headers["x-steerserve-steering"])["experiment"] == {
            k: v for k, v in exp.items() if v is not None
        }
    return r.json()


def arms(http: httpx.Client, users: list[str], header: bool = False) -> dict[str, str]:
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda u: ask(http, u, header), users))
    for a in answers:  # the steered arm is steered (auto: the French prompt), the other not
        exp = a["steering"]["experiment"]
        assert a["steering"]["applied"] is (exp["arm"] == "steered"), a["steering"]
    return {u: a["steering"]["experiment"]["arm"] for u, a in zip(users, answers, strict=True)}


def log_lines(root: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (root / "ab.jsonl").read_text().splitlines()]


def test_split_is_balanced_and_sticky(http: httpx.Client) -> None:
    """200 users split within binomial bounds, each as the hash says, the same on a repeat
    whether the subject comes as ``user`` or as the header."""
    first = arms(http, USERS)
    steered = sum(a == "steered" for a in first.values())
    assert 100 - 4 * 7.1 <= steered <= 100 + 4 * 7.1, steered  # binomial(200, 0.5): sd 7.1
    assert first == {u: Experiment(NAME, 0.5).assign(u).arm for u in USERS}
    assert arms(http, USERS[:40], header=True) == {u: first[u] for u in USERS[:40]}


def test_explicit_steering_wins_and_no_subject_is_unenrolled(http: httpx.Client) -> None:
    steered = next(u for u in USERS if Experiment(NAME, 0.5).assign(u).arm == "steered")
    unsteered = next(u for u in USERS if Experiment(NAME, 0.5).assign(u).arm == "unsteered")
    off = ask(http, steered, steering=False)["steering"]
    assert off["applied"] is False and "experiment" not in off
    on = ask(http, unsteered, steering=True)["steering"]
    assert on["applied"] is True and "experiment" not in on
    alone = ask(http)["steering"]  # no subject: the server's default (off), marked
    assert alone["applied"] is False and alone["policy"] == "off"
    assert alone["experiment"] == {"name": NAME, "arm": "unenrolled", "subject_hash": None}
    r = http.post("/v1/chat/completions/ab", json=chat_body(FR, max_tokens=2, user=steered))
    assert r.status_code == 200, (
        r.text
    )  # issue 57: an A/B pair is recorded as one, for a preference
    assert {r.json()[a]["steering"]["experiment"]["arm"] for a in ("steered", "unsteered")} == {
        "pair"
    }


def test_metrics_and_log_carry_the_arm(server: Server, http: httpx.Client, root: Path) -> None:
    decided = [x for x in log_lines(root) if x["type"] == "decision"]
    lines = [x for x in decided if x["arm"] != "pair"]  # the /ab pair: one line of its own
    assert len(lines) == len(USERS) + 40 and len(decided) == len(lines) + 1  # enrolled only
    for arm in ("steered", "unsteered"):
        mine = [x for x in lines if x["arm"] == arm]
        labels = {"experiment": NAME, "arm": arm}
        assert metric(http, "steerserve_ab_requests_total", **labels, status="200") == len(mine)
        assert metric(http, "steerserve_ab_request_latency_seconds_count", **labels) == len(mine)
        tokens = sum(x["prompt_tokens"] + x["completion_tokens"] for x in mine)
        assert metric(http, "steerserve_ab_tokens_total", **labels) == tokens
    assert metric(http, "steerserve_ab_requests_total", arm="unenrolled") >= 1
    x = lines[0]
    assert x["experiment"] == NAME and x["model"] == "llama" and x["language"] == "fr"
    assert x["latency_ms"] > 0 and x["completion_tokens"] == 1 and x["id"].startswith("chatcmpl-")
    by_hash = {a.subject_hash: a.arm for a in map(Experiment(NAME, 0.5).assign, USERS)}
    assert all(by_hash[x["subject_hash"]] == x["arm"] for x in lines)
    assert x["vectors"] == (["tiny/v1/recall", "tiny/v1/translation"] if x["applied"] else [])
    assert x["prompt"] == [FR] and len(x["reply"]) == 1  # --ab-log-content (tested off alone)
    # issue 56: what the automatic metrics stand on, recorded for every answer of both arms
    for y in lines:
        assert len(y["reply_language"]) == 1 and y["finish_reason"] == ["length"], y
    automatic = metrics.automatic(x)
    assert automatic["truncated"] == 1.0 and automatic["failed"] == 0.0, automatic
    # a streamed answer: its reply as streamed, its tokens
    body = chat_body(FR, max_tokens=3, user=USERS[3], stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    arm = Experiment(NAME, 0.5).assign(USERS[3]).arm
    assert chunks[0]["steering"]["experiment"]["arm"] == arm
    last = log_lines(root)[-1]
    assert (last["reply"], last["completion_tokens"], last["arm"]) == ([text], 3, arm)
    assert last["finish_reason"] == ["length"] and len(last["reply_language"]) == 1
    # a full disk: still answered, counted, not per request in the server's log
    state = server.app.state.steer
    kept, state.decisions.log = (
        state.decisions.log,
        DecisionLog("/dev/full", on_failure=state.metrics.ab_log_failures.inc),
    )
    try:
        ask(http, USERS[0])
        ask(http, USERS[1])
    finally:
        state.decisions.log = kept
    assert metric(http, "steerserve_ab_log_failures_total") == 2


def test_feedback_joins_the_arm(server: Server, http: httpx.Client, root: Path) -> None:
    from steerserve.server.ab.analysis import read_log

    rid = ask(http, USERS[2])["id"]
    r = http.post("/v1/steering/feedback", json={"id": rid, "score": 1})
    assert r.status_code == 200, r.text
    want = Experiment(NAME, 0.5).assign(USERS[2]).arm
    assert r.json() == {
        "object": "steering.feedback",
        "id": rid,
        "score": 1.0,
        "experiment": NAME,
        "arm": want,
        "language": "fr",
    }
    row = next(x for x in read_log(root / "ab.jsonl") if x.id == rid)
    assert (row.arm, row.score) == (want, 1.0)
    written = (root / "ab.jsonl").read_bytes()
    for body, status, param in (
        ({"id": "chatcmpl-nope", "score": 1}, 404, "id"),
        (b'{"id": "%s", "score": NaN}' % rid.encode(), 400, "score"),
        ({"id": rid, "score": "1"}, 400, "score"),
        ({"score": 1}, 400, "id"),
        # issue 56: the metric registry's checks, before anything is written
        ({"id": rid, "score": 2}, 400, "score"),
        ({"id": rid, "score": 1, "metric": "nope"}, 400, "metric"),
        ({"id": rid, "score": 1, "metric": "language_match"}, 400, "metric"),
        ({"id": rid, "score": 1, "metric": ["feedback"]}, 400, "metric"),
    ):
        kw = {"json": body} if isinstance(body, dict) else {"content": body}
        r = http.post("/v1/steering/feedback", **kw, headers={"content-type": "application/json"})
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert (root / "ab.jsonl").read_bytes() == written  # refused: nothing written
    r = httpx.post(f"{server.url}/v1/steering/feedback", json={"id": rid, "score": 1})
    assert r.status_code == 401  # the API key, as every /v1 endpoint
    # the report on this log: one scored reply calls no winner
    from typer.testing import CliRunner

    from steerserve.cli import app

    out = CliRunner().invoke(app, ["ab-report", str(root / "ab.jsonl"), "--out", str(root / "r")])
    assert out.exit_code == 0, out.output
    assert f"## Experiment `{NAME}`" in out.output and "too few scored replies" in out.output
    assert {p.name for p in (root / "r").iterdir()} == {"report.md", "report.json", "report.png"}


def test_a_stream_hung_up_at_done_keeps_its_decision(server: Server, root: Path) -> None:
    """A client that closes the connection as soon as it reads ``[DONE]`` has its whole answer:
    its decision is logged (the soak's clients, doing that, lost 5 lines of 191 as 499s)."""
    ids = []
    for user in USERS[:8]:
        body = chat_body(FR, max_tokens=2, user=user, stream=True)
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:  # its own connection
            with c.stream("POST", "/v1/chat/completions", json=body) as s:
                assert s.status_code == 200
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        rid = json.loads(line[6:])["id"]
                    if line == "data: [DONE]":
                        break  # and hang up: the response is closed unread
        ids.append(rid)
    logged = {x["id"] for x in log_lines(root) if x["type"] == "decision"}
    assert set(ids) <= logged, set(ids) - logged


def test_bad_experiment_settings_refuse_to_start(tiny_llama: Path, tmp_path: Path) -> None:
    """A split outside [0, 1] (refused by the settings, as every start validates them) or an
    unwritable log (refused by the app): no server, and the CLI says the same naming the option;
    a split without any artifact to steer with: the start fails before the engine."""
    from typer.testing import CliRunner

    from steerserve.cli import app
    from steerserve.server import create_app

    (tmp_path / "vectors").mkdir()
    for field, value, option in (
        ("ab_split", 1.5, "--ab-split"),
        ("ab_log", "/dev/null/x", "--ab-log"),
    ):
        with pytest.raises(ValueError, match=f"{field}|{option}"):
            create_app(tiny_settings(tiny_llama, **_ab(tmp_path, **{field: value})))
        out = CliRunner().invoke(app, ["serve", f"{option}={value}"])
        assert out.exit_code == 2 and option in out.output, out.output
    srv = Server(create_app(tiny_settings(tiny_llama, **_ab(tmp_path))))
    try:
        with pytest.raises(RuntimeError, match="--ab-split"):
            srv.start(timeout=60)
    finally:
        srv.stop()


def test_the_steered_arm_is_auto_unless_the_default_is_on() -> None:
    """The server's default ``off`` does not empty the steered arm (the split is the opt-in);
    it steers what ``auto`` would (this module's server runs with the default, and its steered
    French requests are steered); ``on`` extends it to English prompts."""
    from steerserve.server.steering import Auto, Off, On

    assert all(isinstance(Experiment.steering("unsteered", d), Off) for d in ("off", "on", "auto"))
    assert isinstance(Experiment.steering("steered", "off"), Auto)
    assert isinstance(Experiment.steering("steered", "auto"), Auto)
    assert isinstance(Experiment.steering("steered", "on"), On)


def test_anthropic_messages_are_enrolled_by_metadata_user_id(
    http: httpx.Client, root: Path
) -> None:
    """/v1/messages names its subject as Anthropic does (``metadata.user_id``): the arm the
    split gives that user, in the decision log; without one, unenrolled (both were a 500)."""
    ids = {}
    for user in USERS[:6]:
        body = {"model": "llama", "max_tokens": 1, "metadata": {"user_id": user}}
        body["messages"] = [{"role": "user", "content": FR}]
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        ids[r.json()["id"]] = Experiment(NAME, 0.5).assign(user).arm
    logged = {x["id"]: x["arm"] for x in log_lines(root) if x["type"] == "decision"}
    assert {i: logged.get(i) for i in ids} == ids
    body = {"model": "llama", "max_tokens": 1, "messages": [{"role": "user", "content": ""}]}
    assert http.post("/v1/messages", json=body).status_code == 200
