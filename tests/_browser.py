"""Headless Chromium for the page tests: Debian's ``chromium`` driven by Playwright (no browser
download), or a skip that says what to install; and a tiny model that replies with markup."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("STEERSERVE_CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: Where screenshots go: test artifacts by default; docs/img (the README's) when asked.
SHOTS = Path(
    os.environ.get("STEERSERVE_SCREENSHOTS", Path(__file__).parents[1] / ".work" / "screenshots")
)


def chromium() -> Iterator[Any]:
    """A headless Chromium (a fresh profile each run), or a skip naming what is missing."""
    if not Path(CHROMIUM).is_file():
        pytest.skip(
            f"browser tests: no Chromium at {CHROMIUM}; install it with `make browser` "
            "(apt-get install chromium fonts-ipafont-gothic) or set STEERSERVE_CHROMIUM"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("browser tests: the playwright package is missing (pip install -e '.[dev]')")
    profile = tempfile.mkdtemp(prefix="steerserve-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 860},
            accept_downloads=True,
        )
        try:
            yield ctx
        finally:
            ctx.close()
            shutil.rmtree(profile, ignore_errors=True)


def expect(target: Any) -> Any:
    """Playwright's ``expect`` (imported late: without playwright the tests skip, not fail)."""
    from playwright.sync_api import expect

    return expect(target)


def screenshot(page: Any, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def parrot(tiny: Path, dest: Path, text: str = "<script>") -> Path:
    """A copy of the tiny Llama whose greedy reply repeats ``text`` whatever it is asked: each
    byte's successor (the last's is the first) is wired into an untied head and attention and MLPs
    are zeroed, so the residual is the current byte's embedding. A real server then replies
    with markup. ``text`` needs distinct bytes."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    if (dest / "config.json").is_file():
        return dest
    shutil.copytree(tiny, dest)
    ids = AutoTokenizer.from_pretrained(dest).encode(text, add_special_tokens=False)
    assert len(set(ids)) == len(ids) == len(text.encode()), text
    weights = load_file(dest / "model.safetensors")
    emb = weights["model.embed_tokens.weight"]
    hidden = emb.shape[1]
    basis = torch.linalg.qr(
        torch.randn(hidden, len(ids), generator=torch.Generator().manual_seed(0))
    )[0]
    head = torch.zeros_like(emb)
    for k, tid in enumerate(ids):
        emb[tid] = basis[:, k]
        head[ids[(k + 1) % len(ids)]] = 30 * basis[:, k]
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    weights["lm_head.weight"] = head
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    return dest
