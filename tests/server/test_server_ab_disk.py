"""A full disk under the A/B decision log (issue 33), over real HTTP on the tiny Llama: every
answered enrolled request's decision line is in the log whole or counted as lost, exactly, never
half-written nor written late; feedback on a lost decision is refused; ``ab-report`` reads the
log whole. The log lives on a 64 KiB tmpfs the test fills and frees (mounting needs root: the
module is skipped, saying so, where it is not permitted)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server import FR, MODEL, Server, metric, tiny_server
from test_server_ab import _ab

from steerserve.server.ab.experiment import DecisionLog, Decisions

PAGE = 4096  # tmpfs hands out space a page at a time
FAILURES = "steerserve_ab_log_failures_total"


@contextlib.contextmanager
def small_disk(path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs at ``path`` (skips the test where mounting is not permitted)."""
    cmd = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The server's tmpfs, unmounted after the server closed its log."""
    with small_disk(tmp_path_factory.mktemp("disk")) as path:
        yield path


@pytest.fixture(scope="module")
def server(tiny_llama: Path, root: Path, disk: Path) -> Iterator[Server]:
    # 12 prompts of 400 bytes a request: more prompt tokens than capacity.budget's default
    kw = {"ab_log_content": True, "max_prompt_tokens_per_request": 8192}
    with tiny_server(tiny_llama, **_ab(root, ab_log=str(disk / "ab.jsonl"), **kw)) as srv:
        yield srv


def fill(disk: Path) -> None:
    """Write a filler file until the tmpfs says it is full."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"x" * 65536):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def answer(http: httpx.Client, user: str, size: int, batch: int = 1) -> str:
    """An enrolled completion of ``batch`` prompts of ``size`` bytes each (its decision line,
    prompts included with --ab-log-content, is a little longer than their sum); its id."""
    prompt = (FR * (size // len(FR.encode()) + 1)).encode()[:size].decode("utf-8", "ignore")
    body = {"model": MODEL, "prompt": [prompt] * batch, "max_tokens": 1, "user": user}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["steering"]["experiment"]["arm"] in ("steered", "unsteered")
    return str(r.json()["id"])


def decision_lines(log: Path) -> dict[str, dict[str, Any]]:
    """The log's decisions by id; every line must be whole JSON (no torn or joined lines)."""
    data = log.read_bytes()
    assert not data or data.endswith(b"\n"), f"a torn last line: {data[-200:]!r}"
    out = {}
    for line in data.decode().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a whole line in the log: {line[:300]!r}") from None
        if rec["type"] == "decision":
            assert rec["id"] not in out, f"decision {rec['id']} logged twice"
            out[rec["id"]] = rec
    return out


def test_a_full_disk_loses_whole_lines_counted_exactly(
    http: httpx.Client, disk: Path, root: Path
) -> None:
    """Fill the tmpfs with the log's last page part used, so that its lines fit, are cut short
    (one longer than what is left of the page: a short write) or find no space at all, in turn;
    then free it. Each answered request's decision is in the log, whole and once, or counted in
    the failure metric; nothing counted turns up later; feedback on a lost one is a 409."""
    log = disk / "ab.jsonl"
    answered = [answer(http, "before-0", 100)]
    # at least 1500 bytes of the log's last page left: a short line still fits once the disk is
    # full, a batch of 12 x 400 bytes cannot (whatever is left), so it is a short write
    while not 1500 <= PAGE - log.stat().st_size % PAGE < PAGE:
        answered.append(answer(http, f"before-{len(answered)}", 300))
    assert metric(http, FAILURES) == 0
    fill(disk)
    full: list[str] = []
    sizes = [(400, 12), (300, 1), (20, 1), (450, 1), (200, 1), (400, 12), (50, 1), (350, 1)] * 4
    for i, (size, batch) in enumerate(sizes):
        full.append(answer(http, f"full-{i}", size, batch))
    assert set(decision_lines(log)) <= set(answered + full)
    (disk / "filler").unlink()
    after = [answer(http, f"after-{i}", 100) for i in range(3)]
    answered += full + after

    logged = decision_lines(log)
    lost = [rid for rid in answered if rid not in logged]
    assert set(logged) <= set(answered), "a decision in the log that was never answered"
    assert all(rid in logged for rid in after), "the freed disk does not take lines again"
    assert metric(http, FAILURES) == len(lost), (len(lost), sorted(lost))
    assert lost and any(rid in logged for rid in full), "the disk was not full, or always full"

    for rid in lost:  # the decision was never logged: its score could never be joined
        r = http.post("/v1/steering/feedback", json={"id": rid, "score": 1})
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "decision_not_logged", r.text
    kept = next(rid for rid in full if rid in logged)
    r = http.post("/v1/steering/feedback", json={"id": kept, "score": 1})
    assert r.status_code == 200, r.text

    from typer.testing import CliRunner

    from steerserve.cli import app

    out = CliRunner().invoke(app, ["ab-report", str(log), "--out", str(root / "report")])
    assert out.exit_code == 0, out.output
    rep = json.loads((root / "report" / "report.json").read_text())
    assert (rep["skipped_lines"], rep["requests"]) == (0, len(logged)), rep


def test_a_line_the_disk_cuts_short_is_taken_back(tmp_path: Path) -> None:
    """On a full disk a line longer than what is left of the file's last page is written in part
    (a short write) and cut back: the file is as before, one failure counted; a line that fits
    is still written after it."""
    with small_disk(tmp_path) as disk:
        log = DecisionLog(disk / "ab.jsonl")
        try:
            assert log.write({"type": "decision", "id": "a"})
            fill(disk)
            before = (disk / "ab.jsonl").read_bytes()
            assert not log.write({"type": "decision", "id": "b", "pad": "x" * 2 * PAGE})
            assert (disk / "ab.jsonl").read_bytes() == before and log.failures == 1
            assert log.write({"type": "decision", "id": "c"})
            ids = [json.loads(x)["id"] for x in (disk / "ab.jsonl").read_text().splitlines()]
            assert ids == ["a", "c"] and log.failures == 1
        finally:
            log.close()


def test_a_log_torn_by_a_crash_takes_whole_lines_after_it(tmp_path: Path) -> None:
    """A log whose last line a crash tore: the next line starts on a line of its own (the torn
    one stays unreadable, counted by ``ab-report``), and a restarted server knows the decision
    for feedback. A lone surrogate in a prompt (valid JSON) is written as its escape, not an
    error."""
    path = tmp_path / "ab.jsonl"
    path.write_text('{"type":"decision","id":"old"}\n{"type":"deci')
    log = DecisionLog(path, content=True)
    try:
        assert Decisions(log).record("new", {"arm": "steered", "prompt": ["a\ud800b"]})
    finally:
        log.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"type":"deci' and json.loads(lines[2])["prompt"] == ["a\ud800b"]
    log = DecisionLog(path)
    try:
        assert Decisions(log).get("new") == {"experiment": None, "arm": "steered", "language": None}
        log.close()
        assert not log.write({"type": "decision", "id": "late"}) and log.failures == 1
    finally:
        log.close()
