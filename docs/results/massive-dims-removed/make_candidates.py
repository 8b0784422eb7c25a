"""Candidates with each layer's 4 massive residual dimensions zeroed (an experiment, not shipped).

    python docs/results/massive-dims-removed/make_candidates.py IN.safetensors OUT.safetensors

The massive dimensions of a layer are the 4 largest |mean last-token state| (``recall.native.raw``);
raw means and the residual norms are kept as they are.
"""

import sys

from steerserve.research.extract import NORM_KEY, Candidates

if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    c = Candidates.load(src)
    massive = c.tensors["recall.native.raw"].abs().topk(4, dim=-1).indices  # [L, 4]
    out = {}
    for k, v in c.tensors.items():
        if k != NORM_KEY and not k.endswith(".raw"):
            v = v.clone()
            for layer in range(v.shape[0]):
                v[layer, massive[layer]] = 0.0
        out[k] = v
    meta = dict(c.meta, note="massive dims zeroed", massive_dims=massive.tolist())
    Candidates(out, meta).save(dst)
    for layer in range(massive.shape[0]):
        kept = (
            out["recall.native.diff"][layer].norm() / c.tensors["recall.native.diff"][layer].norm()
        )
        print(layer, massive[layer].tolist(), f"recall.native.diff norm kept {kept:.2f}")
