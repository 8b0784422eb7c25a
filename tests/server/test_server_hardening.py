"""Issue 21's reproductions over real HTTP, one per defect (``test_d<N>_...``), on one server: the
tiny Llama with a tiny artifact, no API key (loopback), an A/B experiment with a decision log.
Crafted bodies answer a 4xx in OpenAI's format and leave the keep-alive connection usable; an
error no handler typed is a 500 in that format with a request id; feedback is bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server import MODEL, Server, chat_body, make_artifact, metric, tiny_settings
from fastapi import Request
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from steerserve.server.ab.experiment import DecisionLog, Experiment
from steerserve.server.slow import timed_protocol

NAME = "hardening"
REQUEST_TIMEOUT = 5.0  # this server's deadline for a request to arrive in full (30 s served)
ENGINE = {"max_model_len": 128, "kv_cache_memory_bytes": 32 << 20}  # tiny_settings' engine, smaller


@pytest.fixture(scope="module")
def server(tiny_llama: Path, root: Path) -> Iterator[Server]:
    from steerserve.server import create_app

    ab = {"ab_split": 0.5, "ab_name": NAME, "ab_log": str(root / "ab.jsonl")}
    app = create_app(tiny_settings(tiny_llama, root / "vectors", ENGINE, api_key=None, **ab))

    async def boom() -> None:  # a route with a bug no handler knows: the catch-all's case
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom, include_in_schema=False)

    async def slow(request: Request) -> dict[str, int]:  # an app slower than the deadline
        body = await request.body()
        await asyncio.sleep(REQUEST_TIMEOUT + 2)
        return {"bytes": len(body)}

    app.add_api_route("/slow", slow, methods=["POST"], include_in_schema=False)
    srv = Server(app, http=timed_protocol(REQUEST_TIMEOUT), timeout_keep_alive=30)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _one_connection(server: Server, calls: list[tuple[str, str, bytes]]) -> list[tuple[int, Any]]:
    """``(method, path, body)`` sent one after another on a single keep-alive connection; raises
    when the server drops it (http.client reconnects only when told ``Connection: close``)."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=60)
    out = []
    try:
        for method, path, body in calls:
            conn.request(method, path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            assert r.getheader("connection") != "close", (path, body[:80])
            out.append((r.status, json.loads(data) if data else None))
    finally:
        conn.close()
    return out


#: ``positions`` values that raised TypeError (unhashable) instead of a 400.
BAD_POSITIONS: list[Any] = [[], ["all"], {}]


def _crafted_bodies() -> list[tuple[str, bytes]]:
    """Bodies whose ``steering`` made the server answer 500 (issue 21, defect 1), per route.
    A scale or multiplier of ``10**400`` is a JSON integer past float's range."""
    huge = "1" + "0" * 400
    steerings = [
        f'{{"interventions": {{"recall": {huge}}}}}',
        *(
            f'{{"entries": [{{"vector": "tiny/v1/recall", "layer": 1, "scale": {sign}{huge}}}]}}'
            for sign in ("", "-")
        ),
        *(
            json.dumps({"entries": [{"vector": "tiny/v1/recall", "layer": 1, "positions": p}]})
            for p in BAD_POSITIONS
        ),
    ]
    out = []
    for s in steerings:
        chat = json.dumps(chat_body("hi"))[:-1] + f', "steering": {s}}}'
        completion = json.dumps({"model": MODEL, "prompt": "hi"})[:-1] + f', "steering": {s}}}'
        out += [
            ("/v1/chat/completions", chat.encode()),
            ("/v1/chat/completions/ab", chat.encode()),
            ("/v1/completions", completion.encode()),
        ]
    return out


def test_d1_crafted_steering_is_400_and_keeps_the_connection(server: Server) -> None:
    """Defect 1: an integer scale or multiplier >= 2**1024 and ``positions`` given as ``[]``,
    ``["all"]`` or ``{}`` are 400s naming their field, on every route, and each follow-up on the
    same connection is answered."""
    calls = []
    for path, body in _crafted_bodies():
        calls += [("POST", path, body), ("GET", "/health", b"")]
    answers = _one_connection(server, calls)
    for (method, path, body), (status, data) in zip(calls, answers, strict=True):
        if method == "GET":
            assert status == 200
            continue
        assert status == 400, (path, body[:120], data)
        assert data["error"]["type"] == "invalid_request_error"
        assert data["error"]["param"].startswith("steering."), data


def test_catch_all_is_500_in_openai_form_and_keeps_the_connection(
    server: Server, http: httpx.Client
) -> None:
    """An error no handler typed: 500 ``server_error`` in OpenAI's format, with a request id in
    the message and ``x-request-id``, counted; the next request on the same connection works."""
    [(status, data), (after, _)] = _one_connection(
        server, [("GET", "/boom", b""), ("GET", "/health", b"")]
    )
    assert status == 500 and after == 200
    err = data["error"]
    assert err["type"] == "server_error" and "request id req-" in err["message"], err
    r = http.get("/boom")
    assert r.status_code == 500 and r.headers["x-request-id"] in r.json()["error"]["message"]


# --- feedback and subjects ------------------------------------------------------------------------


def _answer(http: httpx.Client, user: str) -> dict[str, Any]:
    r = http.post(
        "/v1/chat/completions", json=chat_body("Bonjour, ça va ?", max_tokens=1, user=user)
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_d3_feedback_is_bounded_and_limited_per_id(
    http: httpx.Client, root: Path, tmp_path: Path
) -> None:
    """Defect 3: a score outside [-1, 1] (-1e308, 2) is a 400 naming ``score``; an answer takes
    at most 5 scores (the last counts), then 429; the report stays finite, valid JSON."""
    rid = _answer(http, "scorer")["id"]
    for bad in (-1e308, 2, 1e308):
        r = http.post("/v1/steering/feedback", json={"id": rid, "score": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "score", r.text
    for score in (1, 0, -1, 0.5, 1):
        r = http.post("/v1/steering/feedback", json={"id": rid, "score": score})
        assert r.status_code == 200, r.text
    r = http.post("/v1/steering/feedback", json={"id": rid, "score": 1})
    assert r.status_code == 429 and r.json()["error"]["code"] == "feedback_limit", r.text
    other = _answer(http, "scorer-2")["id"]  # the limit is per answer
    assert http.post("/v1/steering/feedback", json={"id": other, "score": -1}).status_code == 200

    from steerserve.server.ab.analysis import build_report, read_log, write_report

    rows = {r.id: r for r in read_log(root / "ab.jsonl")}
    assert rows[rid].score == 1.0  # the last of its five
    write_report(build_report(list(rows.values())), tmp_path)
    json.loads((tmp_path / "report.json").read_text(), parse_constant=_no_constant)


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} in report.json: not JSON")


def test_d5_subject_header_hashes_as_the_user_field(http: httpx.Client) -> None:
    """Defect 5: a non-ASCII subject sent as ``x-steerserve-subject`` (UTF-8 bytes) lands in the
    arm it gets as ``user``; a header that is not UTF-8 is a 400 naming the header."""
    for subject in ("ユーザー", "Zoë", "josé@example.com"):
        want = Experiment(NAME, 0.5).assign(subject)
        as_user = _answer(http, subject)["steering"]["experiment"]
        body = chat_body("Bonjour, ça va ?", max_tokens=1)
        r = http.post(
            "/v1/chat/completions",
            json=body,
            headers={"x-steerserve-subject": subject.encode()},
        )
        assert r.status_code == 200, r.text
        as_header = r.json()["steering"]["experiment"]
        assert as_user == as_header == want.echo(), (subject, as_user, as_header)
    r = http.post(
        "/v1/chat/completions",
        json=chat_body("hi", max_tokens=1),
        headers={"x-steerserve-subject": b"\xff\xfe"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-steerserve-subject", r.text


def test_d6_feedback_whose_log_write_fails_is_503(server: Server, http: httpx.Client) -> None:
    """Defect 6: the decision log cannot be written (a full disk): the score is lost, so the
    answer is a 503 saying so, not a 200; once the log writes again, the same score is taken."""
    rid = _answer(http, "full-disk")["id"]
    state = server.app.state.steer
    kept = state.decisions.log
    state.decisions.log = DecisionLog("/dev/full", on_failure=state.metrics.ab_log_failures.inc)
    try:
        r = http.post("/v1/steering/feedback", json={"id": rid, "score": 1})
    finally:
        state.decisions.log.close()
        state.decisions.log = kept
    assert r.status_code == 503 and r.json()["error"]["code"] == "decision_log_unwritable", r.text
    assert http.post("/v1/steering/feedback", json={"id": rid, "score": 1}).status_code == 200


# --- artifacts the server must refuse -------------------------------------------------------------


def _loud(root: Path, model: Path, name: str = "loud") -> Path:
    """An artifact whose calibrated scale (1000) the engine refuses (its bound is 64)."""
    path = make_artifact(root, model, "v1", name=name)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["interventions"][0]["scale"] = 1000.0
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_d4_d8_admin_skips_a_crafted_manifest_and_refuses_a_scale_the_engine_refuses(
    http: httpx.Client, root: Path, tiny_llama: Path
) -> None:
    """Defect 4: a deeply nested manifest.json under the vectors directory is refused alone
    (422 naming why, no server path), other loads still work; defect 8: an artifact whose
    calibrated scale the engine refuses is a 422, never loaded (nor made the default)."""
    junk = root / "vectors" / "junk" / "v1"
    junk.mkdir(parents=True)
    (junk / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    _loud(root / "vectors", tiny_llama)
    try:
        r = http.post("/v1/steering/vectors", json={"name": "tiny"})
        assert r.status_code == 200, r.text
        r = http.post("/v1/steering/vectors", json={"name": "junk"})
        assert r.status_code == 422 and "nested too deeply" in r.text, r.text
        assert str(root) not in r.text
        r = http.post("/v1/steering/vectors", json={"name": "loud", "default": True})
        assert r.status_code == 422 and "scale 1000" in r.text, r.text
        listing = http.get("/v1/steering/vectors").json()
        assert listing["default"] == "tiny/v1" and "loud/v1" not in {
            a["id"] for a in listing["data"]
        }
    finally:
        for p in (junk, root / "vectors" / "loud" / "v1"):
            for f in p.iterdir():
                f.unlink()
            p.rmdir()


@pytest.mark.parametrize("case", ["nested manifest", "duplicate", "scale"])
def test_d4_d8_start_refuses_before_the_engine_naming_the_folders(
    tiny_llama: Path, tmp_path: Path, case: str
) -> None:
    """Defects 4 and 8 at start: a nested manifest, one name/version in two folders, or a
    calibrated scale the engine refuses fail the start before the engine is built, with a
    message naming the folders (not a traceback naming no file, 48 s later)."""
    from steerserve.server import create_app

    vectors = tmp_path / "vectors"
    first = make_artifact(vectors, tiny_llama, "v1")
    if case == "nested manifest":
        (vectors / "deep" / "v1").mkdir(parents=True)
        (vectors / "deep" / "v1" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
        names = [str(vectors / "deep" / "v1"), "nested too deeply"]
    elif case == "duplicate":
        copy = vectors / "copy" / "v1"
        copy.mkdir(parents=True)
        for f in first.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        names = [str(first), str(copy), "tiny/v1 is in more than one folder"]
    else:
        names = [str(_loud(vectors, tiny_llama)), "scale 1000"]
    app = create_app(tiny_settings(tiny_llama, vectors, ENGINE, api_key=None))
    srv = Server(app)
    try:
        with pytest.raises(RuntimeError) as e:
            srv.start(timeout=60)
        for name in names:
            assert name in str(e.value), str(e.value)
        assert app.state.steer.backend._build is None  # refused before the engine was built
    finally:
        srv.stop()


def test_d9_linked_folders_load_links_out_of_the_vectors_dir_are_refused(
    http: httpx.Client, root: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    """Defect 9: a version folder that is a link within the vectors directory loads (it was
    invisible: 404 with no reason); a folder or a file linked from outside it is a 422 saying
    so (such files used to load)."""
    vectors = root / "vectors"
    store = make_artifact(vectors / ".store", tiny_llama, "v1", name="linked")
    (vectors / "linked").mkdir()
    (vectors / "linked" / "v1").symlink_to(store, target_is_directory=True)
    far = make_artifact(tmp_path, tiny_llama, "v1", name="far")
    (vectors / "far").mkdir()
    (vectors / "far" / "v1").symlink_to(far, target_is_directory=True)
    part = vectors / "part" / "v1"
    part.mkdir(parents=True)
    (part / "manifest.json").write_text(
        (make_artifact(tmp_path, tiny_llama, "v1", name="part") / "manifest.json").read_text()
    )
    (part / "vectors.safetensors").symlink_to(tmp_path / "part" / "v1" / "vectors.safetensors")
    try:
        r = http.post("/v1/steering/vectors", json={"name": "linked"})
        assert r.status_code == 200 and r.json()["loaded"] == "linked/v1", r.text
        for name in ("far", "part"):
            r = http.post("/v1/steering/vectors", json={"name": name})
            assert r.status_code == 422 and "outside the vectors directory" in r.text, r.text
    finally:
        for p in (vectors / "linked" / "v1", vectors / "far" / "v1", *part.iterdir()):
            p.unlink()
        for p in (part, vectors / "part", vectors / "linked", vectors / "far"):
            p.rmdir()
        for f in store.iterdir():
            f.unlink()
        store.rmdir()


def test_d10_a_load_failure_while_stopping_is_a_stop(tiny_llama: Path, tmp_path: Path) -> None:
    """Defect 10: when a signal came while the engine loads (``stopping``, as the process's
    signal handler sets it), a load that fails (EngineCore stopped by the same signal; here an
    artifact refusal, which fails at once) is a stop, not an engine failure: /ready never says
    "failed", /health stays up, and the process would exit 0, not 1."""
    from steerserve.server import create_app

    vectors = tmp_path / "vectors"
    (vectors / "deep" / "v1").mkdir(parents=True)
    (vectors / "deep" / "v1" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    app = create_app(tiny_settings(tiny_llama, vectors, ENGINE, api_key=None))
    app.state.steer.stopping = True
    srv = Server(app)
    try:
        srv.listen()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert httpx.get(f"{srv.url}/ready").json()["status"] == "loading"
            time.sleep(0.1)
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert not app.state.steer.failed
    finally:
        srv.stop()


# --- cosmetics ------------------------------------------------------------------------------------


def test_d13_schema_integers_head_health_unknown_fields_and_nan(http: httpx.Client) -> None:
    """Defect 13: ``2.0`` where /openapi.json says integer is taken as 2 (``2.5`` is not);
    ``HEAD /health`` answers; an unknown capitalised field is named; a NaN temperature is
    refused as not finite (not as "should be <= 2")."""
    r = http.post("/v1/chat/completions", json=chat_body("hi", n=2.0, max_tokens=1.0, seed=3.0))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    r = http.post("/v1/chat/completions", json=chat_body("hi", n=2.5))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1.0})
    assert r.status_code == 200, r.text
    assert http.head("/health").status_code == 200
    r = http.post("/v1/chat/completions", json=chat_body("hi", Temperature=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "Temperature", r.text
    assert "Temperature" in r.json()["error"]["message"]
    body = json.dumps(chat_body("hi"))[:-1] + ', "temperature": NaN}'
    r = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"], r.text


def test_d9_artifact_name_with_a_trailing_newline_is_refused(http: httpx.Client) -> None:
    """Defect 9 (part): ``"tiny\\n"`` is not an artifact name (the check's ``$`` let it by)."""
    r = http.post("/v1/steering/vectors", json={"name": "tiny\n"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text


# --- slow clients ---------------------------------------------------------------------------------


def test_d12_half_sent_requests_are_cut_off_idle_connections_kept(server: Server) -> None:
    """Defect 12: 40 connections that send half a request head, 10 that send a head and half
    its body, and 10 that send nothing are all closed by the server soon after the deadline
    (408 where no response had begun); an idle keep-alive connection between two requests
    outlives the deadline."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    body_head = head + b"Content-Length: 1000\r\n\r\n" + b'{"model": "llama", '
    socks = []
    for payload in [head[:30]] * 40 + [body_head] * 10 + [b""] * 10:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(payload)
        socks.append(s)
    deadline = time.monotonic() + REQUEST_TIMEOUT + 10
    answers = []
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            answers.append(data)  # the server closed the connection
        except TimeoutError:
            answers.append(None)  # still open
        finally:
            s.close()
    assert None not in answers, f"{answers.count(None)} connections still open"
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers)
    conn = HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for _ in range(2):
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            time.sleep(REQUEST_TIMEOUT + 1)
    finally:
        conn.close()


def test_d12_a_half_body_refused_before_it_was_read_is_closed_at_the_deadline(
    server: Server,
) -> None:
    """Issue 44: a request refused before the app reads its body (a foreign Host on this
    keyless loopback server, 403) whose client never sends the rest is closed at the deadline,
    not held open waiting for the body."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: attacker.example\r\n"
    socks = []
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(head + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        socks.append(s)
    until = time.monotonic() + REQUEST_TIMEOUT + 10
    answers = [_answer_at_close(s, until) for s in socks]
    for raw, _ in answers:
        assert raw is not None, "connection still open"
        assert raw.startswith(b"HTTP/1.1 403"), raw[:100]


def _answer_at_close(s: socket.socket, until: float) -> tuple[bytes | None, float]:
    """What the server sent on ``s`` until it closed it, and when; ``None`` if still open
    at ``until``."""
    data = b""
    try:
        while True:
            s.settimeout(max(0.1, until - time.monotonic()))
            chunk = s.recv(4096)
            if not chunk:
                return data, time.monotonic()
            data += chunk
    except TimeoutError:
        return None, time.monotonic()
    finally:
        s.close()


def _timeout_answer(raw: bytes) -> tuple[dict[str, str], Any]:
    """The headers and JSON body of a 408 as received (asserting its status line)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    assert status.startswith("HTTP/1.1 408 "), raw[:200]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    assert int(headers["content-length"]) == len(body), raw  # nothing after the answer
    return headers, json.loads(body)


def test_d12_unfinished_bodies_are_answered_408_and_counted_as_408_slow_apps_are_not_cut(
    server: Server, http: httpx.Client
) -> None:
    """Issue 33, item 5: connections that sent a whole head and part of its body (fewer bytes
    than their Content-Length, none at all, or chunks without the last one, stopping between
    chunks or inside one) and went silent are answered 408 in OpenAI's format with
    ``connection: close`` at the deadline, then closed; the app, which was reading the body,
    counts them as 408, not as clients gone (499). A request sent in full whose app takes
    longer than the deadline is answered, and its connection kept."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    start = b'{"model": "%s", ' % MODEL.encode()
    sized, chunked = (
        head + b"Content-Length: 1000\r\n\r\n",
        head + b"Transfer-Encoding: chunked\r\n\r\n",
    )
    payloads = [
        sized + start,
        sized,
        chunked + b"%x\r\n%s\r\n" % (len(start), start),
        chunked + b"100\r\n" + start,
    ] * 5
    counted = {
        status: metric(http, "steerserve_requests_total", status=status)
        for status in ("408", "499")
    }
    t0 = time.monotonic()
    slow = HTTPConnection("127.0.0.1", server.port, timeout=60)
    slow.request("POST", "/slow", b'{"a": 1}', {"Content-Type": "application/json"})
    socks = []
    for payload in payloads:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(payload)
        socks.append(s)
    until = time.monotonic() + REQUEST_TIMEOUT + 10
    answers = [_answer_at_close(s, until) for s in socks]
    assert all(raw is not None for raw, _ in answers), "connections still open"
    for raw, closed in answers:
        assert closed - t0 >= REQUEST_TIMEOUT  # not before the deadline
        assert raw is not None
        headers, body = _timeout_answer(raw)
        assert headers["connection"] == "close"
        assert headers["content-type"] == "application/json"
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["code"] == "request_timeout"
    try:
        r = slow.getresponse()
        assert (r.status, json.loads(r.read())) == (200, {"bytes": 8})
        assert time.monotonic() - t0 >= REQUEST_TIMEOUT + 2
        slow.request("GET", "/health")  # the same connection
        assert slow.getresponse().read() == b'{"status":"ok"}'
    finally:
        slow.close()
    # the app counts each request once it sees it end, just after its connection closed
    n, wait = len(payloads), time.monotonic() + 30

    def grown() -> dict[str, float]:
        return {
            s: metric(http, "steerserve_requests_total", status=s) - c for s, c in counted.items()
        }

    while sum(grown().values()) < n and time.monotonic() < wait:
        time.sleep(0.2)
    assert grown() == {"408": n, "499": 0}


# --- the bounded fuzz test: 0 x 5xx ---------------------------------------------------------------

FUZZ_BODIES = 2200  # across the five POST routes; GET routes are called between them
#: Any JSON value, weighted to what broke servers before: integers past float's range, deep
#: nesting, empty containers, odd strings.
ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([10**400, -(10**400), 2**63, 2**1024, 0, -1])
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
#: Fields whose valid values must stay small so the engine's work stays bounded.
BOUNDED = {
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "n": st.integers(1, 3),
    "model": st.sampled_from([MODEL, MODEL, "other"]),
    "top_logprobs": st.integers(0, 3),
}


def _from_schema(
    schema: dict[str, Any], comps: dict[str, Any], name: str = "", wild: bool = True
) -> Any:
    """A strategy for ``schema`` (the subset pydantic publishes); ``wild``: each value sometimes
    replaced by any JSON value (bodies with one or more wrong parts), else bodies the schema
    allows, which reach the deeper checks (policy, admission, the engine)."""
    if "$ref" in schema:
        schema = comps[schema["$ref"].rsplit("/", 1)[-1]]
    if name in BOUNDED:
        valid = BOUNDED[name]
    elif "anyOf" in schema:
        valid = st.one_of([_from_schema(s, comps, wild=wild) for s in schema["anyOf"]])
    elif "enum" in schema:
        valid = st.sampled_from(schema["enum"])
    else:
        valid = _typed(schema, comps, wild)
    return st.one_of(valid, valid, valid, ANY_JSON) if wild else valid


def _typed(schema: dict[str, Any], comps: dict[str, Any], wild: bool) -> Any:
    kind = schema.get("type")
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if kind == "object":
        props = {
            k: _from_schema(v, comps, k, wild) for k, v in schema.get("properties", {}).items()
        }
        required = set(schema.get("required", ()))
        fixed = st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            more = st.dictionaries(
                st.text(max_size=8), _from_schema(extra, comps, wild=wild), max_size=3
            )
            return st.tuples(fixed, more).map(lambda t: {**t[1], **t[0]})
        return fixed
    if kind == "array":
        items = _from_schema(schema.get("items", {}), comps, wild=wild)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=24)
    if kind == "integer":
        return st.integers(lo, hi)
    if kind == "number":
        return st.floats(lo, hi, allow_nan=False) | st.integers(-3, 3)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


def _capped(body: Any) -> Any:
    """A generation body without a token budget gets 2 tokens (the engine's work stays small)."""
    if isinstance(body, dict) and "model" in body and "max_tokens" not in body:
        return {**body, "max_tokens": 2}
    return body


def _post_routes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every POST route of the published document and the schema of its JSON body."""
    out = {}
    for path, ops in doc["paths"].items():
        body = ops.get("post", {}).get("requestBody")
        if body is not None:
            out[path] = body["content"]["application/json"]["schema"]
    return out


def test_fuzz_no_body_is_a_5xx(server: Server, http: httpx.Client) -> None:
    """Bounded property test on the published /openapi.json: bodies generated from each POST
    route's schema (mostly valid, parts replaced by any JSON value, some not JSON at all) and
    every GET route: never a 5xx, and the server counts no 500."""
    doc = http.get("/openapi.json").json()
    comps = doc["components"]["schemas"]
    routes = _post_routes(doc)
    gets = [p for p, ops in doc["paths"].items() if "get" in ops and "{" not in p]
    assert set(routes) >= {
        "/v1/chat/completions",
        "/v1/chat/completions/ab",
        "/v1/completions",
        "/v1/steering/feedback",
        "/v1/steering/vectors",
    }, routes
    bodies = {
        p: st.one_of(_from_schema(s, comps, wild=False).map(_capped), _from_schema(s, comps))
        for p, s in routes.items()
    }
    raw = st.binary(max_size=40) | st.text(max_size=40).map(str.encode)
    case = st.sampled_from(sorted(routes)).flatmap(
        lambda p: st.tuples(st.just(p), st.one_of(*[bodies[p]] * 19, raw))
    )
    seen: dict[str, int] = {}
    statuses: dict[int, int] = {}
    before = metric(http, "steerserve_requests_total", status="500")

    @settings(
        max_examples=FUZZ_BODIES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
    )
    @given(case)
    def one(c: tuple[str, Any]) -> None:
        path, body = c
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code < 500, (path, content[:300], r.text[:300])
        seen[path] = seen.get(path, 0) + 1
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if sum(seen.values()) % 200 == 0:
            for p in gets:
                assert http.get(p).status_code < 500, p

    one()
    print(
        f"fuzz: {sum(seen.values())} bodies, by route {seen}, by status {sorted(statuses.items())}"
    )
    assert sum(seen.values()) >= 2000 and len(seen) == len(routes), seen
    assert metric(http, "steerserve_requests_total", status="500") == before
