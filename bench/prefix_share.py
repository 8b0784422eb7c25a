"""Prefix-cache sharing between steered and unsteered requests (issue 32): ratios in one run.

One ``steerserve serve`` (the chat model's shipped artifact; ``steering: true`` applies its
interventions at ``last_prompt_and_generated``). Per round and prompt length, each on a fresh
prompt (a nonce first line, so no round or arm reads another's blocks), in an order rotated
every round:

* ``uu``: an unsteered chat request (it fills the cache), then the same unsteered, streamed:
  its TTFT;
* ``us``: the same, the second request steered: its TTFT. With sharing, the steered request
  reads every block before its last prompt token, like the unsteered one; without it, it
  prefills the whole prompt again.

At the longest length also the A/B endpoint (both arms of one fresh prompt, 16 tokens each,
collected) against one steered request on a fresh prompt (16 tokens): ``ab / one``.
Ratios are medians of per-round ratios with a 95 % bootstrap interval over rounds.

    .venv/bin/python bench/prefix_share.py --model default --rounds 4 --out docs/results/prefix
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path

import harness

WORDS = (
    "river stone market winter lantern copper meadow harbor orchard signal candle valley "
    "engine garden silver thunder pocket island ladder marble forest window bridge mirror"
).split()


def prompt_text(tokenizer, n: int, seed: int) -> str:  # noqa: ANN001
    """About ``n`` tokens of words after a nonce line (no two prompts share a block)."""
    import random

    rng = random.Random(seed)
    words = [f"Note {uuid.uuid4().hex}."]
    while len(tokenizer.encode(" ".join(words))) < n:
        words.extend(rng.choice(WORDS) for _ in range(64))
    ids = tokenizer.encode(" ".join(words))[:n]
    return tokenizer.decode(ids) + "\nSummarise the note in one word."


def chat(c, text: str, steering: bool, tokens: int, stream: bool):  # noqa: ANN001, ANN201
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "steering": steering,
    }
    if not stream:
        t0 = time.perf_counter()
        r = c.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - t0, r.json()
    t0 = time.perf_counter()
    with c.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                return time.perf_counter() - t0, None
    raise RuntimeError("no token streamed")


def pair(c, text: str, steered: bool) -> dict[str, float]:  # noqa: ANN001
    """Fill the cache with an unsteered request, then the TTFT of the second request."""
    cold, _ = chat(c, text, False, 1, False)
    ttft, _ = chat(c, text, steered, 2, True)
    return {"cold_s": cold, "ttft_s": ttft}


def ab_vs_one(c, tokenizer, n: int, seed: int) -> dict[str, float]:  # noqa: ANN001
    """The A/B endpoint's total time on a fresh prompt vs one steered request on another."""
    body = {"model": "bench", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    msg = [{"role": "user", "content": prompt_text(tokenizer, n, seed)}]
    t0 = time.perf_counter()
    r = c.post("/v1/chat/completions/ab", json=body | {"messages": msg, "steering": True})
    r.raise_for_status()
    ab = time.perf_counter() - t0
    arms = [r.json()[arm]["usage"] for arm in ("unsteered", "steered")]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in arms]
    one, _ = chat(c, prompt_text(tokenizer, n, seed + 1), True, 16, False)
    return {"ab_s": ab, "one_s": one, "ab_cached": cached}


def run(a: argparse.Namespace) -> dict:
    import httpx
    from transformers import AutoTokenizer

    model = harness.model_dir(a.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    logs = Path(tempfile.mkdtemp(prefix="prefix-share-"))
    flags = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--kv-cache-memory-bytes",
             str(a.kv_cache_bytes), "--served-model-name", "bench", "--steering", "off",
             "--log-level", "warning"]  # fmt: skip
    srv = harness.serve("steerserve", model, flags, logs)  # its shipped vectors
    rounds: list[dict] = []
    try:
        with httpx.Client(base_url=srv.url, timeout=1800) as c:
            chat(c, prompt_text(tokenizer, 64, -1), True, 2, False)  # warm-up
            for rnd in range(a.rounds):
                row: dict = {"round": rnd}
                arms = ["uu", "us"] if rnd % 2 == 0 else ["us", "uu"]
                for n in a.lengths:
                    for arm in arms:
                        seed = rnd * 100_000 + n * 2 + (arm == "us")
                        row[f"{arm}_{n}"] = pair(c, prompt_text(tokenizer, n, seed), arm == "us")
                row["ab"] = ab_vs_one(c, tokenizer, max(a.lengths), 1000 + rnd)
                rounds.append(row)
                print(json.dumps(row), flush=True)
    finally:
        srv.stop()
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    return {"cpu": harness.cpu_info(), "args": args | {"model": str(model)}, "rounds": rounds}


def summary(res: dict, lengths: list[int]) -> str:
    rs = res["rounds"]
    lines = [
        f"{res['cpu']}; {len(rs)} rounds",
        "",
        "| measure | median | 95 % CI |",
        "|---|---|---|",
    ]

    def row(name: str, num: list[float], den: list[float]) -> None:
        r = harness.ratio_summary(num, den)
        lines.append(f"| {name} | {r['median']:.3f} | [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] |")

    for n in lengths:
        us = [r[f"us_{n}"]["ttft_s"] for r in rs]
        uu = [r[f"uu_{n}"]["ttft_s"] for r in rs]
        cold = [r[f"uu_{n}"]["cold_s"] for r in rs]
        row(f"TTFT steered-after-unsteered / unsteered-after-unsteered, {n} tokens", us, uu)
        row(f"TTFT steered-after-unsteered / cold prefill, {n} tokens", us, cold)
    row(
        f"A/B endpoint / one steered request, {max(lengths)} tokens, 16 each",
        [r["ab"]["ab_s"] for r in rs],
        [r["ab"]["one_s"] for r in rs],
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--out", type=Path, default=None, help="folder for prefix_share.json")
    a = p.parse_args()
    res = run(a)
    text = summary(res, a.lengths)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "prefix_share.json").write_text(json.dumps(res, indent=1))
        (a.out / "prefix_share.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
