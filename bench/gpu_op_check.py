"""Device check of the steering op on plain PyTorch: no vLLM, transformers or server needed.

The op (``torch.ops.steerserve.steer_add``) is the only code steering adds to a compiled,
graph-captured forward, so it can be checked on any machine with PyTorch and a GPU:

1. it registers without vLLM (``torch.library``; vLLM's registration where vLLM is installed);
2. eager: bit-identical to its definition ``hidden + pool[index[:n]].to(hidden.dtype)``, and
   row 0 leaves ``hidden`` bit-identical;
3. torch.compile (inductor, dynamic batch dimension, one graph): the op's output bit-identical to
   eager, bf16 and fp32, 1..512 tokens, without a recompile per size;
4. [CUDA] captured once per size in a CUDA graph, then replayed with the pool, index and hidden
   rewritten in place (no re-capture): every replay equals eager on the new contents, and neither
   replays nor the eager op synchronise with the host (``set_sync_debug_mode("error")``);
5. [CUDA] cost: the op (all tokens steered, and idle) vs ``hidden + 0`` vs the DRAM bound, and vs a
   decoder layer's lower bound, hidden 3072/4096 at 1..8192 tokens, bf16.

CPU-only machines run 1-3 and say the CUDA parts were skipped. One command, from the repository
root, with only PyTorch installed (a few minutes on a GPU, where it has not run yet; see
bench/README.md):

    python bench/gpu_op_check.py [--out DIR] [--cpu-only] [--backend inductor|aot_eager]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 2, 3, 4, 7, 8, 16, 31, 64, 100, 128, 255, 256, 384, 511, 512)
QUICK_SIZES = (1, 2, 3, 8, 64, 512)
POOL_ROWS = 1 + 64 * 4  # row 0 = zeros, then 4 rows for each of 64 requests (the engine's layout)
INDEX_LEN = 8192 + 512  # the full per-token buffer, longer than any batch (sliced inside the op)
REPLAYS = 3
COST_HIDDEN = {  # hidden -> (a model of that width, intermediate size, KV width, decoder layers)
    3072: ("Llama-3.2-3B", 8192, 1024, 28),
    4096: ("Llama-3.1-8B", 14336, 1024, 32),
}
COST_TOKENS = (1, 8, 64, 256, 1024, 4096, 8192)
STEERED_LAYERS = 2  # the shipped interventions: two entries, so at most two steered layers
HEAVY = ("vllm", "transformers", "fastapi")


class Checks:
    """PASS/FAIL lines as they happen, and the list for the summary and the exit code."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}".rstrip(), flush=True)
        self.rows.append({"check": name, "ok": bool(ok), "detail": detail})
        return ok

    @property
    def failed(self) -> list[str]:
        return [r["check"] for r in self.rows if not r["ok"]]


def load_op() -> Any:
    """The project's op module, importable from the repository root without installing it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from steerserve.engine import kernels as op

    return op


def definition(x: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """What the op must compute, written independently of its implementation."""
    return x + pool[index[: x.shape[0]].long()].to(x.dtype)


def model(x: torch.Tensor, index: torch.Tensor, pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The op between two compiled kernels, as in a decoder layer. ``x * 2`` is exact, so the
    op's input is the same bits compiled and eager."""
    y = torch.ops.steerserve.steer_add(x * 2, index, pool)
    return y, y - x


def buffers(hidden: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An index with a third of the tokens unsteered (row 0) and a float32 pool, row 0 zeros."""
    index = torch.randint(
        0, POOL_ROWS, (INDEX_LEN,), generator=gen, device=device, dtype=torch.int32
    )
    index[::3] = 0
    pool = torch.randn(POOL_ROWS, hidden, generator=gen, device=device)
    pool[0] = 0
    return index, pool


def hidden_states(
    n: int, hidden: int, dtype: torch.dtype, device: str, gen: torch.Generator
) -> torch.Tensor:
    return (torch.randn(n, hidden, generator=gen, device=device) * 4).to(dtype)


def check_registration(op: Any, check: Checks) -> None:
    schema = str(torch.ops.steerserve.steer_add.default._schema)
    check("op registered", hasattr(torch.ops.steerserve, "steer_add"), f"with {op.REGISTERED_WITH}")
    check(
        "schema",
        schema
        == "steerserve::steer_add(Tensor hidden, Tensor index, Tensor pool, Tensor? gate=None)"
        " -> Tensor",
        schema,
    )


def check_eager(op: Any, device: str, sizes: tuple[int, ...], hidden: int, check: Checks) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    index, pool = buffers(hidden, device, gen)
    for dtype in (torch.bfloat16, torch.float32):
        exact = unsteered_exact = True
        for n in sizes:
            x = hidden_states(n, hidden, dtype, device, gen)
            out = op.steer_add(x, index, pool)
            exact &= torch.equal(out, definition(x, index, pool))
            zero = index[:n] == 0
            unsteered_exact &= torch.equal(out[zero], x[zero])
        tag = f"[{device} {str(dtype)[6:]}]"
        check(f"{tag} eager == definition, bit for bit", exact, f"sizes {sizes[0]}..{sizes[-1]}")
        check(f"{tag} row 0 leaves hidden bit-identical", unsteered_exact)


def check_compile(
    device: str,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    hidden: int,
    backend: str,
    check: Checks,
) -> tuple[Callable[..., Any], Any]:
    """Compile ``model`` once with a dynamic batch dimension; returns it for graph capture."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    fn = torch.compile(model, backend=counter, fullgraph=True)
    gen = torch.Generator(device=device).manual_seed(1)
    index, pool = buffers(hidden, device, gen)
    y_exact, z_exact, z_close = True, True, True
    rtol = 1e-6 if dtype == torch.float32 else 1e-2  # one rounding step of the dtype
    t0 = time.perf_counter()
    for n in sizes:
        x = hidden_states(n, hidden, dtype, device, gen)
        if n > 1:  # size 1 is specialised by Dynamo whatever we mark
            torch._dynamo.mark_dynamic(x, 0)
        (yc, zc), (ye, ze) = fn(x, index, pool), model(x, index, pool)
        y_exact &= torch.equal(yc, ye) and yc.dtype == ye.dtype and yc.shape == ye.shape
        z_exact &= torch.equal(zc, ze)
        z_close &= torch.allclose(zc.float(), ze.float(), rtol=rtol, atol=rtol)
    secs = time.perf_counter() - t0
    tag = f"[{device} {str(dtype)[6:]} {backend}]"
    in_graph = any(
        "steerserve.steer_add" in str(node.target) for g in counter.graphs for node in g.graph.nodes
    )
    check(f"{tag} op is one call in the compiled graph", in_graph)
    # More graphs than sizes would mean a recompile per size and, past Dynamo's limit, a silent
    # fallback to eager that would make the comparisons below vacuous.
    check(f"{tag} no recompile per size", counter.frame_count <= 3, f"{counter.frame_count} graphs")
    check(f"{tag} compiled op == eager, bit for bit", y_exact, f"{len(sizes)} sizes, {secs:.0f} s")
    check(f"{tag} compiled downstream kernel == eager", z_close, f"bit for bit: {z_exact}")
    return fn, counter


def capture(call: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm up on a side stream (allocator, lazy init), then capture one call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def sync_debug_armed() -> bool:
    """A deliberate host sync must raise, or the no-sync check proves nothing."""
    try:
        torch.zeros(1, device="cuda").item()
    except RuntimeError:
        return True
    return False


def replay_rewritten(
    op: Any, staged: list[tuple], index: torch.Tensor, pool: torch.Tensor, versions: list[tuple]
) -> tuple[dict[tuple[int, int], tuple[torch.Tensor, ...]], bool, str]:
    """Rewrite pool, index and hidden in place (the graphs keep their addresses), replay every
    graph and run the eager op, all with host syncs turned into errors."""
    got: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    armed, sync_error = False, ""
    torch.cuda.synchronize()  # outside the checked region: capture and staging are done
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        armed = sync_debug_armed()
        for k, (index_k, pool_k) in enumerate(versions):
            index.copy_(index_k)
            pool.copy_(pool_k)
            for n, x, xs, g_op, out_op, g_fn, out_y in staged:
                x.copy_(xs[k])
                g_op.replay()
                g_fn.replay()
                got[n, k] = (out_op.clone(), out_y.clone(), op.steer_add(x, index, pool))
    except RuntimeError as e:
        sync_error = str(e).splitlines()[0] if str(e) else type(e).__name__
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    return got, armed, sync_error


def check_graphs(
    op: Any,
    fn: Callable[..., Any],
    counter: Any,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    hidden: int,
    check: Checks,
) -> None:
    """One capture per size, with nothing steered (as vLLM captures); replays after the pool,
    index and hidden were rewritten in place must compute on the new contents."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(2)
    index = torch.zeros(INDEX_LEN, dtype=torch.int32, device=dev)
    pool = torch.zeros(POOL_ROWS, hidden, device=dev)
    versions = [buffers(hidden, dev, gen) for _ in range(REPLAYS)]
    frames = counter.frame_count
    staged = []
    for n in sizes:
        x = torch.zeros(n, hidden, dtype=dtype, device=dev)
        g_op, out_op = capture(functools.partial(op.steer_add, x, index, pool))
        g_fn, out_fn = capture(functools.partial(fn, x, index, pool))
        xs = [hidden_states(n, hidden, dtype, dev, gen) for _ in range(REPLAYS)]
        staged.append((n, x, xs, g_op, out_op, g_fn, out_fn[0]))
    got, armed, sync_error = replay_rewritten(op, staged, index, pool, versions)
    ok_op = ok_fn = ok_eager = len(got) == len(sizes) * REPLAYS
    for n, _x, xs, *_ in staged:
        for k, (index_k, pool_k) in enumerate(versions):
            if (n, k) in got:
                r_op, r_fn, r_eager = got[n, k]
                ref = definition(xs[k], index_k, pool_k)
                ok_op &= torch.equal(r_op, ref)
                ok_eager &= torch.equal(r_eager, ref)
                ok_fn &= torch.equal(r_fn, definition(xs[k] * 2, index_k, pool_k))
    xs_last = staged[-1][2]  # the steering delta itself changes between rewrites
    deltas = [definition(xs_last[k], *versions[k]) - xs_last[k] for k in (0, 1)]
    moved = not torch.equal(*deltas)
    tag = f"[cuda {str(dtype)[6:]}]"
    detail = f"{len(sizes)} sizes x {REPLAYS} rewrites, one capture each"
    check(f"{tag} sync debug mode armed (a deliberate .item() raises)", armed)
    check(f"{tag} no host sync in replays or the eager op", not sync_error, sync_error)
    check(f"{tag} graph replay (eager op) == eager on rewritten buffers", ok_op, detail)
    check(f"{tag} graph replay (compiled) == eager on rewritten buffers", ok_fn, detail)
    check(f"{tag} rewrites change the steering delta (a stale replay would fail)", moved)
    check(f"{tag} eager op inside the same loop == definition", ok_eager)
    check(f"{tag} no recompile while capturing", counter.frame_count == frames)


def time_per_call(call: Callable[[], Any], graph: bool, reps: int = 20, iters: int = 10) -> float:
    """Microseconds per call, median of 3: ``reps`` calls in one CUDA graph replayed ``iters``
    times (kernel time, no launch cost), or launched eagerly (what a step outside graphs pays)."""

    def body() -> None:
        for _ in range(reps):
            call()

    run = capture(body)[0].replay if graph else body
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * iters))
    return statistics.median(times)


def device_limits() -> tuple[float, float]:
    """Achieved DRAM bandwidth (bytes/s, a 2 GiB device copy) and bf16 matmul rate (FLOP/s):
    the measured ceilings the bounds below are computed from."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = time_per_call(functools.partial(dst.copy_, src), graph=False, reps=5, iters=2)
    bandwidth = 2 * src.numel() * src.element_size() / (us * 1e-6)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    us = time_per_call(functools.partial(torch.mm, a, a), graph=False, reps=5, iters=2)
    del a
    torch.cuda.empty_cache()
    return bandwidth, 2 * 8192**3 / (us * 1e-6)


def measure_cost(op: Any) -> dict[str, Any]:
    bandwidth, flops = device_limits()
    rows = []
    for hidden, (name, inter, kv, layers) in COST_HIDDEN.items():
        params = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter
        gen = torch.Generator(device="cuda").manual_seed(3)
        steered = torch.randint(
            1, POOL_ROWS, (INDEX_LEN,), generator=gen, device="cuda", dtype=torch.int32
        )
        idle = torch.zeros_like(steered)
        pool = torch.randn(POOL_ROWS, hidden, generator=gen, device="cuda")
        for t in COST_TOKENS:
            x = torch.randn(t, hidden, generator=gen, device="cuda").to(torch.bfloat16)
            op_g = time_per_call(functools.partial(op.steer_add, x, steered, pool), graph=True)
            idle_g = time_per_call(functools.partial(op.steer_add, x, idle, pool), graph=True)
            add_g = time_per_call(functools.partial(torch.add, x, 0), graph=True)
            op_e = time_per_call(functools.partial(op.steer_add, x, steered, pool), graph=False)
            add_e = time_per_call(functools.partial(torch.add, x, 0), graph=False)
            # Least DRAM traffic for the op: read hidden, write the sum, read the distinct rows.
            least = 2 * t * hidden * 2 + min(t, POOL_ROWS - 1) * hidden * 4 + t * 4
            bound = least / bandwidth * 1e6
            # A decoder layer reads its weights once and does 2 FLOPs per weight per token.
            layer = max(params * 2 / bandwidth, 2 * t * params / flops) * 1e6
            rows.append(
                {
                    "hidden": hidden, "tokens": t, "op_graph_us": op_g, "op_idle_graph_us": idle_g,
                    "add0_graph_us": add_g, "op_eager_us": op_e, "add0_eager_us": add_e,
                    "dram_bound_us": bound, "layer_min_us": layer, "model": name,
                    "op_per_layer_pct": 100 * op_g / layer,
                    "op_per_step_pct": 100 * STEERED_LAYERS * op_g / (layers * layer),
                }
            )  # fmt: skip
    return {"dram_bytes_per_s": bandwidth, "bf16_flop_per_s": flops, "rows": rows}


def print_cost(cost: dict[str, Any]) -> None:
    print(
        f"\ncost, bf16, every token steered unless 'idle'; measured ceilings: "
        f"DRAM {cost['dram_bytes_per_s'] / 1e12:.2f} TB/s, matmul "
        f"{cost['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s (us per call; graph = kernel time)"
    )
    head = (
        f"{'hidden':>6} {'tokens':>6} {'op':>8} {'idle op':>8} {'x+0':>8} {'op eag':>8} "
        f"{'x+0 eag':>8} {'DRAM lb':>8} {'op/x+0':>7} {'op/lb':>6} {'layer lb':>9} "
        f"{'op/layer':>8} {'op/step':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in cost["rows"]:
        print(
            f"{r['hidden']:>6} {r['tokens']:>6} {r['op_graph_us']:>8.2f} "
            f"{r['op_idle_graph_us']:>8.2f} {r['add0_graph_us']:>8.2f} {r['op_eager_us']:>8.2f} "
            f"{r['add0_eager_us']:>8.2f} {r['dram_bound_us']:>8.2f} "
            f"{r['op_graph_us'] / r['add0_graph_us']:>7.2f} "
            f"{r['op_graph_us'] / r['dram_bound_us']:>6.1f} {r['layer_min_us']:>9.1f} "
            f"{r['op_per_layer_pct']:>7.2f}% {r['op_per_step_pct']:>7.3f}%"
        )
    models = ", ".join(f"{h}: {m[0]} ({m[3]} layers)" for h, m in COST_HIDDEN.items())
    print(
        f"layer lb = max(weights / DRAM, 2 FLOPs x weights x tokens / matmul) of one decoder layer "
        f"({models}); op/step = {STEERED_LAYERS} steered layers over all layers' lower bounds."
    )


def header(op: Any, cuda: bool) -> None:
    import importlib.util

    triton = importlib.util.find_spec("triton") is not None
    device = torch.cuda.get_device_name() if cuda else "none (CPU only)"
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, triton "
        f"{'present' if triton else 'absent'}, CUDA device: {device}; op registered with "
        f"{op.REGISTERED_WITH}",
        flush=True,
    )


def has_kernel(device: str) -> bool:
    """vLLM registers the op for its platform's device only (CUDA on a GPU machine)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}[device]
    return torch._C._dispatch_has_kernel_for_dispatch_key("steerserve::steer_add", key)


def run_cpu(op: Any, args: argparse.Namespace, compile_too: bool, check: Checks) -> None:
    if not has_kernel("cpu"):
        print(f"SKIP  CPU parts: the op has no CPU kernel (registered with {op.REGISTERED_WITH})")
        return
    sizes, hidden = (QUICK_SIZES, 64) if args.quick else (SIZES, 256)
    check_eager(op, "cpu", sizes, hidden, check)
    if compile_too:  # on a GPU machine the CUDA compile check covers this
        for dtype in (torch.bfloat16, torch.float32):
            check_compile("cpu", dtype, sizes, hidden, args.backend, check)


def run_cuda(op: Any, args: argparse.Namespace, check: Checks) -> dict[str, Any]:
    if not check(
        "op has a CUDA kernel", has_kernel("cuda"), f"registered with {op.REGISTERED_WITH}"
    ):
        return {}
    check_eager(op, "cuda", SIZES, 4096, check)
    for dtype in (torch.bfloat16, torch.float32):
        fn, counter = check_compile("cuda", dtype, SIZES, 4096, args.backend, check)
        check_graphs(op, fn, counter, dtype, SIZES, 4096, check)
    cost = measure_cost(op)
    print_cost(cost)
    return cost


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write gpu_op_check.json here")
    ap.add_argument("--cpu-only", action="store_true", help="skip the CUDA parts on a GPU machine")
    ap.add_argument(
        "--backend", default="inductor", choices=["inductor", "aot_eager"],
        help="torch.compile backend (aot_eager: traces the op through its fake, compiles nothing)",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="fewer sizes and a narrow hidden on CPU")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    op = load_op()
    cuda = torch.cuda.is_available() and not args.cpu_only
    header(op, cuda)
    check = Checks()
    check_registration(op, check)
    run_cpu(op, args, not cuda, check)
    cost: dict[str, Any] = {}
    if cuda:
        cost = run_cuda(op, args, check)
    else:
        why = "--cpu-only" if args.cpu_only else "torch.cuda.is_available() is False"
        print(f"SKIP  CUDA parts (eager, compile, graph capture/replay, sync check, cost): {why}")
    heavy = [m for m in HEAVY if m in sys.modules]
    print(f"heavy modules imported: {', '.join(heavy) or 'none'}")
    secs = time.perf_counter() - t0
    print(f"{len(check.rows)} checks, {len(check.failed)} failed {check.failed}, {secs:.0f} s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "torch": torch.__version__, "registered_with": op.REGISTERED_WITH, "cuda": cuda,
            "device": torch.cuda.get_device_name() if cuda else None, "heavy_modules": heavy,
            "checks": check.rows, "cost": cost, "seconds": secs,
        }  # fmt: skip
        (args.out / "gpu_op_check.json").write_text(json.dumps(result, indent=2))
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
