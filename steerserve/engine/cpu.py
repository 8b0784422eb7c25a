"""Serving defaults for a CPU, where vLLM's own are measured to be slow (docs/benchmarks.md,
"Chat model"): bfloat16 compute without native support, and one core of two left to the front end.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping
from pathlib import Path

#: CPU flags of native bfloat16 matrix products (AVX512-BF16, AMX); without them vLLM's
#: ``dtype=auto`` (bfloat16 for a float32 checkpoint) is compute-bound: 1.9 vs 3.3 tokens/s.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: CPU flags where ``--embedded-quantization auto`` serves 4-bit weights: where it was measured faster,
#: i.e. single-stream decode and a 16-way burst both no slower than bfloat16 (a server default must
#: not trade throughput under load for one stream's latency). None yet (docs/benchmarks.md, "4-bit
#: weights"): on AVX-512 BF16 without AMX (AMD EPYC Zen 4) 166 vs 132 ms/token, bursts 0.49x; on
#: AMX (Xeon) the w4a8 kernel decodes 83 vs 151 ms/token but bursts at 0.79x (74 vs 93 tokens/s).
W4_AUTO_FLAGS: tuple[str, ...] = ()


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def serve_dtype(dtype: str, on_gpu: bool, flags: set[str] | None = None) -> str:
    """``auto`` becomes float32 on a CPU without native bfloat16; anything else is kept."""
    if dtype != "auto" or on_gpu:
        return dtype
    flags = cpu_flags() if flags is None else flags
    return dtype if any(f in flags for f in BF16_FLAGS) else "float32"


#: vLLM's switch between its two 4-bit CPU kernels on AMX (w4_kernel), read at weight loading.
W4A8_ENV = "VLLM_CPU_INT4_W4A8"
#: The dtypes vLLM's 4-bit CPU kernel computes in (AutoAWQConfig.get_supported_act_dtypes).
W4_DTYPES = ("bfloat16", "float16")


def w4_kernel(dtype: str, env: MutableMapping[str, str] | None = None) -> str:
    """The 4-bit kernel vLLM 0.32's CPUWNA16LinearKernel picks (its own rule, restated so that
    serve and bench/ can say which ran): on an AMX CPU in bfloat16 ``int4_scaled_mm_cpu``, which
    also quantizes each token's activations to int8 (``w4a8``), unless ``VLLM_CPU_INT4_W4A8=0``;
    else ``cpu_gemm_wna16`` (16-bit activations) on its ``amx`` or ``vec`` path."""
    import torch

    env = os.environ if env is None else env
    amx = torch.cpu._is_amx_tile_supported() and dtype == "bfloat16"
    if amx and env.get(W4A8_ENV, "1") not in ("0", ""):
        return "w4a8 (int4_scaled_mm_cpu, int8 activations)"
    return f"w4a16 (cpu_gemm_wna16, {'amx' if amx else 'vec'})"


def w4_missing(on_gpu: bool = False) -> str | None:
    """Why this machine's vLLM build cannot run the 4-bit checkpoint, or None. vLLM's CPU wheel
    loads its AVX2 library on a CPU without AVX-512, and that one has neither 4-bit kernel."""
    if on_gpu:
        return None
    import torch
    import vllm._custom_ops  # noqa: F401 (registers torch.ops._C's CPU kernels)

    if hasattr(torch.ops._C, "cpu_gemm_wna16") or hasattr(torch.ops._C, "int4_scaled_mm_cpu"):
        return None
    return "vLLM's CPU build loaded here has no 4-bit kernel (cpu_gemm_wna16, int4_scaled_mm_cpu)"


def serve_w4(choice: str, on_gpu: bool, flags: set[str] | None = None) -> bool:
    """Whether ``--embedded-quantization choice`` serves the 4-bit checkpoint where there is one. ``auto``:
    on a CPU with one of W4_AUTO_FLAGS (where it was measured faster); never on a GPU."""
    if choice != "auto":
        return choice == "w4"
    if on_gpu:
        return False
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in W4_AUTO_FLAGS)


def core_list(cores: Iterable[int]) -> str:
    """``0-3,6,8-9``: the form ``VLLM_CPU_OMP_THREADS_BIND`` takes."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cores)):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cores_of(spec: str) -> list[int]:
    """The cores of a ``core_list`` string (``0-3,6``), in the order written; raises ValueError
    on a malformed or empty list."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    if not out:
        raise ValueError(spec)
    return out


def bind_all_cores(
    env: MutableMapping[str, str], on_gpu: bool, ranks: int, cores: Iterable[int] | None = None
) -> str | None:
    """With one CPU worker (TP x PP = 1) and no binding chosen, bind its threads to every core
    this process may run on (vLLM's default leaves one to the front end, which needs little:
    p50 of a chat reply 10.4 vs 16.0 s on two cores). Returns what it set, or None."""
    if on_gpu or ranks != 1 or env.get(BIND):
        return None
    cores = os.sched_getaffinity(0) if cores is None else cores
    env[BIND] = core_list(cores)
    return env[BIND]
