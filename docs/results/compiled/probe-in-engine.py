"""Issue 48's probe (2026-12-06): one compiled steerserve engine (default model, as bench/compiled.py
builds it, before that bench bound every core), arms alternated three times at 16 concurrent:
does all-``add`` cost anything inside one engine's life? Output: probe-in-engine-2026-12-06.txt.

    .venv/bin/python docs/results/compiled/probe-in-engine.py
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
from latency import model_dir  # noqa: E402
from overhead import _entries, _prompts, _tps, build_engine, register_vectors  # noqa: E402


def main():
    from vllm import SamplingParams

    model = str(model_dir("default"))
    eng = build_engine(model, 16, 1 << 30, compiled=True, steering=True, dtype="auto")
    register_vectors(eng)
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = _prompts(16)
    E = _entries(eng)
    arms = {
        "idle": None,
        "add": [E] * 16,
        "add_small": [[e | {"scale": e["scale"] * 1e-3} for e in E]] * 16,
        "ablate": [[e | {"op": "ablate"} for e in E]] * 16,
    }
    for name, st in arms.items():
        outs = eng.generate(prompts[:2], sp, steering=st[:2] if st else None)
        print(name, repr(outs[0].outputs[0].text[:120]), flush=True)
    res = {k: [] for k in arms}
    for cyc in range(3):
        order = list(arms) if cyc % 2 == 0 else list(arms)[::-1]
        for name in order:
            res[name].append(_tps(eng, prompts, arms[name], sp))
            print(cyc, name, round(res[name][-1], 2), flush=True)
    print(json.dumps(res))
    eng.shutdown()


if __name__ == "__main__":
    main()
