"""Several ``--api-key`` values and ``--served-model-name`` aliases, as in vLLM: any key
authenticates; the first name is the one reported, the others are accepted as ``model``. The app
runs without its engine (no lifespan): an admitted request is the 503 of an engine loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _server import tiny_settings
from fastapi.testclient import TestClient


def test_any_key_authenticates_and_aliases_name_the_model(tiny_llama: Path) -> None:
    from steerserve.server import create_app

    settings = tiny_settings(tiny_llama, api_key=("k1", "k2"), served_model_name=("tiny", "alias"))
    client = TestClient(create_app(settings))  # no `with`: the engine is never started

    def chat(model: str, key: str) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        auth = {"Authorization": f"Bearer {key}"}
        return client.post("/v1/chat/completions", json=body, headers=auth).status_code

    assert [chat(m, k) for m in ("tiny", "alias") for k in ("k1", "k2")] == [503] * 4
    assert chat("tiny", "k3") == 401
    assert chat("other", "k1") == 404


# --- every route x every kind of key, over real HTTP (issue 58) -------------------------------

API, ADMIN = ("k1", "k2"), ("admin-1",)
KEYS = {"none": None, "wrong": "nope", "api": API[1], "admin": ADMIN[0]}


def _routes(app: Any) -> list[tuple[str, str, bool, bool]]:
    """(method, path, keyed, admin) of every route the app serves, read from the app itself:
    a route added later is in the matrix without anyone listing it."""
    from fastapi.routing import APIRoute

    from steerserve.server.app import require_admin, require_key

    out = []
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        deps = {d.call for d in route.dependant.dependencies}
        for method in sorted(route.methods - {"HEAD"}):
            out.append((method, route.path, require_key in deps, require_admin in deps))
    return out


def test_every_route_under_every_key(tiny_llama: Path) -> None:
    """No key and a wrong key: 401 on every keyed route; an API key: in on the API, 403 on the
    admin routes once admin keys are set; an admin key: in everywhere; open routes open to all.
    (No engine runs: an admitted generation is the 503 of an engine loading.)"""
    import httpx
    from _server import Server

    from steerserve.server import create_app

    app = create_app(tiny_settings(tiny_llama, api_key=API, admin_key=ADMIN))
    routes = _routes(app)
    assert len(routes) > 20 and any(a for *_, a in routes)
    srv = Server(app, lifespan="off")
    srv.listen()
    seen: dict[tuple[str, str, str], int] = {}
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            for method, path, keyed, admin in routes:
                for kind, key in KEYS.items():
                    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                    url = path.replace("{", "").replace("}", "")  # a path parameter: any value
                    r = c.request(method, url, headers=headers, json={})
                    seen[method, path, kind] = r.status_code
                    code = (
                        (r.json().get("error") or {}).get("code") if r.content[:1] == b"{" else None
                    )
                    if keyed and kind in ("none", "wrong"):
                        assert r.status_code == 401, (method, path, kind, r.text)
                    elif admin and kind == "api":
                        assert r.status_code == 403 and code == "admin_key_required", (
                            method, path, r.text
                        )  # fmt: skip
                    else:
                        assert r.status_code not in (401, 403), (method, path, kind, r.text)
    finally:
        srv.stop()
    assert len(seen) == 4 * len(routes)


def _reshaped(path: Path, tensors: dict[str, Any]) -> None:
    """Replace an artifact's tensors file (the manifest is left as it is)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path / "vectors.safetensors"))


def test_admin_vector_routes_under_keys(tiny_llama: Path, tmp_path: Path) -> None:
    """``POST /v1/steering/vectors`` on a keyed server with admin keys: an API key is refused;
    with the admin key, names that are paths are a 400, a mis-shaped or huge tensor a 422
    (read no further than its header), and concurrent loads of two versions all succeed, the
    default one of them."""
    import concurrent.futures

    import httpx
    import torch
    from _server import make_artifact, tiny_server

    vectors = tmp_path / "vectors"
    for v in ("v1", "v2"):
        make_artifact(vectors, tiny_llama, v, seed=int(v[1]))
    with tiny_server(tiny_llama, vectors, api_key=API, admin_key=ADMIN) as srv:
        # written once the server runs (at start such artifacts stop it, naming them)
        bad = make_artifact(vectors, tiny_llama, "v1", name="bent")
        _reshaped(bad, {"recall": torch.zeros(3, 4), "translation": torch.zeros(3)})
        huge = make_artifact(vectors, tiny_llama, "v1", name="huge")
        _reshaped(huge, {"recall": torch.zeros(1 << 24), "translation": torch.zeros(3)})  # 64 MiB
        admin = {"Authorization": f"Bearer {ADMIN[0]}"}
        with httpx.Client(base_url=srv.url, headers=admin, timeout=120) as c:

            def load(name: str, default: bool = False) -> httpx.Response:
                return c.post("/v1/steering/vectors", json={"name": name, "default": default})

            r = c.post(
                "/v1/steering/vectors",
                json={"name": "tiny/v1"},
                headers={"Authorization": f"Bearer {API[0]}"},
            )
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
            for name in ("../tiny", "tiny/../../etc", "/etc/passwd", "tiny/v1/x", "a\nb", ""):
                r = load(name)
                assert r.status_code == 400 and r.json()["error"]["param"] == "name", (name, r.text)
            r = load("bent")
            assert r.status_code == 422 and "must be 1-D" in r.text and str(vectors) not in r.text
            r = load("huge")
            assert r.status_code == 422 and "does not match hidden_size" in r.text, r.text
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda i: load(f"tiny/v{1 + i % 2}", True), range(8)))
            assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
            listing = c.get("/v1/steering/vectors").json()
            assert listing["default"] in ("tiny/v1", "tiny/v2")
            assert {"tiny/v1", "tiny/v2"} <= {a["id"] for a in listing["data"]}
            assert c.get("/ready").status_code == 200
