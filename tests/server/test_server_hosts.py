"""Which origins reach the server's privileged and HTML routes (issue 33, items 4 and 9), over
real HTTP.

Item 4: on the default setup (loopback, no API key: the admin endpoints are open to local users)
a request naming another host (``Host: attacker.example``, what a web page sends after a DNS
rebinding) loaded a vector, changed the default artifact and read the experiment's data. Admin
open on loopback now answers loopback Host names only; a key, when set, decides alone.

Item 9: ``/docs`` and ``/redoc`` ran Swagger UI and ReDoc from a CDN on the server's origin; they
are gone (``/openapi.json`` stays), and no page the server serves loads anything from elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _server import (
    AUTH,
    KEY,
    Server,
    chat_body,
    make_artifact,
    tiny_server,
    tiny_settings,
    wait_until,
)

NAME = "hosts"
FOREIGN = ["attacker.example", "attacker.example:80", "127.0.0.1.attacker.example", ""]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("hosts")
    make_artifact(root / "vectors", tiny_llama, "v1")
    make_artifact(root / "vectors", tiny_llama, "v2", seed=3)
    return root


@pytest.fixture(scope="module")
def server(tiny_llama: Path, root: Path) -> Iterator[Server]:
    """The default setup: loopback, no API key, an A/B experiment with a decision log."""
    engine = {"max_model_len": 128, "kv_cache_memory_bytes": 32 << 20}
    ab = {"ab_split": 0.5, "ab_name": NAME, "ab_log": str(root / "ab.jsonl")}
    with tiny_server(tiny_llama, root / "vectors", engine, api_key=None, **ab) as srv:
        yield srv


def _admin_calls(c: httpx.Client, host: str) -> dict[str, httpx.Response]:
    """Every admin endpoint, sent with ``Host: host``."""
    h = {"Host": host}
    return {
        "load": c.post("/v1/steering/vectors", json={"name": "tiny/v2"}, headers=h),
        "set default": c.post(
            "/v1/steering/vectors", json={"name": "tiny/v2", "default": True}, headers=h
        ),
        "experiments": c.get("/v1/steering/experiments", headers=h),
        "report": c.get("/v1/steering/experiments/report.md", headers=h),
    }


def test_admin_on_loopback_without_key_answers_loopback_host_names_only(server: Server) -> None:
    """A foreign Host (a DNS-rebound page) is refused 403 ``untrusted_host`` on every admin
    endpoint and changes nothing; ``localhost`` and ``127.0.0.1`` (with the port) still work. The
    pages themselves hold no data and open under any name."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=chat_body("hi", user="someone"))
        assert r.status_code == 200, r.text  # a decision in the log: the report has data
        assert c.get("/v1/steering/vectors").json()["default"] == "tiny/v2"  # newest first
        r = c.post("/v1/steering/vectors", json={"name": "tiny/v1", "default": True})
        assert r.status_code == 200 and r.json()["default"] == "tiny/v1", r.text

        for host in FOREIGN:
            for what, r in _admin_calls(c, host).items():
                assert r.status_code == 403, (host, what, r.text)
                err = r.json()["error"]
                assert err["code"] == "untrusted_host", (host, what, err)
                assert "DNS rebinding" in err["message"] and "--api-key" in err["message"]
            assert c.get("/v1/steering/vectors").json()["default"] == "tiny/v1", host
            assert c.get("/experiments", headers={"Host": host}).status_code == 200

        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "LOCALHOST"):
            calls = _admin_calls(c, host)
            assert {what: r.status_code for what, r in calls.items()} == dict.fromkeys(calls, 200)
            assert calls["set default"].json()["default"] == "tiny/v2"
            assert calls["experiments"].json()["experiment"]["name"] == NAME
            assert calls["report"].text.startswith("#"), calls["report"].text[:200]
            r = c.post("/v1/steering/vectors", json={"name": "tiny/v1", "default": True})
            assert r.json()["default"] == "tiny/v1"


def test_every_keyed_route_on_loopback_without_key_answers_loopback_host_names_only(
    server: Server,
) -> None:
    """Generation, feedback and the listings too (issue 44): a rebound page could otherwise
    enrol and score requests, poisoning the A/B result. /health, /ready, /metrics, /ping and
    /load stay open."""
    calls = {
        "chat": ("POST", "/v1/chat/completions", chat_body("hi", user="u1")),
        "completions": ("POST", "/v1/completions", {"model": "llama", "prompt": "a"}),
        "responses": ("POST", "/v1/responses", {"model": "llama", "input": "a"}),
        "tokenize": ("POST", "/tokenize", {"model": "llama", "prompt": "a"}),
        "feedback": ("POST", "/v1/steering/feedback", {"id": "chatcmpl-x", "score": 1}),
        "models": ("GET", "/v1/models", None),
        "vectors": ("GET", "/v1/steering/vectors", None),
    }
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for host in FOREIGN:
            for what, (method, path, body) in calls.items():
                r = c.request(method, path, json=body, headers={"Host": host})
                assert r.status_code == 403, (host, what, r.text)
                assert r.json()["error"]["code"] == "untrusted_host", (host, what)
            for path in ("/health", "/ready", "/metrics", "/ping", "/load"):
                assert c.get(path, headers={"Host": host}).status_code == 200, (host, path)
        local = {"Host": f"localhost:{server.port}"}
        assert c.post("/v1/chat/completions", json=calls["chat"][2], headers=local).is_success
        assert c.get("/v1/models", headers=local).is_success


@pytest.mark.parametrize(
    "host,allowed",
    [
        ("localhost", True),
        ("localhost:8000", True),
        ("app.localhost:8000", True),  # browsers resolve *.localhost to loopback themselves
        ("127.0.0.1", True),
        ("127.0.0.2:8000", True),
        ("[::1]:8000", True),
        ("[::1]", True),
        ("attacker.example", False),
        ("attacker.example:8000", False),
        ("localhost.attacker.example", False),
        ("127.0.0.1.nip.io", False),
        ("10.0.0.1:8000", False),
        ("[::2]:8000", False),
        ("[::1", False),
        ("", False),
        # parsed strictly: a name or an IP literal, then an optional port, nothing else
        ("[::1].attacker.example", False),
        ("[::1]x", False),
        ("[::1]:80x", False),
        ("127.0.0.1:80@attacker", False),
        ("localhost:8100, attacker.example", False),
        ("localhost attacker.example", False),
        ("localhost:", False),
        ("localhost:123456", False),
        ("[127.0.0.1]", False),  # brackets hold IPv6 only
        ("LOCALHOST:8000", True),
        ("localhost.", True),
    ],
)
def test_loopback_host_names(host: str, allowed: bool) -> None:
    from steerserve.server.admin import loopback_name

    assert loopback_name(host) is allowed


@pytest.mark.parametrize(
    "key,open_admin,sent_key,status",
    [
        (None, False, None, 403),  # the default: loopback names only
        (KEY, False, KEY, 503),  # a key always wins: any Host with the key (no engine here)
        (KEY, False, None, 401),  # ... and none without it
        (None, True, None, 503),  # --open-admin: whoever reaches the port, any name
    ],
)
def test_a_key_or_open_admin_decides_instead_of_the_host(
    tiny_llama: Path, key: str | None, open_admin: bool, sent_key: str | None, status: int
) -> None:
    """Under ``Host: attacker.example``; the app runs without its engine (lifespan off): an
    admitted load is the 503 of an engine still loading, the experiment data a 200."""
    from steerserve.server import create_app

    settings = tiny_settings(tiny_llama, api_key=key, open_admin=open_admin)
    srv = Server(create_app(settings), lifespan="off")
    srv.listen()
    try:
        headers = {"Host": "attacker.example"} | (
            {"Authorization": f"Bearer {sent_key}"} if sent_key else {}
        )
        r = httpx.post(f"{srv.url}/v1/steering/vectors", json={"name": "tiny"}, headers=headers)
        assert r.status_code == status, r.text
        r = httpx.get(f"{srv.url}/v1/steering/experiments", headers=headers)
        assert r.status_code == (200 if status == 503 else status), r.text
    finally:
        srv.stop()


#: An origin other than the server's own: ``http(s)://``, or protocol-relative ``//host``. The
#: SVG namespace name (``createElementNS``'s first argument) is an identifier, never fetched.
ELSEWHERE = re.compile(
    r"https?://(?!www\.w3\.org/2000/svg\b)|(?:src|href|url)\s*[=(]\s*[\"']?//", re.IGNORECASE
)


def test_no_docs_pages_and_nothing_loaded_from_elsewhere(tiny_llama: Path) -> None:
    """``/docs`` and ``/redoc`` are 404s in OpenAI's format (FastAPI's loaded Swagger UI and
    ReDoc from cdn.jsdelivr.net, without CSP or integrity); ``/openapi.json`` stays; every page
    and asset the server serves references no other origin and carries the strict CSP."""
    from steerserve.server import create_app
    from steerserve.server.pages import ASSETS

    app = create_app(tiny_settings(tiny_llama))
    srv = Server(app, lifespan="off")
    srv.listen()
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
            for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
                r = c.get(path)
                assert r.status_code == 404, (path, r.text[:200])
                assert r.json()["error"]["type"] == "invalid_request_error", path
            assert c.get("/openapi.json").json()["paths"]

            gets = [
                route.path
                for route in app.routes
                if "GET" in (getattr(route, "methods", None) or ()) and "{" not in route.path
            ]
            served = [*gets, *(f"/ui/{name}" for name in ASSETS)]
            pages = 0
            for path in served:
                r = c.get(path)
                if r.status_code != 200 or not r.headers["content-type"].startswith(
                    ("text/html", "text/javascript", "text/css")
                ):
                    continue
                pages += r.headers["content-type"].startswith("text/html")
                assert not ELSEWHERE.search(r.text), (path, ELSEWHERE.search(r.text))
                assert "default-src 'none'" in r.headers["content-security-policy"], path
            assert pages == 2  # /compare and /experiments
    finally:
        srv.stop()


def test_tls_root_path_and_cors_take_vllms_options(tiny_llama: Path, tmp_path: Path) -> None:
    """``--ssl-keyfile/--ssl-certfile``, ``--root-path`` and ``--allowed-origins`` as vLLM's: the
    app answers HTTPS under the proxy's prefix, and CORS headers go to the named origin only."""
    import subprocess

    from steerserve.server import create_app
    from steerserve.server.process import uvicorn_options

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    settings = tiny_settings(
        tiny_llama,
        ssl_keyfile=str(key),
        ssl_certfile=str(cert),
        root_path="/llm",
        allowed_origins=("https://app.example",),
    )
    tls = {k: v for k, v in uvicorn_options(settings).items() if k.startswith(("ssl", "root"))}
    srv = Server(create_app(settings), lifespan="off", **tls)
    srv.thread.start()
    url = f"https://localhost:{srv.port}"
    try:
        with httpx.Client(base_url=url, verify=str(cert), timeout=10) as c:

            def up() -> bool:
                try:
                    return c.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            assert wait_until(up, 60)
            # behind a proxy that strips /llm: the document names the prefix clients use
            assert c.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
            ok = c.get("/health", headers={"Origin": "https://app.example"})
            assert ok.headers["access-control-allow-origin"] == "https://app.example"
            other = c.get("/health", headers={"Origin": "https://attacker.example"})
            assert "access-control-allow-origin" not in other.headers
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5).raise_for_status()
    finally:
        srv.stop()
