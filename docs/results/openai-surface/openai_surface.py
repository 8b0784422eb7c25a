"""The OpenAI surface on a real model, by hand (issue 29's acceptance): the ``openai`` SDK's
``parse`` and a tool round trip (``tool_choice`` required), steered and unsteered; JSON-schema
output for 20 prompts; lm-eval ``local-completions`` multiple choice with the base model id and
with the ``<model>:steering-on`` preset (lm-eval cannot add a body field; the preset is chosen by
``model`` alone). Every reply is written to ``--out`` (JSON lines) with a summary.

    .venv/bin/python docs/results/openai-surface/openai_surface.py --model default --out docs/results/openai-surface
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pydantic import BaseModel

COUNTRIES = [
    ("France", "フランス"), ("Germany", "ドイツ"), ("Italy", "イタリア"), ("Spain", "スペイン"),
    ("Japan", "日本"), ("China", "中国"), ("Egypt", "エジプト"), ("Brazil", "ブラジル"),
    ("Canada", "カナダ"), ("Russia", "ロシア"), ("India", "インド"), ("Mexico", "メキシコ"),
    ("Kenya", "ケニア"), ("Peru", "ペルー"), ("Greece", "ギリシャ"), ("Norway", "ノルウェー"),
    ("Turkey", "トルコ"), ("Chile", "チリ"), ("Poland", "ポーランド"), ("Thailand", "タイ"),
]  # fmt: skip
CAPITALS = [
    "Paris", "Berlin", "Rome", "Madrid", "Tokyo", "Beijing", "Cairo", "Brasília", "Ottawa",
    "Moscow", "New Delhi", "Mexico City", "Nairobi", "Lima", "Athens", "Oslo", "Ankara",
    "Santiago", "Warsaw", "Bangkok",
]  # fmt: skip


class Capital(BaseModel):
    country: str
    capital: str
    confident: bool


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


def serve(model: str, port: int, steering: str) -> subprocess.Popen:
    env = {**os.environ, "STEERSERVE_STEERING": steering}
    cmd = [sys.executable, "-m", "steerserve", "serve", "--model", model, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                print(f"ready after {time.monotonic() - t0:.0f} s", flush=True)
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        time.sleep(1)
    raise SystemExit("server not ready")


def sdk_checks(url: str, model: str, log: list[dict]) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out: dict = {}
    for steering in (False, True):
        extra = {"steering": steering}
        r = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": "フランスの首都はどこですか？JSONで答えて。"}],
            response_format=Capital,
            max_tokens=64,
            temperature=0,
            extra_body=extra,
        )
        parsed = r.choices[0].message.parsed
        log.append(
            {"check": "parse", "steering": steering, "content": r.choices[0].message.content}
        )
        print("parse", steering, parsed, r.model_extra["steering"]["applied"], flush=True)
        msgs = [{"role": "user", "content": "東京の天気を摂氏で教えて。"}]
        r = client.chat.completions.create(
            model=model, messages=msgs, tools=[WEATHER], tool_choice="required",
            max_tokens=96, temperature=0, extra_body=extra,
        )  # fmt: skip
        call = r.choices[0].message.tool_calls[0]
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
        ]
        final = client.chat.completions.create(
            model=model, messages=msgs, tools=[WEATHER], max_tokens=64, temperature=0,
            extra_body=extra,
        )  # fmt: skip
        text = final.choices[0].message.content
        log.append({"check": "tools", "steering": steering, "call": call.function.model_dump(),
                    "final": text})  # fmt: skip
        print("tool", steering, call.function.name, call.function.arguments, "->", text, flush=True)
        out[f"parse_{steering}"] = parsed is not None
        out[f"tool_{steering}"] = call.function.name == "get_weather"
    schema = {"name": "capital", "schema": Capital.model_json_schema()}
    valid = 0
    for en, ja in COUNTRIES:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": model, "max_tokens": 64, "temperature": 0,
                  "messages": [{"role": "user", "content": f"{ja}の首都は？"}],
                  "response_format": {"type": "json_schema", "json_schema": schema}},
            timeout=300,
        ).json()  # fmt: skip
        content = r["choices"][0]["message"]["content"]
        try:
            Capital.model_validate_json(content)
            valid += 1
        except ValueError:
            pass
        log.append({"check": "json_schema", "country": en, "content": content})
    out["json_schema_valid"] = f"{valid}/{len(COUNTRIES)}"
    print("json_schema valid", out["json_schema_valid"], flush=True)
    return out


def lm_eval_mc(url: str, model: str, tokenizer: str, label: str, log: list[dict]) -> float:
    """20 four-way multiple-choice questions (capital of a country, asked in Japanese)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ.update(OPENAI_API_KEY="unused", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        docs = []
        for i, (_en, ja) in enumerate(COUNTRIES):
            wrong = [CAPITALS[(i + k) % len(CAPITALS)] for k in (3, 7, 11)]
            choices = [CAPITALS[i], *wrong]
            gold = i % 4
            choices[0], choices[gold] = choices[gold], choices[0]
            docs.append({"q": f"{ja}の首都は", "choices": choices, "gold": gold})
        data = Path(tmp, "mc.jsonl")
        data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
        Path(tmp, "mc.yaml").write_text(
            "task: capitals_ja_mc\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
            "output_type: multiple_choice\ndoc_to_text: '{{q}}'\n"
            "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\n"
            "target_delimiter: ' '\nmetric_list:\n  - metric: acc\n"
        )
        res = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(f"model={model},base_url={url}/v1/completions,tokenizer={tokenizer},"
                        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"),
            tasks=["capitals_ja_mc"],
            task_manager=TaskManager(include_path=tmp),
        )  # fmt: skip
    acc = res["results"]["capitals_ja_mc"]["acc,none"]
    log.append({"check": "lm_eval", "arm": label, "acc": acc})
    print("lm-eval", label, acc, flush=True)
    return acc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--out", type=Path, default=Path("docs/results/openai-surface"))
    ap.add_argument("--url", help="a server already serving --model (none: start one)")
    args = ap.parse_args()
    from steerserve.models import resolve_model

    path = resolve_model(args.model)
    name = Path(path).name
    url = args.url or f"http://127.0.0.1:{args.port}"
    log: list[dict] = []
    summary: dict = {"model": name}
    t0 = time.monotonic()
    proc = None if args.url else serve(args.model, args.port, "off")
    try:
        summary |= sdk_checks(url, name, log)
        for model_id in (name, f"{name}:steering-on"):
            summary[f"lm_eval {model_id}"] = lm_eval_mc(url, model_id, str(path), model_id, log)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    summary["seconds"] = round(time.monotonic() - t0)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replies.jsonl").write_text(
        "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in log)
    )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    print(json.dumps(summary, ensure_ascii=False))


if __name__ == "__main__":
    main()
