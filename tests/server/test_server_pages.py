"""``/compare`` and ``/experiments`` in a real browser (Debian's Chromium, headless, driven by
Playwright) against one real server: a tiny Llama that always replies ``<script>…`` (so escaping
is tested on a real reply), an artifact, an A/B split and its decision log.

Screenshots go to .work/screenshots/ (the test artifacts); the README's are refreshed with
``STEERSERVE_SCREENSHOTS=docs/img``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _browser import chromium, expect, parrot, screenshot
from _server import FR, JA, KEY, Server, make_artifact, tiny_server, tiny_settings

from steerserve.server.ab import analysis as ab_report
from steerserve.server.ab.experiment import Experiment

NAME = "pages-exp"
MODEL = "parrot"  # the served name: the model folder's
USERS = [f"u{i}" for i in range(24)]
DONE = re.compile("^done")
XSS = '<img src=x onerror="window.pwned=1"><script>window.pwned=1</script>'


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("pages")
    make_artifact(root / "vectors", parrot(tiny_llama, root / MODEL), "v1")
    return root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Server]:
    with tiny_server(
        root / MODEL, root / "vectors", ab_split=0.5, ab_name=NAME, ab_log=str(root / "ab.jsonl")
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from chromium()


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Any]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    page.close()
    assert not errors, errors  # no script error, and no injected script ran and failed


def with_key(page: Any, url: str) -> None:
    page.goto(url)
    page.fill("#key", KEY)
    page.click("#keyform button")


def ab_stream(http: httpx.Client, **kw: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": JA}], "max_tokens": 8}
    body |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **kw}
    with http.stream("POST", "/v1/chat/completions/ab", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_pages_hold_no_data_and_run_no_inline_script(server: Server) -> None:
    """The pages need no key (they hold no data); the data does; no inline or foreign script."""
    for path in ("/compare", "/experiments"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert "<script>" not in r.text and "http" not in r.text.replace('"/ui/', "")
    assert httpx.get(server.url + "/ui/compare.js").status_code == 200
    assert httpx.get(server.url + "/ui/..%2Fpages.py").status_code == 404
    for path in ("/v1/steering/experiments", "/v1/steering/experiments/report.md"):
        assert httpx.get(server.url + path).status_code == 401


def test_ab_streams_both_arms(http: httpx.Client) -> None:
    """stream: true on the A/B endpoint: both arms' chunks, named, with their own usage, and
    the same texts as the collected answer with the same seed."""
    chunks = ab_stream(http, seed=7)
    text = {"unsteered": "", "steered": ""}
    usage = {}
    for c in chunks:
        assert c["id"].endswith({"unsteered": "-a", "steered": "-b"}[c["arm"]])
        text[c["arm"]] += "".join(ch["delta"].get("content") or "" for ch in c["choices"])
        if c.get("usage"):
            usage[c["arm"]] = c["usage"]["completion_tokens"]
    assert usage == {"unsteered": 8, "steered": 8}
    assert text["unsteered"] == "<script>"  # the parrot
    body = {"model": MODEL, "messages": [{"role": "user", "content": JA}], "max_tokens": 8}
    r = http.post("/v1/chat/completions/ab", json={**body, "temperature": 0, "seed": 7}).json()
    assert text == {a: r[a]["choices"][0]["message"]["content"] for a in text}


def test_compare_shows_both_answers_as_text(page: Any, server: Server) -> None:
    """Type a Japanese question, send: two answers side by side, the steering applied to each,
    tokens and latency; the ``<script>`` reply is shown as text and runs nothing."""
    with_key(page, server.url + "/compare")
    page.wait_for_selector("#steering option[value='art:tiny/v1']", state="attached")
    page.fill("#message", "フランスの首都はどこですか？")
    page.fill("#max_tokens", "24")
    page.click("#send")
    expect(page.locator("#status")).to_have_text(DONE, timeout=60_000)
    un = page.locator("#arm-unsteered .reply")
    assert un.text_content() == "<script>" * 3
    assert page.locator(".reply script").count() == 0 and page.evaluate("window.pwned") is None
    assert page.evaluate("document.scripts.length") == 2  # the page's own
    assert page.locator("#arm-steered .reply").text_content() != un.text_content()
    assert page.locator(".reply del").count() >= 1 and page.locator(".reply ins").count() >= 1
    applied = {
        arm: dict(
            zip(
                page.locator(f"#arm-{arm} dt").all_text_contents(),
                page.locator(f"#arm-{arm} dd").all_text_contents(),
                strict=True,
            )
        )
        for arm in ("unsteered", "steered")
    }
    assert applied["unsteered"]["applied"] == "no"
    steered = applied["steered"]
    assert (steered["applied"], steered["layers"], steered["detected language"]) == (
        "yes",
        "1, 2",
        "ja",
    )
    assert (
        steered["artifact, version"] == "tiny v1"
        and "recall @ layer 1 × 4" in steered["interventions"]
    )
    for arm in ("unsteered", "steered"):
        stats = page.locator(f"#arm-{arm} .stats").text_content()
        assert "24 tokens" in stats and "done" in stats and "finish: length" in stats, stats
    screenshot(page, "compare.png")
    # one intervention's multiplier: the steered arm lists what was sent
    page.select_option("#steering", "art:tiny/v1")
    page.fill("#multipliers input[data-name='translation']", "0.5")
    page.click("#send")
    expect(page.locator("#status")).to_have_text(DONE, timeout=60_000)
    assert "translation @ layer 2 × 1 " in page.locator("#arm-steered dd").all_text_contents()[4]


def test_a_pair_is_judged_on_the_page_and_through_the_api(
    page: Any, server: Server, http: httpx.Client, root: Path
) -> None:
    """Issue 57: a person clicks "B better" under the two answers on /compare; a client judges
    another pair through POST /v1/steering/preference; one judgement per pair; both counted in
    ``ab-report``'s paired preferences and shown on /experiments."""

    def counted() -> tuple[int, ...]:
        """Judged, B better, ties: ab-report's paired preferences, over the treatments."""
        rep = ab_report.report(root / "ab.jsonl").get("preferences", {}).get(NAME)
        overall = [t["overall"] for t in (rep or {"treatments": {}})["treatments"].values()]
        return tuple(sum(o[k] for o in overall) for k in ("judged", "b", "tie"))

    before = counted()
    with_key(page, server.url + "/compare")
    page.fill("#message", "フランスの首都はどこですか？")
    page.fill("#max_tokens", "4")
    page.click("#send")
    expect(page.locator("#status")).to_have_text(DONE, timeout=60_000)
    page.click("#judge button[data-preference='b']")
    recorded = re.compile(
        rf"^recorded: B \(steered\) better \(pair chatcmpl-\S+, experiment {NAME}\)"
    )
    expect(page.locator("#judged")).to_have_text(recorded, timeout=15_000)
    assert page.locator("#judge button[disabled]").count() == 3  # judged once
    # through the API: the collected pair judged by its common id, once
    body = {"model": MODEL, "messages": [{"role": "user", "content": JA}], "max_tokens": 4}
    pair = http.post("/v1/chat/completions/ab", json=body).json()
    pid = pair["unsteered"]["id"].removesuffix("-a")
    r = http.post("/v1/steering/preference", json={"id": pid, "preference": "tie"})
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "steering.preference", "id": pid, "preference": "tie",
                        "score": 0.0, "experiment": NAME, "language": "ja"}  # fmt: skip
    again = http.post("/v1/steering/preference", json={"id": pid + "-b", "preference": "a"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "preference_limit"
    bad = http.post("/v1/steering/preference", json={"id": pid, "preference": "steered"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "preference", bad.text
    missing = http.post("/v1/steering/preference", json={"id": "chatcmpl-nope", "preference": "a"})
    assert missing.status_code == 404, missing.text
    # reported: two more pairs judged, one B better and one tie
    judged, b, tie = before
    assert counted() == (judged + 2, b + 1, tie + 1)
    with_key(page, server.url + "/experiments")
    section = page.locator(f"section[data-preferences='{NAME}']")
    expect(section.locator("h2")).to_have_text(f"Paired preferences: {NAME}", timeout=15_000)
    assert section.locator("table.preferences tr").count() >= 2


def report_row(
    page: Any, lang: str, arm: str, cells: tuple[str, ...] = ("requests", "scored", "mean", "ci")
) -> dict[str, str]:
    exp = f"section[data-experiment='{NAME}']"
    row = page.locator(f"{exp} tr[data-language='{lang}'][data-arm='{arm}']")
    return {c: row.locator(f"td.{c}").text_content() for c in cells}


def test_experiments_page_is_live_and_ab_report(
    page: Any, server: Server, http: httpx.Client, root: Path
) -> None:
    """After split requests with feedback the page shows two arms with ``ab-report``'s numbers,
    updates live, downloads the report, and shows replies only with --ab-log-content."""
    with_key(page, server.url + "/experiments")
    page.wait_for_selector("#setup h2")
    assert f"Experiment {NAME}: running" in page.locator("#setup h2").text_content()
    arms = {u: Experiment(NAME, 0.5).assign(u).arm for u in USERS}
    assert set(arms.values()) == {"steered", "unsteered"}
    for i, user in enumerate(USERS):
        question = [FR, JA][i % 2]  # two detected languages
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}]}
        body |= {"max_tokens": 2, "user": user}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        score = float(i % 3 != 0) if arms[user] == "steered" else float(i % 2)
        assert (
            http.post(
                "/v1/steering/feedback", json={"id": r.json()["id"], "score": score}
            ).status_code
            == 200
        )
    full = ab_report.report(root / "ab.jsonl")["experiments"][NAME]
    rep = full["overall"]
    section = f"section[data-experiment='{NAME}']"
    want = rep["arms"]["steered"]
    cell = "tr[data-language='all'][data-arm='steered'] td.requests"
    expect(page.locator(cell)).to_have_text(str(want["requests"]), timeout=15_000)
    for arm in ("steered", "unsteered"):
        a = rep["arms"][arm]
        sc = a["score"]
        lo, hi = sc["ci95"]
        assert report_row(page, "all", arm) == {
            "requests": str(a["requests"]),
            "scored": str(sc["n"]),
            "mean": f"{sc['mean']:.3g}",
            "ci": f"[{lo:.3g}, {hi:.3g}]",
        }
    # issue 56: per metric and language, the difference with its always-valid interval (a
    # table row and a forest plot per metric), the family's correction, a fixed threshold
    d = rep["metrics"]["feedback"]["difference"]
    lo, hi = d["ci"]
    sign = "+" if d["diff"] >= 0 else ""
    cell = page.locator(f"{section} tr[data-language='all'][data-metric='feedback'] td.diff")
    assert cell.text_content() == f"{sign}{d['diff']:.3g} [{lo:.3g}, {hi:.3g}]"
    family = full["family"]
    assert page.locator(f"{section} svg.forest").count() == len(family["metrics"])
    assert page.locator(f"{section} svg.forest[data-metric='feedback'] circle").count() >= 1
    fam = page.locator(f"{section} p.family").text_content()
    assert f"Bonferroni over {family['size']} verdicts" in fam, fam
    assert "fixed by the server" in page.locator("#threshold").text_content()
    assert page.locator("#min_scored").count() == 0  # no viewer lowers the threshold
    assert page.locator(f"section[data-experiment='{NAME}'] .badge").text_content() == "not called"
    for lang in ("fr", "ja"):
        assert page.locator(f"tr[data-language='{lang}'][data-arm='steered']").count() == 1
    served = page.locator("table.served tr[data-arm='steered'] td").nth(1).text_content()
    assert served == str(sum(a == "steered" for a in arms.values()))
    # no reply content without --ab-log-content: not in the data, not on the page
    snap = http.get("/v1/steering/experiments").json()
    assert (
        snap["recent"] == []
        and '"reply":' not in json.dumps(snap)
        and "script>" not in json.dumps(snap)  # the parrot's reply text
        and page.locator("#recent").is_hidden()
    )
    screenshot(page, "experiments.png")
    # the report, downloaded as ab-report writes it
    with page.expect_download() as dl:
        page.click("button[data-format='md']")
    md = Path(dl.value.path()).read_text()
    rep_md = ab_report.report(root / "ab.jsonl", splits={NAME: 0.5})  # the server's split
    assert md == ab_report.report_markdown(rep_md) and "Sample ratio: " in md
    # the sample-ratio check on the page, in the report's words (the server knows the split)
    srm = rep_md["experiments"][NAME]["srm"]
    assert srm["split"] == 0.5 and srm["warning"] is None
    srm_p = page.locator(f"section[data-experiment='{NAME}'] p.srm")
    assert srm_p.text_content() == f"Sample ratio: {srm['summary']}."
    assert "warn" not in srm_p.get_attribute("class")
    with page.expect_download() as dl:
        page.click("button[data-format='png']")
    assert Path(dl.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # with --ab-log-content: the latest replies and prompts, as text
    server.app.state.steer.decisions.log.content = True
    try:
        steered = next(u for u, a in arms.items() if a == "steered")
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": XSS}],
            "max_tokens": 8,
            "user": steered,
        }
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        page.wait_for_selector("#recent td.prompt")
        assert page.locator("#recent td.prompt").first.text_content() == XSS
        assert page.locator("#recent td.reply").first.text_content().startswith("<")
        assert page.locator("#recent img, #recent script").count() == 0
        assert page.evaluate("window.pwned") is None
    finally:
        server.app.state.steer.decisions.log.content = False


def test_experiments_refused_beyond_loopback_without_key(tiny_llama: Path) -> None:
    """Admin-level data: served on 0.0.0.0 without a key, /experiments' data is refused like the
    vectors admin, while the page itself (no data) opens. No engine is started."""
    from fastapi.testclient import TestClient

    from steerserve.server import create_app

    client = TestClient(create_app(tiny_settings(tiny_llama, api_key=None, host="0.0.0.0")))
    r = client.get("/v1/steering/experiments")
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled", r.text
    assert client.get("/v1/steering/experiments/report.png").status_code == 403
    assert client.get("/experiments").status_code == 200
