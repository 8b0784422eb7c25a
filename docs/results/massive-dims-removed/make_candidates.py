"""Candidates with each layer's 4 massive residual dimensions zeroed (experiment, not shipped)."""
import torch
from steerserve.extract import NORM_KEY, Candidates

if __name__ == "__main__":
    c = Candidates.load("out/v3/candidates.safetensors")
    raw = c.tensors["recall.native.raw"]  # [L, H] mean last-token state
    massive = raw.abs().topk(4, dim=-1).indices  # [L, 4]
    out = {}
    for k, v in c.tensors.items():
        if k == NORM_KEY or k.endswith(".raw"):
            out[k] = v
            continue
        v = v.clone()
        for layer in range(v.shape[0]):
            v[layer, massive[layer]] = 0.0
        out[k] = v
    meta = dict(c.meta, note="massive dims (top-4 |mean state| per layer) zeroed",
                massive_dims=massive.tolist())
    Candidates(out, meta).save("out/v4/candidates.safetensors")
    for L in (2, 4, 6, 8, 12, 14, 16):
        kept = out["recall.native.diff"][L].norm() / c.tensors["recall.native.diff"][L].norm()
        print(L, massive[L].tolist(), f"native.diff norm kept {kept:.2f}")
