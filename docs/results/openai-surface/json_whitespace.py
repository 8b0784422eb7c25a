"""Steered structured output and JSON whitespace (issue 44, item 8), on a real model.

For each structured-outputs config (steerserve's compact default, and vLLM's any-whitespace one
given with ``--structured-outputs-config``), one server: 20 chat requests with a JSON schema, each
unsteered and steered (``steering: true``), ``max_tokens`` 60; counts the answers that parse as
JSON and those cut at ``max_tokens``. Every reply goes to ``--out``/replies.jsonl.

    .venv/bin/python docs/results/openai-surface/json_whitespace.py --model default \
        --out docs/results/json-whitespace
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from openai_surface import COUNTRIES, Capital

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

CONFIGS = {
    "compact (default)": [],
    "any whitespace": [
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": false}',
    ],
}


def run(model: str, args: list[str], log: Path) -> list[dict]:
    srv = harness.serve("steerserve", model, args, log.parent)
    rows = []
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            name = c.get("/v1/models").json()["data"][0]["id"]
            fmt = {
                "type": "json_schema",
                "json_schema": {"name": "capital", "schema": Capital.model_json_schema()},
            }
            for steering in (False, True):
                for country, ja in COUNTRIES:
                    q = f"{ja}の首都はどこですか？ JSONで答えてください。"
                    body = {
                        "model": name,
                        "messages": [{"role": "user", "content": q}],
                        "max_tokens": 60,
                        "temperature": 0,
                        "response_format": fmt,
                        "steering": steering,
                    }
                    r = c.post("/v1/chat/completions", json=body).json()
                    text = r["choices"][0]["message"]["content"]
                    try:
                        json.loads(text)
                        valid = True
                    except (TypeError, ValueError):
                        valid = False
                    rows.append(
                        {
                            "country": country,
                            "steering": steering,
                            "applied": r["steering"]["applied"],
                            "finish_reason": r["choices"][0]["finish_reason"],
                            "valid": valid,
                            "text": text,
                        }
                    )
    finally:
        srv.stop(120)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default="docs/results/json-whitespace")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary, replies = {"model": a.model}, []
    for label, args in CONFIGS.items():
        t = time.perf_counter()
        rows = run(a.model, args, out / "server.log")
        for r in rows:
            r["config"] = label
        replies += rows
        for steering in (False, True):
            mine = [r for r in rows if r["steering"] == steering]
            key = f"{label}, {'steered' if steering else 'unsteered'}"
            summary[key] = {
                "valid_json": f"{sum(r['valid'] for r in mine)}/{len(mine)}",
                "cut_at_max_tokens": sum(r["finish_reason"] == "length" for r in mine),
                "applied": sum(r["applied"] for r in mine),
            }
        summary[f"{label} seconds"] = round(time.perf_counter() - t)
    (out / "replies.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in replies)
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(summary, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
