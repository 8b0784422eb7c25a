"""Issue 60 diagnosis: does an unsteered pass run slower after steered passes in the same server?"""
import argparse, json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import bench_serve as B, harness

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--seq", default="off,off,off,on,on,on,off,off,off,all,all,all,off,off,off")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--kind", default="steerserve")
    ap.add_argument("--out", default="/tmp/diag/seq")
    x = ap.parse_args()
    from steerserve.models import resolve_model
    model = Path(resolve_model("gemma-3-270m"))
    a = argparse.Namespace(dtype="float32", compile=x.compile, max_model_len=2048, max_num_seqs=64,
                           kv_cache_bytes=1 << 30, prompts=x.prompts, prompts_c1=4,
                           input_len=32, output_len=48)
    out = Path(x.out); out.mkdir(parents=True, exist_ok=True)
    flags = harness.engine_flags(a.dtype, a.max_model_len, a.max_num_seqs, a.kv_cache_bytes, a.compile)
    if x.kind != "stock":
        flags += ["--steering", "off", "--log-level", "warning"]
    srv = harness.serve(x.kind, model, flags, out / "logs")
    rows = []
    try:
        bodies = B.arm_bodies(srv.url) if x.kind != "stock" else {"off": {}}
        B.bench(srv.url, str(model), a, 16, {}, 1)
        for i, arm in enumerate(x.seq.split(",")):
            before = srv.cpu_by_role()
            r = B.bench(srv.url, str(model), a, 16, bodies[arm], 1000 + i)
            r["cpu"] = B.cpu_per_token(srv, before, a, 16)
            rows.append({"i": i, "arm": arm} | r)
            print(i, arm, round(r["output_throughput"], 1), {k: round(v, 2) for k, v in r["cpu"].items()}, flush=True)
    finally:
        srv.stop()
    (out / f"{x.kind}-{'c' if x.compile else 'e'}.json").write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
