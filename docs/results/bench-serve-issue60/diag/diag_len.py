"""Issue 60 diagnosis: is compiled steerserve's gap to stock per request (it grows with the requests a
pass admits while others decode) or per step? Passes of 16 prompts (one batch) and of 64 (48 admitted
mid-decode), alternated, stock and steerserve (nothing steered), servers alternated."""
import argparse, json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import bench_serve as B, harness

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--order", default="stock,steerserve,stock,steerserve")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", default="/tmp/diag/len")
    x = ap.parse_args()
    from steerserve.models import resolve_model
    model = Path(resolve_model("gemma-3-270m"))
    out = Path(x.out); out.mkdir(parents=True, exist_ok=True)
    rows = []
    for s, kind in enumerate(x.order.split(",")):
        a = argparse.Namespace(dtype="float32", compile=True, max_model_len=2048, max_num_seqs=64,
                               kv_cache_bytes=1 << 30, prompts=16, prompts_c1=4, input_len=32, output_len=48)
        flags = harness.engine_flags(a.dtype, a.max_model_len, a.max_num_seqs, a.kv_cache_bytes, True)
        if kind != "stock":
            flags += ["--steering", "off", "--log-level", "warning"]
        srv = harness.serve(kind, model, flags, out / "logs")
        try:
            B.bench(srv.url, str(model), a, 16, {}, 1)
            for i in range(x.passes):
                for p in ((16, 64) if i % 2 == 0 else (64, 16)):
                    a.prompts = p
                    before = srv.cpu_by_role()
                    r = B.bench(srv.url, str(model), a, 16, {}, 100 * s + 10 * i + p)
                    r["cpu"] = B.cpu_per_token(srv, before, a, 16)
                    rows.append({"server": s, "kind": kind, "prompts": p, "i": i} | r)
                    print(s, kind, p, round(r["output_throughput"], 1), round(r["median_tpot_ms"], 1),
                          round(r["median_ttft_ms"]), {k: round(v, 3) for k, v in r["cpu"].items()}, flush=True)
        finally:
            srv.stop()
    (out / "rows.json").write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
