"""The steering op with PyTorch alone, as on a bare GPU machine: each check runs in a fresh process
where importing vLLM, transformers or FastAPI fails as if they were not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_NOT_INSTALLED = """
import sys
from importlib.abc import MetaPathFinder

class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"vllm", "transformers", "fastapi"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""

_OP_FINGERPRINT = """
import torch
from steerserve.engine import kernels as op

g = torch.Generator().manual_seed(0)
x = torch.randn(9, 16, generator=g).to(torch.bfloat16)
index = torch.randint(0, 4, (32,), generator=g, dtype=torch.int32)
pool = torch.randn(4, 16, generator=g)
pool[0] = 0
print(op.REGISTERED_WITH)
print(torch.ops.steerserve.steer_add.default._schema)
print(torch.ops.steerserve.steer_add(x, index, pool).float().tolist())
print(sorted(m for m in sys.modules if m.partition(".")[0] == "vllm")[:1])
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_op_check_cpu_part_runs_without_vllm() -> None:
    run = _NOT_INSTALLED + (
        "import runpy\n"
        "sys.argv = [sys.argv[1], '--quick', '--cpu-only', '--backend', 'aot_eager']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = _python(run, str(ROOT / "bench" / "gpu_op_check.py"))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "op registered with torch.library" in out
    assert "FAIL" not in out
    assert "PASS  [cpu bfloat16 aot_eager] compiled op == eager, bit for bit" in out
    assert "SKIP  CUDA parts" in out
    assert "heavy modules imported: none" in out


def test_registration_without_vllm_matches_vllms() -> None:
    """Same schema and same bits whichever registration ran."""
    with_vllm = _python("import sys\n" + _OP_FINGERPRINT)
    without = _python(_NOT_INSTALLED + _OP_FINGERPRINT)
    assert with_vllm.returncode == 0, with_vllm.stderr
    assert without.returncode == 0, without.stderr
    got, ref = without.stdout.splitlines(), with_vllm.stdout.splitlines()
    assert (ref[0], ref[3]) == ("vllm", "['vllm']")
    assert (got[0], got[3]) == ("torch.library", "[]")
    assert got[1:3] == ref[1:3]
