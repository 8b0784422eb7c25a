"""Issue 60 diagnosis: py-spy of every process of stock, steerserve and steerserve --ops-per-layer 0 (compiled with --compile, --c 16), after 3 timed passes with each role's CPU per token."""
import argparse, json, sys, time
from pathlib import Path
sys.path.insert(0, "bench")
import bench_serve as B, harness, pyspy

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="stock,steerserve")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--extra", default="")  # extra steerserve flags, comma separated
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--c", type=int, default=1)
    ap.add_argument("--out", default="/tmp/diag/out")
    x = ap.parse_args()
    from steerserve.models import resolve_model
    model = Path(resolve_model("gemma-3-270m"))
    a = argparse.Namespace(dtype="float32", compile=x.compile, max_model_len=2048, max_num_seqs=64,
                           kv_cache_bytes=1 << 30, vectors=True, prompts=16, prompts_c1=4,
                           input_len=32, output_len=48)
    out = Path(x.out); out.mkdir(parents=True, exist_ok=True)
    res = {}
    for kind in x.kinds.split(","):
        kind, _, variant = kind.partition(":")
        flags = harness.engine_flags(a.dtype, a.max_model_len, a.max_num_seqs, a.kv_cache_bytes, a.compile)
        if kind != "stock":
            flags += ["--steering", "off", "--log-level", "warning"] + (variant.split() if variant else [])
        srv = harness.serve("stock" if kind == "stock" else "steerserve", model, flags, out / "logs")
        try:
            B.bench(srv.url, str(model), a, x.c, {}, 1)  # warm-up
            rows = []
            for i in range(x.passes):
                before = srv.cpu_by_role()
                r = B.bench(srv.url, str(model), a, x.c, {}, 10 + i)
                r["cpu"] = B.cpu_per_token(srv, before, a, x.c)
                rows.append(r); print(kind, json.dumps(r), flush=True)
            folder = out / f"spy-{kind}{variant.replace(' ', '_')}"
            r = pyspy.profiled(srv.tree(), folder, lambda: B.bench(srv.url, str(model), a, x.c, {}, 99))
            secs = pyspy.seconds([folder], pyspy.role_of)
            res[kind + variant] = {"passes": rows, "spy": secs, "spy_pass": r}
            for role, cats in secs.items():
                top = sorted(cats.items(), key=lambda kv: -kv[1])[:10]
                print(kind, role, ", ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
        finally:
            srv.stop()
    (out / "result.json").write_text(json.dumps(res, indent=1, default=str))

if __name__ == "__main__":
    main()
