"""GPU checks of the steering plugin that the CPU tests cannot make (run by ``bench/gpu_check.sh``,
where the CUDA build of vLLM 0.33 and a GPU exist, e.g. the Dockerfile's GPU image).

One runner per run: Model Runner V2 (the GPU default) or V1 (``VLLM_USE_V2_MODEL_RUNNER=0``). A tiny
random Llama in float32 under vLLM's defaults (torch.compile + CUDA graphs, not eager), except that
graphs are captured only up to CAPTURE_MAX tokens, so the size loop also decodes above the largest
capture size (compiled code without a graph):
1. the active model runner is printed and must be the one asked for;
2. a mixed batch (steered / unsteered, different layers, scales, positions, operations, prompt
   lengths) equals each request run alone; its unsteered requests equal a stock engine's same
   batch; steering changes every steered request; scale 0 equals unsteered;
3. decode batches at, between (padding tail) and above the capture sizes: unsteered requests equal
   the stock engine's same batch, steered ones equal their solo runs;
4. greedy tokens and log-probabilities match the transformers forward-hook oracle on CUDA.

Comparisons are by log-probability, not exact tokens: batch composition legitimately changes the
numerics (fp32 runs on Triton attention, which picks its 2D or 3D kernel by batch shape and whose
fp32 dots use TF32), so two runs "agree" when their chosen tokens' log-probabilities are within
``--atol`` and, where their greedy tokens part, both saw a near tie (see ``compare``). A steered
request that differs between batch and solo counts as a failure only where the stock engine's own
batch and solo runs of that prompt agree; elsewhere it is reported as inconclusive.

    python bench/gpu_check.py --runner v2|v1 [--out DIR] [--atol 1e-3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MAX_TOKENS = 12
TOP_K = 5  # log-probabilities returned per step: enough to see a near tie from both sides
# Largest CUDA-graph capture size. vLLM 0.33's default would be min(2 * max_num_seqs, 512) = 512
# here (config/vllm.py:2460-2469, run from __post_init__ at :2013; 1024 on data-centre Blackwell),
# above every batch below. Set explicitly, the sizes are [1, 2, 4, 8, 16, ..., 64]
# (config/vllm.py:2552, 2578-2591), and a batch of more tokens runs without a graph: V1
# v1/cudagraph_dispatcher.py:270-279; MRV2 v1/worker/gpu/cudagraph_utils.py:380-394 (candidates
# only up to the largest size) and :534-553.
CAPTURE_MAX = 64
# Decode batch sizes: at capture sizes (1, 4, 8, 16, 24, 64), between them (3 -> 4, 7 -> 8, 13 ->
# 16, 33 -> 40: padding tokens must get row 0) and above the largest (65, 100, 256: no graph).
SIZES = (1, 3, 4, 7, 8, 13, 16, 24, 33, 64, 65, 100, 256)
SOLO_CHECKED = 4  # steered requests per size also run alone (and by the stock engine alone)

Steps = list[tuple[int, dict[int, float]]]  # per step: chosen token, {token: log-probability}

MIXED: list[list[dict[str, Any]] | None] = [
    None,
    [{"vector": "alpha", "layer": 1, "scale": 2.0, "positions": "all"}],
    [{"vector": "beta", "layer": 2, "scale": -1.5, "positions": "last_prompt_and_generated"}],
    [
        {"vector": "alpha", "layer": 0, "scale": 1.0, "positions": "all"},
        {"vector": "beta", "layer": 3, "scale": 2.5, "positions": "generated"},
    ],
    None,
    [{"vector": "beta", "layer": 1, "scale": 3.0, "positions": "generated"}],
    [  # the non-additive kernel (engine/ops.py), two slots on layer 2, then an add there
        {"vector": "alpha", "layer": 2, "scale": 1.0, "positions": "all", "op": "ablate"},
        {"vector": "beta", "layer": 2, "scale": 0.5, "positions": "generated", "op": "interp"},
        {"vector": "beta", "layer": 2, "scale": 1.0, "positions": "all"},
    ],
    [
        {
            "vector": "beta",
            "layer": 1,
            "scale": 1.0,
            "positions": "last_prompt_and_generated",
            "op": "replace",
        }
    ],
]


def _prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(4, 250, (int(3 + (i * 7) % 40),), generator=g).tolist()
        for i in range(n)
    ]


def _run(eng: Any, prompts: list[list[int]], steering: list | None) -> list[Steps]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP_K)
    out = []
    for o in eng.generate(prompts, sp, steering=steering):
        c = o.outputs[0]  # c.logprobs[i]: the top-K tokens and the chosen one
        out.append(
            [
                (t, {k: v.logprob for k, v in c.logprobs[i].items()})
                for i, t in enumerate(c.token_ids)
            ]
        )
    return out


def _solo(eng: Any, prompts: list[list[int]], steering: list, which: list[int]) -> dict[int, Steps]:
    return {i: _run(eng, [prompts[i]], [steering[i]])[0] for i in which}


def compare(a: Steps, b: Steps, atol: float) -> tuple[str, str]:
    """``match``: same tokens, chosen log-probabilities within ``atol``. ``tie``: equal up to a
    step where the greedy tokens part and each run's token is in the other's top-K within
    ``4 * atol`` of its own choice (both log-probabilities may move by ``atol``); what follows a
    tie legitimately differs and is not compared. ``differ``: anything else."""
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b, strict=True)):
        if ta == tb:
            if abs(la[ta] - lb[tb]) > atol:
                return "differ", f"step {i}: token {ta} logprob {la[ta]:.5f} vs {lb[tb]:.5f}"
            continue
        if tb in la and ta in lb and max(la[ta] - la[tb], lb[tb] - lb[ta]) <= 4 * atol:
            return "tie", f"step {i}: tokens {ta}/{tb} part at a near tie"
        return "differ", f"step {i}: token {ta} vs {tb}"
    return "match", ""


def judged(steered: tuple[str, str], stock: tuple[str, str]) -> bool | None:
    """A steered batch-vs-solo difference is a failure only if the stock engine's batch and solo
    runs of the same prompt agree; otherwise batch numerics alone explain it (None)."""
    if steered[0] != "differ":
        return True
    return None if stock[0] == "differ" else False


class Report:
    def __init__(self, runner: str) -> None:
        self.runner = runner
        self.results: dict[str, Any] = {"runner": runner, "checks": {}}

    def check(self, name: str, ok: bool | None, detail: str = "") -> None:
        word = {True: "PASS", False: "FAIL", None: "INCONCLUSIVE"}[ok]
        print(f"{word} [{self.runner}] {name} {detail}".rstrip(), flush=True)
        self.results["checks"][name] = {"ok": ok, "detail": detail}

    def verdicts(self, name: str, verdicts: list[bool | None], details: list[str]) -> None:
        """PASS if none failed and at least one was conclusive."""
        failed = [d for v, d in zip(verdicts, details, strict=True) if v is False]
        unsure = sum(v is None for v in verdicts)
        ok = False if failed else (None if unsure == len(verdicts) else True)
        self.check(name, ok, f"({unsure} inconclusive of {len(verdicts)}) {'; '.join(failed)}")

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.results["checks"].items() if v["ok"] is False]


def _cfg(model: Path, steering: bool) -> Any:
    from steerserve.engine.api import EngineConfig

    return EngineConfig(
        model=str(model),
        # fp32: FLASH_ATTN and FLASHINFER take fp16/bf16 only (v1/attention/backends/
        # flash_attn.py:289, flashinfer.py:572), so Hopper runs TRITON_ATTN (platforms/cuda.py:
        # 176-178; triton_attn.py:321-325), with CUDA-graph support ALWAYS (triton_attn.py:97).
        # It picks a 2D or split-KV 3D kernel by batch shape (v1/attention/ops/
        # triton_unified_attention.py:1070-1091), and its fp32 tl.dot calls (:547-549, :589) set
        # no input precision, so Triton's TF32 default applies: batch numerics differ by design.
        dtype="float32",
        max_model_len=512,
        max_num_seqs=256,
        kv_cache_memory_bytes=None,
        gpu_memory_utilization=0.3,
        enforce_eager=False,  # vLLM's defaults: O2 (config/vllm.py:435) -> VLLM_COMPILE
        # (:1827-1831) and FULL_AND_PIECEWISE graphs (:297-312)
        steering=steering,
        extra={"compilation_config": {"max_cudagraph_capture_size": CAPTURE_MAX}},
    )


def _describe_runner(eng: Any, report: Report) -> None:
    """The worker builds the runner from the same property (v1/worker/gpu_worker.py:206, 570-586;
    decided in config/vllm.py:731-767) and the same environment, so the front end's copy says."""
    cfg = eng.llm.llm_engine.vllm_config
    active = "v2" if cfg.use_v2_model_runner else "v1"
    where = {
        "v2": "Model Runner V2, vllm/v1/worker/gpu/model_runner.py",
        "v1": "V1 model runner, vllm/v1/worker/gpu_model_runner.py",
    }[active]
    cc = cfg.compilation_config
    print(
        f"[{report.runner}] active runner: {where}; compilation mode {cc.mode}, "
        f"cudagraph_mode (before the attention backend resolves it) {cc.cudagraph_mode}, "
        f"capture sizes {cc.cudagraph_capture_sizes}",
        flush=True,
    )
    report.results["active_runner"] = active
    report.check(f"active runner is {report.runner}", active == report.runner, where)
    sizes = cc.cudagraph_capture_sizes or []
    report.check(
        f"largest capture size is {CAPTURE_MAX}",
        bool(sizes) and max(sizes) == CAPTURE_MAX and max(SIZES) > CAPTURE_MAX,
        f"sizes {sizes}",
    )


def run_stock(model: Path, base: list[list[int]]) -> dict[str, Any]:
    """The stock engine's batch and solo runs: the numerics the plugin's runs are judged by."""
    import torch

    from steerserve.engine.api import SteerEngine

    stock = SteerEngine(_cfg(model, False))
    odd = list(range(1, 2 * SOLO_CHECKED, 2))
    out: dict[str, Any] = {"batch": _run(stock, base, None)}
    out["solo"] = _solo(stock, base, [None] * len(base), list(range(len(base))))
    out["sizes"] = {}
    for n in SIZES:
        ps = _prompts(n, 100 + n)
        batch = _run(stock, ps, None)
        out["sizes"][n] = (batch, _solo(stock, ps, [None] * n, [i for i in odd if i < n]))
    stock.shutdown()
    del stock
    torch.cuda.empty_cache()
    return out


def check_mixed(eng: Any, base: list[list[int]], stock: dict, atol: float, report: Report) -> None:
    batch = _run(eng, base, MIXED)
    solo = _solo(eng, base, MIXED, list(range(len(base))))
    verdicts, details = [], []
    for i in range(len(base)):
        v = compare(batch[i], solo[i], atol)
        verdicts.append(judged(v, compare(stock["batch"][i], stock["solo"][i], atol)))
        details.append(f"request {i}: {v[1]}")
    report.verdicts("mixed batch == solo", verdicts, details)
    plain = [i for i, s in enumerate(MIXED) if s is None]
    same = [compare(batch[i], stock["batch"][i], atol) for i in plain]
    bitwise = all(batch[i] == stock["batch"][i] for i in plain)
    report.check(
        "unsteered == stock engine (same batch)",
        all(c[0] != "differ" for c in same),
        f"bit for bit: {bitwise}; {[c[1] for c in same if c[1]]}",
    )
    moved = [
        compare(batch[i], stock["batch"][i], atol)[0] == "differ" for i, s in enumerate(MIXED) if s
    ]
    report.check("steering changes every steered request", all(moved), f"{sum(moved)}/{len(moved)}")
    zero = [[{"vector": "alpha", "layer": 1, "scale": 0.0, "positions": "all"}]] * len(base)
    z, u = _run(eng, base, zero), _run(eng, base, None)
    report.check(
        "scale 0 == unsteered",
        all(compare(a, b, atol)[0] != "differ" for a, b in zip(z, u, strict=True)),
    )


def check_sizes(eng: Any, stock: dict, atol: float, report: Report) -> None:
    """Half the requests steered (by an add, or by the non-additive ops); decode batches of
    exactly n requests for MAX_TOKENS steps."""
    for n in SIZES:
        ps = _prompts(n, 100 + n)
        st = [None if i % 2 == 0 else MIXED[1] if i % 4 == 1 else MIXED[-1] for i in range(n)]
        out = _run(eng, ps, st)
        stock_batch, stock_solo = stock["sizes"][n]
        plain = [compare(out[i], stock_batch[i], atol) for i in range(0, n, 2)]
        bad = [c[1] for c in plain if c[0] == "differ"]
        report.check(f"batch {n}: unsteered == stock engine (same batch)", not bad, "; ".join(bad))
        solo = _solo(eng, ps, st, sorted(stock_solo))
        verdicts, details = [], []
        for i, s in solo.items():
            v = compare(out[i], s, atol)
            verdicts.append(judged(v, compare(stock_batch[i], stock_solo[i], atol)))
            details.append(f"request {i}: {v[1]}")
        if verdicts:
            report.verdicts(f"batch {n}: steered == solo", verdicts, details)


def check_oracle(
    eng: Any, model: Path, base: list[list[int]], vecs: dict, atol: float, report: Report
) -> None:
    """transformers in float32 on CUDA, one prompt at a time, vs the plugin engine's solo runs.
    Both keep torch's matmuls in full fp32 (vLLM's workers set "highest": envs.py:630-635,
    v1/worker/gpu_worker.py:219-220); Triton attention's TF32 dots are the expected difference."""
    import torch
    from transformers import AutoModelForCausalLM

    from steerserve.engine.spec import SteeringEntry
    from steerserve.tune.reference import greedy

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    vecs = {k: v.cuda() for k, v in vecs.items()}
    outcomes = []
    for p, s in zip(base, MIXED, strict=True):
        toks, logps = greedy(hf, p, MAX_TOKENS, [SteeringEntry(**e) for e in s or []], vecs)
        ref: Steps = []
        for t, lp in zip(toks, logps, strict=True):
            top = {int(k): float(lp[k]) for k in lp.topk(TOP_K).indices}
            ref.append((t, top | {t: float(lp[t])}))
        outcomes.append(compare(_run(eng, [p], [s])[0], ref, atol))
    bad = [f"prompt {i}: {c[1]}" for i, c in enumerate(outcomes) if c[0] == "differ"]
    report.check("tokens and logprobs == transformers oracle (cuda)", not bad, "; ".join(bad))


def main() -> int:
    ap = argparse.ArgumentParser(description="GPU checks of the steering plugin (vLLM + CUDA).")
    ap.add_argument("--runner", choices=["v1", "v2"], required=True)
    ap.add_argument("--out", default=None, help="also write gpu_check_<runner>.json here")
    ap.add_argument(
        "--atol",
        type=float,
        default=1e-3,
        help="log-probability tolerance between runs whose batches differ (default 1e-3)",
    )
    args = ap.parse_args()
    if args.runner == "v1":  # read when the config is built (config/vllm.py:748-750)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

    import torch

    from steerserve.engine.api import SteerEngine
    from steerserve.models.tiny import build_tiny_model

    report = Report(args.runner)
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "llama", "llama")
    g = torch.Generator().manual_seed(0)
    vecs = {n: torch.randn(64, generator=g) * 1.5 for n in ("alpha", "beta")}
    base = _prompts(len(MIXED), 1)

    t = time.time()
    stock = run_stock(model, base)
    eng = SteerEngine(_cfg(model, True))
    report.results["init_s"] = round(time.time() - t, 1)
    _describe_runner(eng, report)
    for n, v in vecs.items():
        eng.register_vector(n, v)
    check_mixed(eng, base, stock, args.atol, report)
    check_sizes(eng, stock, args.atol, report)
    check_oracle(eng, model, base, vecs, args.atol, report)
    report.results["worker_info"] = eng.worker_info()
    eng.shutdown()

    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"gpu_check_{args.runner}.json").write_text(
            json.dumps(report.results, indent=2, default=str)
        )
    print(f"[{args.runner}] {len(report.failed)} failed: {report.failed}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
