"""Two replicas of an embedded model on one experiment store (issue 47's acceptance, on the
small model): one run, not a test (the suite runs the same case on a tiny model, both stores:
tests/server/ab/test_ab_store.py::test_two_servers_share_one_store).

Two ``steerserve serve`` processes of ``--model`` (default gemma-3-270m, its shipped vectors),
both with ``--ab-split 0.5`` and the same ``--ab-store`` (default: a SQLite file in a temporary
folder). 20 users each ask both replicas; the arm each replica gives must be the same and the
one the assignment hash gives; each answer of replica A is scored by a feedback posted to
replica B (must be 200 and name the arm). Then ``steerserve ab-report STORE`` must count 40
decisions and 20 scores. The result goes to stdout as JSON (docs/results/ab-store/).

    .venv/bin/python docs/results/ab-store/ab_replicas.py [--model gemma-3-270m] [--store URL]
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

import httpx

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def start(name: str, model: str, store: str, logs: Path) -> harness.Server:
    flags = ["--max-model-len", "512", "--api-key", KEY]
    flags += ["--ab-split", "0.5", "--ab-name", "replicas", "--ab-store", store]
    flags += ["--served-model-name", "small", "--log-level", "warning"]
    return harness.serve(name, model, flags, logs / name, wait=False)


def main() -> None:
    from steerserve.server.ab.experiment import Experiment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--store", help="the store URL (default: a SQLite file in a temp folder)")
    ap.add_argument("--users", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ab-replicas-") as tmp:
        root = Path(tmp)
        store = a.store or f"sqlite:///{root}/ab.db"
        reps = [start(n, a.model, store, root) for n in ("A", "B")]
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(lambda p: p.wait_ready(), reps))
            ready_s = time.perf_counter() - t0
            ra, rb = (httpx.Client(base_url=p.url, headers=HEADERS, timeout=600) for p in reps)
            exp, rows = Experiment("replicas", 0.5), []
            for i in range(a.users):
                user = f"user-{i}"
                body = {"model": "small", "max_tokens": 4, "temperature": 0, "user": user}
                body["messages"] = [{"role": "user", "content": "日本の首都は"}]
                x, y = (c.post("/v1/chat/completions", json=body) for c in (ra, rb))
                arms = [r.json()["steering"]["experiment"]["arm"] for r in (x, y)]
                fb = rb.post("/v1/steering/feedback", json={"id": x.json()["id"], "score": i % 2})
                rows.append({
                    "user": user, "status": [x.status_code, y.status_code], "arms": arms,
                    "hashed_arm": exp.assign(user).arm, "feedback_on_B": fb.status_code,
                    "feedback_arm": fb.json().get("arm"),
                })  # fmt: skip
            for c in (ra, rb):  # each replica's queue written (a real signal, no sleep-and-hope)
                while (snap := c.get("/v1/steering/experiments").json())["store"]["queued"]:
                    time.sleep(0.1)
            page = {"requests_seen_by_each_replica": snap["report"]["requests"]}
        finally:
            for p in reps:
                p.stop()
        rep = subprocess.run(
            [sys.executable, "-m", "steerserve", "ab-report", store, "--out", str(root / "rep")],
            capture_output=True,
            text=True,
        )
        if rep.returncode:
            raise SystemExit(f"ab-report failed:\n{rep.stdout}\n{rep.stderr}")
        report = json.loads((root / "rep" / "report.json").read_text())
    arms = report["experiments"]["replicas"]["overall"]["arms"]
    scores = sum(arms[k]["score"]["n"] for k in arms)
    checks = {
        "arms_equal_on_both": sum(r["arms"][0] == r["arms"][1] == r["hashed_arm"] for r in rows),
        "all_answered_200": sum(r["status"] == [200, 200] for r in rows),
        "feedback_to_other_replica_200": sum(
            r["feedback_on_B"] == 200 and r["feedback_arm"] == r["arms"][0] for r in rows
        ),
        "report_decisions": report["requests"],
        "report_scores": scores,
    }
    out = {
        "model": a.model,
        "store": store.split("://")[0],
        "cpu": harness.cpu_info(),
        "ready_s_both": round(ready_s, 1),
        "users": a.users,
        "checks": checks,
        "page": page,
        "arms": {
            k: {"requests": v["requests"], "scores": v["score"]["n"]} for k, v in arms.items()
        },
        "rows": rows,
    }
    print(json.dumps(out, indent=2))
    want = {"arms_equal_on_both": a.users, "all_answered_200": a.users}
    want |= {"feedback_to_other_replica_200": a.users, "report_decisions": 2 * a.users}
    want |= {"report_scores": a.users}
    bad = {k: (checks[k], v) for k, v in want.items() if checks[k] != v}
    print("PASS" if not bad else f"FAIL {bad}", file=sys.stderr)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
