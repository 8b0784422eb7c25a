"""The pages' acceptance on the real default model, by hand (not a test: it needs the 1.5B model
and minutes of CPU): serve it with an A/B split, ask /compare in Japanese in headless Chromium,
send split requests with feedback, and screenshot /compare and /experiments.

    .venv/bin/python docs/results/pages/pages_real_model.py --out docs/img/real

Prints what each arm answered and what was applied; exits non-zero if a page did not show it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
QUESTION = "フランスの首都はどこですか？"


def wait_ready(url: str, proc: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    sys.exit("server not ready in time")


def split_traffic(url: str, n: int) -> None:
    """``n`` enrolled requests (alternating fr/ja questions, one subject each) with feedback."""
    qs = ["Quelle est la capitale de la France ?", "日本の首都はどこですか？"]
    with httpx.Client(base_url=url, timeout=600) as c:
        for i in range(n):
            body = {"model": "qwen2.5-coder-1.5b-instruct", "max_tokens": 16, "temperature": 0,
                    "user": f"user-{i}", "messages": [{"role": "user", "content": qs[i % 2]}]}  # fmt: skip
            r = c.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            c.post("/v1/steering/feedback", json={"id": r.json()["id"], "score": 1 if i % 3 else 0})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(".work/screenshots/real"))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    log = tempfile.mkdtemp(prefix="pages-real-")
    cmd = [sys.executable, "-m", "steerserve", "serve", "--port", str(args.port),
           "--ab-split", "0.5", "--ab-name", "pages-real", "--ab-log", f"{log}/ab.jsonl",
           "--kv-cache-memory-bytes", str(1 << 30)]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=open(f"{log}/serve.log", "w"),
                            stderr=subprocess.STDOUT)  # fmt: skip
    try:
        t0 = time.monotonic()
        wait_ready(url, proc)
        print(f"ready in {time.monotonic() - t0:.0f} s")
        split_traffic(url, args.requests)
        from playwright.sync_api import expect, sync_playwright

        profile = tempfile.mkdtemp(prefix="chromium-")
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(
                profile, executable_path=os.environ.get("STEERSERVE_CHROMIUM", "/usr/bin/chromium"),
                headless=True, args=FLAGS, viewport={"width": 1280, "height": 860},
            )  # fmt: skip
            page = ctx.new_page()
            page.goto(f"{url}/compare")
            page.fill("#message", QUESTION)
            page.fill("#max_tokens", "32")
            page.click("#send")
            expect(page.locator("#status")).to_have_text(re.compile("^done"), timeout=600_000)
            for arm in ("unsteered", "steered"):
                reply = page.locator(f"#arm-{arm} .reply").text_content()
                applied = page.locator(f"#arm-{arm} dd").all_text_contents()
                print(f"{arm}: {reply!r} | {applied[:5]}")
            page.screenshot(path=str(args.out / "compare.png"), full_page=True)
            page.goto(f"{url}/experiments")
            page.wait_for_selector("text=pages-real", timeout=60_000)
            time.sleep(3)
            page.screenshot(path=str(args.out / "experiments.png"), full_page=True)
            body = page.locator("body").text_content() or ""
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)
        if not re.search(r"steered", body) or "unsteered" not in body:
            sys.exit("the experiments page does not show both arms")
        print(f"wrote {args.out}/compare.png, experiments.png")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)


if __name__ == "__main__":
    main()
