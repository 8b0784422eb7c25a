"""Helpers shared by the engine tests: engines on tiny models, runs, the transformers oracle.

Tolerance: greedy tokens must be identical; the chosen tokens' log-probabilities must agree with
transformers' (float32) within LOGPROB_ATOL.
"""

from __future__ import annotations

from pathlib import Path

import torch

from steerserve.engine.spec import SteeringEntry
from steerserve.tune.reference import greedy

LOGPROB_ATOL = 2e-4
MAX_TOKENS = 10


def vectors(hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(hidden, generator=g) * 1.5 for name in ("alpha", "beta")}


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 9, 33, 3, 24, 12, 41, 7, 28][:n]
    return [[1] + torch.randint(4, 250, (ln,), generator=g).tolist() for ln in lengths]


def engine(model: Path, **kw):
    from steerserve.engine.api import EngineConfig, SteerEngine

    cfg = EngineConfig(
        model=str(model), dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20, **kw
    )
    eng = SteerEngine(cfg)
    if cfg.steering:
        for name, v in vectors(eng.shape.hidden_size).items():
            eng.register_vector(name, v)
    return eng


def run(eng, prompts, steering):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = eng.generate(prompts, sp, steering=steering)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        res.append((list(c.token_ids), lps))
    return res


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_against_reference(hf, eng, prompts, steering):
    vecs = vectors(eng.shape.hidden_size)
    got = run(eng, prompts, steering)
    for prompt, entries, (toks, lps) in zip(prompts, steering, got, strict=True):
        ref_toks, ref_lps = greedy(
            hf, prompt, MAX_TOKENS, [SteeringEntry(**e) for e in entries or []], vecs
        )
        assert toks == ref_toks, f"tokens differ for {entries}: {toks} vs {ref_toks}"
        diff = max(abs(a - float(r[t])) for a, r, t in zip(lps, ref_lps, toks, strict=True))
        assert diff < LOGPROB_ATOL, f"logprob diff {diff}"
    return got
