"""Issue 57's acceptance on the small embedded model: two replicas, three arms, a ramp under one
name, on one experiment store; one run, not a test (the suite runs the same shape on a tiny model
in one process: tests/server/ab/test_ab_registry.py::test_two_replicas_a_ramp_and_the_report_per_phase_...).

Two ``steerserve serve`` processes of ``--model`` (default gemma-3-270m, its shipped vectors) on
one ``--store`` (default: a SQLite file in a temporary folder; ``pg`` starts a throwaway
PostgreSQL as the tests do), experiment ``ramp57`` with arms ``control=off``, ``v1=on`` (the
shipped artifact) and ``v2={"interventions": {"recall": 1.0}}`` (one of its two vectors):

1. phase 1, allocation control 0.8 / v1 0.1 / v2 0.1 (20 % steered): every user asks both
   replicas; each answer of A is scored by a feedback posted to B;
2. the ramp to control 0.5 / v1 0.25 / v2 0.25 (50 %) as a rolling restart does it: A restarted
   with the new flags starts phase 2, B (still on the old flags) follows the store's record, then
   B restarted with the new flags joins it; every user asks both again.

Checked: per subject and phase the same arm on both replicas and on every request; across the ramp a subject moves only
from the control into a treatment; ``steerserve ab-report STORE`` (no ``--split``) reports two
phases with their allocations and sample-ratio checks, and the experiment's comparison is the
latest phase's alone (no pooled difference). JSON on stdout (docs/results/ab-store/).

    .venv/bin/python docs/results/ab-store/ab_ramp.py [--store pg|URL] [--users 60]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
NAME = "ramp57"
ARMS = ["control=off", "v1=on", 'v2={"interventions": {"recall": 1.0}}']
LOW, HIGH = "control=0.8,v1=0.1,v2=0.1", "control=0.5,v1=0.25,v2=0.25"
QUESTIONS = [
    "日本の首都は",
    "한국의 수도는",
    "La capitale de l'Italie est",
    "Die Hauptstadt von Spanien ist",
]


def start(name: str, model: str, store: str, allocation: str, logs: Path) -> harness.Server:
    flags = ["--max-model-len", "512", "--api-key", KEY]
    flags += ["--ab-name", NAME, "--ab-store", store, "--ab-allocation", allocation]
    for arm in ARMS:
        flags += ["--ab-arm", arm]
    flags += ["--served-model-name", "small", "--log-level", "info"]
    return harness.serve(name, model, flags, logs / f"{name}-{allocation[8:11]}", wait=False)


def ask(c: httpx.Client, user: str, i: int) -> dict[str, Any]:
    body = {"model": "small", "max_tokens": 4, "temperature": 0, "user": user}
    body["messages"] = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    r = c.post("/v1/chat/completions", json=body)
    exp = r.json()["steering"]["experiment"] if r.status_code == 200 else {}
    return {"status": r.status_code, "id": r.json().get("id"), **exp}


def phase_of(c: httpx.Client) -> int:
    return int(c.get("/v1/steering/experiments").json()["experiment"]["phase"])


def drained(clients: list[httpx.Client]) -> None:
    """Each replica's queue written (a real signal, no sleep-and-hope)."""
    for c in clients:
        while c.get("/v1/steering/experiments").json()["store"]["queued"]:
            time.sleep(0.1)


def traffic(ra: httpx.Client, rb: httpx.Client, users: int, tag: str) -> list[dict[str, Any]]:
    rows = []
    for i in range(users):
        user = f"user-{i}"
        x, y = ask(ra, user, i), ask(rb, user, i)
        fb = rb.post("/v1/steering/feedback", json={"id": x["id"], "score": i % 2})
        rows.append({"user": user, "pass": tag, "phase": 1 if tag == "phase 1" else 2, "a": x,
                     "b": y, "feedback_on_b": fb.status_code,
                     "feedback_arm": fb.json().get("arm")})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--store", help="a store URL, or pg (default: SQLite in a temp folder)")
    ap.add_argument("--users", type=int, default=60)
    a = ap.parse_args()
    pg = None
    with tempfile.TemporaryDirectory(prefix="bench-ab-ramp-") as tmp:
        root = Path(tmp)
        store = a.store or f"sqlite:///{root}/ab.db"
        if store == "pg":
            sys.path.insert(0, str(ROOT / "tests"))
            from _postgres import Postgres, bindir

            pg = Postgres(bindir())
            pg.start()
            store = pg.database("ramp57")
        timing: dict[str, float] = {}
        reps: list[harness.Server] = []
        try:
            t0 = time.perf_counter()
            reps = [start(n, a.model, store, LOW, root) for n in ("A", "B")]
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda p: p.wait_ready(), reps))
            timing["both_ready_s"] = time.perf_counter() - t0
            ra, rb = (httpx.Client(base_url=p.url, headers=HEADERS, timeout=600) for p in reps)
            rows = traffic(ra, rb, a.users, "phase 1")
            drained([ra, rb])
            # the ramp, as a rolling restart does it: A first (a new phase), B follows, B next
            reps[0].stop()
            t0 = time.perf_counter()
            reps[0] = start("A", a.model, store, HIGH, root)
            reps[0].wait_ready()
            ra = httpx.Client(base_url=reps[0].url, headers=HEADERS, timeout=600)
            timing["a_restarted_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            while phase_of(rb) != 2:  # B, on its old flags, follows the store's record
                time.sleep(0.2)
            timing["b_followed_s"] = time.perf_counter() - t0
            rows += traffic(ra, rb, a.users // 2, "phase 2, B on old flags")
            drained([ra, rb])
            reps[1].stop()
            reps[1] = start("B", a.model, store, HIGH, root)
            reps[1].wait_ready()
            rb = httpx.Client(base_url=reps[1].url, headers=HEADERS, timeout=600)
            rows += traffic(ra, rb, a.users, "phase 2")
            drained([ra, rb])
            page = ra.get("/v1/steering/experiments").json()["experiment"]
        finally:
            for p in reps:
                p.stop()
        rep_dir = root / "rep"
        cmd = [sys.executable, "-m", "steerserve", "ab-report", store, "--out", str(rep_dir)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if pg is not None:
            pg.close()
        if done.returncode:
            raise SystemExit(f"ab-report failed:\n{done.stdout}\n{done.stderr}")
        report = json.loads((rep_dir / "report.json").read_text())
        markdown = (rep_dir / "report.md").read_text()
    print(json.dumps(summarise(a, store, rows, page, report, markdown, timing), indent=1))


def summarise(
    a: Any, store: str, rows: list[dict[str, Any]], page: dict[str, Any], report: dict[str, Any],
    markdown: str, timing: dict[str, float],
) -> dict[str, Any]:  # fmt: skip
    exp = report["experiments"][NAME]
    by_user: dict[str, dict[int, str]] = {}
    for r in rows:
        by_user.setdefault(r["user"], {})[r["phase"]] = r["a"].get("arm")
    moved = [(u, p[1], p[2]) for u, p in by_user.items() if 1 in p and 2 in p and p[1] != p[2]]
    phases = [{k: p[k] for k in ("phase", "allocation", "requests", "why")} |
              {"srm": {k: p["srm"].get(k) for k in ("checked", "flagged", "p_value", "counts",
                                                     "subjects_in_both_arms")}}
              for p in exp["phases"]]  # fmt: skip
    overall = exp["overall"]["arms"]
    checks = {
        "answered_200": sum(r["a"]["status"] == r["b"]["status"] == 200 for r in rows),
        "same_arm_on_both": sum(r["a"].get("arm") == r["b"].get("arm") for r in rows),
        "same_arm_within_a_phase": sum(
            r["a"].get("arm") == by_user[r["user"]][r["phase"]] for r in rows
        ),
        "feedback_on_other_replica_200": sum(
            r["feedback_on_b"] == 200 and r["feedback_arm"] == r["a"].get("arm") for r in rows
        ),
        "moved_other_than_control_to_treatment": sum(m[1] != "control" for m in moved),
        "report_phases": [p["phase"] for p in exp["phases"]],
        "report_srm_checked": [p["srm"].get("checked") for p in exp["phases"]],
        "report_srm_flagged": [p["srm"].get("flagged") for p in exp["phases"]],
        "overall_is_latest_phase": exp["phase"] == 2
        and sum(v["requests"] for v in overall.values()) == exp["phases"][-1]["requests"],
        "report_decisions": report["requests"],
        "report_has_phase_headings": "### Phase 1 (control 0.8, v1 0.1, v2 0.1)" in markdown
        and "### Phase 2 (control 0.5, v1 0.25, v2 0.25)" in markdown,
    }
    n = len(rows)
    want = {"answered_200": n, "same_arm_on_both": n, "same_arm_within_a_phase": n,
            "feedback_on_other_replica_200": n, "moved_other_than_control_to_treatment": 0,
            "report_phases": [1, 2], "report_srm_checked": [True, True],
            "overall_is_latest_phase": True, "report_decisions": 2 * n,
            "report_has_phase_headings": True}  # fmt: skip
    bad = {k: (checks[k], v) for k, v in want.items() if checks[k] != v}
    print("PASS" if not bad else f"FAIL {bad}", file=sys.stderr)
    return {
        "model": a.model,
        "store": store.split("://")[0],
        "cpu": harness.cpu_info(),
        "users": a.users,
        "timing_s": {k: round(v, 1) for k, v in timing.items()},
        "checks": checks,
        "failed": bad,
        "moved_in_the_ramp": {
            f"{x} -> {y}": sum((m[1], m[2]) == (x, y) for m in moved)
            for x, y in sorted({(m[1], m[2]) for m in moved})
        },  # fmt: skip
        "phases": phases,
        "overall_arms": {k: v["requests"] for k, v in overall.items()},
        "comparisons": sorted(exp["overall"].get("comparisons", {})),
        "family": exp.get("family"),
        "page_experiment": page,
    }


if __name__ == "__main__":
    main()
